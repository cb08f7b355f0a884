"""Training integration: :class:`SparseSelfAttention` (block-sparse attention through the custom op of
:mod:`sparse_io_attn.block_sparse.op`, or per-token selection attention, so
``torch.compile(fullgraph=True)`` traces through it); ``selectors``: what each query attends, chosen
from the activations at every forward (:func:`selectors.moba`, :func:`selectors.nsa`,
:func:`selectors.lightning_topk`, :func:`selectors.pooled_topk`); :class:`NativeSparseAttention`
(fla's NSA layer: compressed, selected and sliding-window branches, with a KV cache:
``layer.init_cache()``); :class:`LightningIndexer`
(DeepSeek Sparse Attention's indexer); :class:`PaperAttention`: the paper's sparse-operand form as a
layer (per-head block-sparse ``W_Q W_K^T`` and ``W_V W_O``)."""
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.indexer import LightningIndexer
from sparse_io_attn.nn.module import SparseSelfAttention
from sparse_io_attn.nn.nsa import NativeSparseAttention
from sparse_io_attn.nn.paper import PaperAttention

__all__ = ["LightningIndexer", "NativeSparseAttention", "PaperAttention", "SparseSelfAttention", "selectors"]
