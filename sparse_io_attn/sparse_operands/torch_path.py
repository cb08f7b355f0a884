"""Backend ``"torch"`` for :func:`sparse_io_attn.sparse_operands.attention`: plain PyTorch, any device.

Block-sparse operands are expanded to dense tensors with :meth:`BlockSparseMatrix.to_dense` (which is
differentiable w.r.t. ``values``, so their gradients land on their own block pattern) and the rest
is dense autograd. It materialises the ``n x n`` scores: a fallback for CPUs and small problems, not
an I/O-aware path (no traffic is counted).
"""
from __future__ import annotations

import torch

from sparse_io_attn.block_sparse.reference import masked_attention
from sparse_io_attn.sparse_operands.operands import dense_tensor


def attention(A1, A2, A3, X, Y, qk_layout, scale: float):
    """``(O [nq, dv], lse [nq])``: softmax over the QK pattern's keys (all keys if None); scores of
    structurally zero products are exactly 0 and enter the softmax as such."""
    q = dense_tensor(A1) @ dense_tensor(X)
    k = dense_tensor(A2)
    h = A3 @ Y
    nq, nk = q.shape[0], k.shape[0]
    if qk_layout is None:
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    else:
        mask = qk_layout.to(q.device).to_dense_mask()[0, 0]
    out, lse = masked_attention(q[None, None], k[None, None], h[None, None], mask, scale)
    return out[0, 0], lse[0, 0].float()
