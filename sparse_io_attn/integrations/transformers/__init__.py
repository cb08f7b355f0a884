"""Block-sparse attention as a Hugging Face Transformers ``attn_implementation`` (needs
``transformers>=5``, the extra ``hf``; importing :mod:`sparse_io_attn` imports neither this package
nor Transformers)::

    from sparse_io_attn.integrations import transformers as sia_hf
    sia_hf.register()                                   # attn_implementation "sparse_io_attn"
    config = LlamaConfig(..., sparse_attention={"pattern": "sliding_window:window=256", "block_size": 64})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_io_attn")

Contract: each layer attends to exactly the elements its pattern (``config.sparse_attention``, on
absolute positions of the cache) allows **and** the model's own mask allows (causality, padding,
packed documents, a built-in sliding window): the pattern never widens the model's mask. Without
padding or packing no element mask is built and the layout runs with ``causal="bottom_right"``.
Unsupported features (dropout > 0, softcap, attention sinks, position biases, paged caches) raise
``NotImplementedError``. ``"nsa:block=..,num_blocks=..,window=.."`` replaces the attention by NSA's
three gated branches and needs NSA's gate weights (:func:`add_nsa_gates`). Change ``config.sparse_attention`` after a forward only with
:func:`reset_layouts` afterwards.
"""
from sparse_io_attn.integrations.transformers.config import (CONFIG_ATTR, DEFAULT_BLOCK_SIZE, LayerPattern,
                                                             layer_pattern)
from sparse_io_attn.integrations.transformers.interface import (DEFAULT_NAME, register, sparse_io_attn_forward,
                                                                sparse_io_attn_mask)
from sparse_io_attn.integrations.transformers.layouts import pattern_layout, reset_layouts
from sparse_io_attn.integrations.transformers.nsa import add_nsa_gates

__all__ = ["register", "sparse_io_attn_forward", "sparse_io_attn_mask", "LayerPattern", "layer_pattern",
           "pattern_layout", "reset_layouts", "add_nsa_gates", "DEFAULT_NAME", "DEFAULT_BLOCK_SIZE", "CONFIG_ATTR"]
