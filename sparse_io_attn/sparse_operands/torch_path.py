"""Backend ``"torch"`` for :func:`sparse_io_attn.sparse_operands.attention`: plain PyTorch, any device.

Block-sparse operands are expanded to dense tensors
(:func:`~sparse_io_attn.sparse_operands.batch.dense_stack`, differentiable w.r.t. ``values``, so their
gradients land on their own block pattern) and the rest is dense autograd over ``[B, H, ...]``
batched products: ``Q = A1 X`` and ``h = A3 Y`` broadcast the batch-varying operands over the heads
and the head-varying ones over the batch, one batched matmul each (no loop over heads). It
materialises the ``n x n`` scores of every head (in chunks of heads of at most
:data:`SCORE_CHUNK_BYTES`, so the softmax's elementwise passes run in cache): a fallback for CPUs
and small problems, not an I/O-aware path (no traffic is counted).
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.reference import masked_attention
from sparse_io_attn.sparse_operands.batch import Batch, dense_stack, expand

#: score bytes one masked-softmax pass works on at a time (a core's L2 share): larger ``[B, H, n, n]``
#: score tensors are processed in chunks of heads, whose elementwise passes then stay in cache
SCORE_CHUNK_BYTES = 512 * 1024


def qk_mask(qk_layout, device) -> torch.Tensor | None:
    """Element mask broadcastable to ``[B, H, nq, nk]``: the layout's ``to_dense_mask()``
    (``[layout_batch, layout_heads, nq, nk]``), or None (every key) without a layout."""
    return None if qk_layout is None else qk_layout.to(device).to_dense_mask()


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
    mask = qk_mask(qk_layout, q.device)
    groups = max(1, SCORE_CHUNK_BYTES // max(1, q.shape[-2] * k.shape[-2] * q.element_size()))  # 0 rows: one part
    if groups >= batch.groups:
        out, lse = masked_attention(q, k, h, mask, scale)
        return out, lse.float()
    outs, lses = [], []
    for part in _chunks(batch, groups):  # (b, h)-ordered parts, each within SCORE_CHUNK_BYTES of scores
        o, lse = masked_attention(q[part], k[part], h[part], _part(mask, part), scale)
        outs.append(o.flatten(0, 1))
        lses.append(lse.flatten(0, 1))
    out = torch.cat(outs).view(batch.B, batch.H, *outs[0].shape[1:])
    return out, torch.cat(lses).view(batch.B, batch.H, -1).float()


def _chunks(batch: Batch, groups: int):
    """``(batch slice, head slice)`` parts of at most ``groups`` groups, in ``(b, h)`` order: whole
    batch elements when ``groups >= H``, else chunks of one element's heads."""
    if groups >= batch.H:
        step = groups // batch.H
        return [(slice(b, b + step), slice(None)) for b in range(0, batch.B, step)]
    return [(slice(b, b + 1), slice(h, h + groups)) for b in range(batch.B) for h in range(0, batch.H, groups)]


def _part(mask: torch.Tensor | None, part: tuple) -> torch.Tensor | None:
    """The ``(batch, head)`` slices ``part`` of a mask broadcastable to ``[B, H, nq, nk]``."""
    if mask is None:
        return None
    return mask[tuple(p if mask.shape[i] > 1 else slice(None) for i, p in enumerate(part))]
