"""Training integration: :class:`SparseSelfAttention` and the ``torch.library`` custom ops
(``torch.ops.sparse_io_attn.block_sparse_attn_fwd`` / ``_bwd``) it calls, which let
``torch.compile(fullgraph=True)`` trace through block-sparse attention; ``selectors``: layouts chosen
from the activations at every forward (:func:`selectors.moba`); :class:`PaperAttention`: the paper's
sparse-operand form as a layer (per-head block-sparse ``W_Q W_K^T`` and ``W_V W_O``)."""
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.module import SparseSelfAttention
from sparse_io_attn.nn.ops import block_sparse_attention_op
from sparse_io_attn.nn.paper import PaperAttention

__all__ = ["PaperAttention", "SparseSelfAttention", "block_sparse_attention_op", "selectors"]
