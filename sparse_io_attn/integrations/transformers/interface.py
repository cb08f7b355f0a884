"""The two Transformers entry points (``AttentionInterface`` and ``AttentionMaskInterface``) and
:func:`register`, which installs them under an ``attn_implementation`` name."""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("sparse_io_attn.integrations.transformers needs Hugging Face Transformers >= 5: "
                      "pip install 'sparse-io-attn[hf]' (or pip install 'transformers>=5')") from exc

from sparse_io_attn.integrations.transformers.decode_state import select_with_state
from sparse_io_attn.integrations.transformers.layouts import (check_lengths, runs_packed, layout_no_mask, layout_with_mask,
                                                              module_selector, packed_sequences, remember_mask,
                                                              selection_layout_with_mask)
from sparse_io_attn.integrations.transformers.nsa import nsa_forward
from sparse_io_attn.block_sparse.api import block_sparse_attention
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn.nsa import NSAAttention
from sparse_io_attn.selection.api import selection_attention

DEFAULT_NAME = "sparse_io_attn"


def _check_version() -> None:
    major = int(str(_transformers.__version__).split(".")[0])
    if major < 5:
        raise ImportError(f"sparse_io_attn.integrations.transformers needs transformers >= 5, found "
                          f"{_transformers.__version__}: pip install 'sparse-io-attn[hf]'")


def sparse_io_attn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                        mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                        allow_is_causal_skip: bool = True, **kwargs) -> Optional[torch.Tensor]:
    """The ``AttentionMaskInterface`` entry: ``None`` when the model's mask is plain causal with the
    queries at the end of the keys (no padding, no packing, dynamic cache): the layout and
    ``causal="bottom_right"`` then express it without any element mask. Otherwise the boolean element
    mask ``[batch, 1, q_length, kv_length]`` of ``sdpa_mask``, with its offsets remembered so the
    pattern lands on the right absolute positions."""
    from transformers import masking_utils as mu
    from transformers.utils.import_utils import is_tracing

    if mask_function is None:
        mask_function = mu.causal_mask_function
    if allow_is_causal_skip and mask_function is mu.causal_mask_function \
            and not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor) \
            and kv_offset == 0 and q_offset == kv_length - q_length:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if not is_tracing(padding) and bool(padding.all()):
            return None
    for k in ("allow_is_bidirectional_skip", "allow_is_causal_skip"):
        kwargs.pop(k, None)
    mask = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    # Transformers detects packed sequences (position_ids restarts) only without a 2-D mask
    maybe_packed = attention_mask is None and q_length == kv_length
    if maybe_packed or isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) \
            or (q_offset, kv_offset) != (kv_length - q_length, 0):
        # contiguous now, so that generate()'s .contiguous() returns this very tensor (the key)
        mask = remember_mask(mask.contiguous(), q_offset, kv_offset, maybe_packed)
    return mask


_UNSUPPORTED = {
    "softcap": "attention logit soft-capping",
    "position_bias": "an additive position bias",
}


def sparse_io_attn_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry: ``query [B, Hq, Nq, D]``, ``key/value [B, Hkv, Nk, D]`` ->
    ``(out [B, Nq, Hq, D], None)``. The layout comes from ``module.config.sparse_attention``
    (:mod:`.config`); ``attention_mask`` is ``None`` or the element mask of
    :func:`sparse_io_attn_mask`. ``"nsa:..."`` runs NSA's gated branches instead (:mod:`.nsa`).
    ``s_aux`` (gpt-oss's per-head sink logits ``[Hq]``, the model's ``sinks`` parameter) is passed on as
    ``sinks=``: it joins each row's softmax denominator, as gpt-oss's eager attention, and gets its gradient."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"sparse_io_attn does not support {what} ({name}=...); use "
                                      f"attn_implementation='eager' for this model")
    sinks = _sinks(kwargs)
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError("sparse_io_attn does not support paged caches (continuous batching); "
                                  "use model.generate() with the default dynamic cache")
    if dropout:
        raise NotImplementedError(f"sparse_io_attn has no attention dropout (got {dropout}); set "
                                  f"config.attention_dropout = 0.0")
    if kwargs.get("output_attentions", False):
        warnings.warn("sparse_io_attn does not return attention weights (output_attentions=True); "
                      "use attn_implementation='eager' to get them", stacklevel=2)
    q, kv, device = query.shape[2], key.shape[2], query.device
    causal_model = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    selector, backend = module_selector(module, "bottom_right" if causal_model else False)
    if isinstance(selector, NSAAttention):   # "nsa:...": NSA's three gated branches
        if sinks is not None:
            raise NotImplementedError("sparse_io_attn: 'nsa:...' has no attention sinks (s_aux=...: NSA's gated "
                                      "branches each have their own softmax); use a pattern or a selector spec")
        return nsa_forward(module, selector, query, key, value, attention_mask, scaling, backend, kwargs)
    if attention_mask is None:
        causal = "bottom_right" if causal_model else False
        if selector is not None:   # chosen from this call's queries and keys (the queries are the last q keys)
            check_lengths(q, kv)
            # through the selector's per-block state on the KV cache when there is one (decode_state.py)
            layout = None if torch.compiler.is_compiling() or not causal else \
                select_with_state(module, selector, query, key, kwargs)
            layout = selector(query, key) if layout is None else layout
            if isinstance(layout, Selection):   # per token (exact MoBA): the selection op, no layout
                out = selection_attention(query, key, value, layout, causal=causal, sm_scale=scaling, backend=backend,
                                          check=False, sinks=sinks)
                return out.transpose(1, 2).contiguous(), None
        else:
            layout, backend = layout_no_mask(module, q, kv, device, causal)
    elif selector is not None:   # chosen per sequence of the padded, packed or static-cache batch
        packed = packed_sequences(selector, attention_mask, query, key) if runs_packed(backend, device) else None
        if packed is not None:   # a per-token selector: the sequences packed, one call with cu_seqlens
            return _packed_call(selector, packed, query, key, value, scaling, backend, sinks), None
        layout = selection_layout_with_mask(selector, attention_mask, query, key, (selector.block_size,) * 2)
        causal = False  # the element mask carries the model's causality
    else:
        layout, backend = layout_with_mask(module, attention_mask, q, kv, kwargs.get("position_ids"), device)
        causal = False
    out = block_sparse_attention(query, key, value, layout, causal=causal, sm_scale=scaling, backend=backend,
                                 sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _sinks(kwargs: dict) -> Optional[torch.Tensor]:
    """The call's attention sinks: gpt-oss's ``s_aux`` (or ``sinks``), one logit per query head, else None."""
    found = [kwargs[n] for n in ("s_aux", "sinks") if kwargs.get(n) is not None]
    if len(found) > 1:
        raise ValueError("sparse_io_attn: pass the attention sinks once (s_aux= or sinks=), not both")
    return found[0] if found else None


def _packed_call(selector, packed, query, key, value, scaling, backend, sinks=None) -> torch.Tensor:
    """The sequences of a padded or packed batch as one packed batch: the selector and
    ``selection_attention`` once, with ``cu_seqlens`` (bottom-right per sequence: each sequence's rows
    are its last tokens); rows in no sequence (right padding) get 0. Returns ``[B, Nq, Hq, Dv]``."""
    B, Hq, q, _ = query.shape
    qp, kp, vp = (packed.gather(x, rows) for x, rows in ((query, packed.q_rows), (key, packed.k_rows),
                                                           (value, packed.k_rows)))
    cu = (packed.cu_q, packed.cu_k)
    heads_first = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    if hasattr(selector, "with_causal"):
        selector = selector.with_causal("bottom_right")
    selection = selector(heads_first(qp), heads_first(kp), cu_seqlens=cu)
    out = selection_attention(qp, kp, vp, selection, causal="bottom_right", cu_seqlens=cu, sm_scale=scaling,
                              backend=backend, check=False, sinks=sinks)             # [total, Hq, Dv]
    return packed.scatter(out, B, q)


def register(name: str = DEFAULT_NAME) -> str:
    """Register block-sparse attention under ``name`` in ``transformers.AttentionInterface`` (and in
    ``AttentionMaskInterface`` when the installed version routes mask creation per implementation).
    Idempotent; returns ``name`` for ``attn_implementation=``."""
    _check_version()
    if not isinstance(name, str) or not name or "/" in name or name in ("eager", "sdpa") \
            or name.startswith(("flash_attention", "flex_attention", "paged")):
        raise ValueError(f"register: choose a new attention name without '/' (not a built-in one), got {name!r}")
    from transformers import AttentionInterface

    AttentionInterface.register(name, sparse_io_attn_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - Transformers without per-implementation masks
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, sparse_io_attn_mask)
    return name
