"""Training integration: :class:`SparseSelfAttention` (block-sparse attention through the custom op of
:mod:`sparse_io_attn.block_sparse.op`, so ``torch.compile(fullgraph=True)`` traces through it);
``selectors``: layouts chosen from the activations at every forward (:func:`selectors.moba`);
:class:`PaperAttention`: the paper's sparse-operand form as a layer (per-head block-sparse
``W_Q W_K^T`` and ``W_V W_O``)."""
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.module import SparseSelfAttention
from sparse_io_attn.nn.paper import PaperAttention

__all__ = ["PaperAttention", "SparseSelfAttention", "selectors"]
