"""Backend ``"torch"`` for :func:`sparse_io_attn.sparse_operands.attention`: plain PyTorch, any device.

Block-sparse operands are expanded to dense tensors
(:func:`~sparse_io_attn.sparse_operands.batch.dense_stack`, differentiable w.r.t. ``values``, so their
gradients land on their own block pattern) and the rest is dense autograd over ``[B, H, ...]``
batched products: ``Q = A1 X`` and ``h = A3 Y`` broadcast the batch-varying operands over the heads
and the head-varying ones over the batch, one batched matmul each (no loop over heads). It
materialises the ``n x n`` scores of every head: a fallback for CPUs and small problems, not an
I/O-aware path (no traffic is counted).
"""
from __future__ import annotations

import torch

from sparse_io_attn.block_sparse.reference import masked_attention
from sparse_io_attn.sparse_operands.batch import Batch, dense_stack, expand


def qk_mask(qk_layout, nq: int, nk: int, device) -> torch.Tensor:
    """Element mask broadcastable to ``[B, H, nq, nk]``: the layout's ``to_dense_mask()``
    (``[layout_batch, layout_heads, nq, nk]``) or all keys when None."""
    if qk_layout is None:
        return torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    return qk_layout.to(device).to_dense_mask()


def products(a1, x, a2, a3, y, batch: Batch):
    """``(Q, K, h)`` as ``[B, H, rows, cols]`` tensors from the stacked operands (``[L, r, c]``,
    ``L`` 1 or the axis' size): ``Q = A1 X``, ``K = A2``, ``h = A3 Y``."""
    q = (a1[:, None] @ x[None]).expand(batch.B, batch.H, a1.shape[1], x.shape[2])
    h = (a3[:, None] @ y[None]).expand(batch.B, batch.H, a3.shape[1], y.shape[2])
    return q, expand(a2, batch, "batch"), h


def attention(A1, A2, A3, X, Y, qk_layout, scale: float, batch: Batch):
    """``(O [B, H, nq, dv], lse [B, H, nq] fp32)``: softmax over the QK pattern's keys (all keys if
    None); scores of structurally zero products are exactly 0 and enter the softmax as such."""
    q, k, h = products(*(dense_stack(t) for t in (A1, X, A2, A3, Y)), batch)
    mask = qk_mask(qk_layout, q.shape[-2], k.shape[-2], q.device)
    out, lse = masked_attention(q, k, h, mask, scale)
    return out, lse.float()
