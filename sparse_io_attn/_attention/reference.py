"""The float64 masked-softmax reference the attention ops' references build on
(:mod:`sparse_io_attn.block_sparse.reference`: block layouts; :mod:`sparse_io_attn.selection.reference`:
per-token selections; :mod:`sparse_io_attn.sparse_operands.reference`)."""
from __future__ import annotations

import torch

from sparse_io_attn.layout.causal import causal_offset


def masked_attention(q, k, v, mask, sm_scale):
    """Masked softmax attention in the input's dtype, differentiable, NaN-free on empty rows.

    ``q [B, Hq, Nq, D]``, ``k/v [B, Hkv, Nk, D]`` (GQA: query head ``h`` uses kv head
    ``h // (Hq // Hkv)``), ``mask`` broadcastable to ``[B, Hq, Nq, Nk]``, or None for every key
    (no masking passes over the scores). Returns ``(out, lse)`` with ``lse`` in natural-log units.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    if mask is None:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        return torch.matmul(torch.exp(s - lse), v), lse.squeeze(-1)
    mask = mask.expand_as(s)
    row_empty = ~mask.any(dim=-1, keepdim=True)
    neg_inf = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s_for_lse = torch.where(row_empty, zero, torch.where(mask, s, neg_inf))
    lse = torch.logsumexp(s_for_lse, dim=-1, keepdim=True)
    # masked elements take exp(-inf) = 0 (never exp(0 - lse): past lse < -709 that overflows float64, and
    # where()'s backward multiplies its 0 by the inf derivative: NaN gradients at extreme logits)
    p = torch.exp(torch.where(mask, s - lse, neg_inf))
    out = torch.matmul(p, v)
    lse = torch.where(row_empty, neg_inf, lse).squeeze(-1)
    return out, lse


def with_causal(mask: torch.Tensor, causal) -> torch.Tensor:
    """``mask [..., Nq, Nk]`` intersected with ``causal`` (:func:`~sparse_io_attn.layout.causal.causal_offset`:
    key ``j`` allowed for query ``i`` iff ``j <= i + delta``); unchanged for ``causal=False``."""
    nq, nk = mask.shape[-2:]
    delta = causal_offset(causal, nq, nk)
    if delta is None:
        return mask
    i = torch.arange(nq, device=mask.device)[:, None]
    j = torch.arange(nk, device=mask.device)[None, :]
    return mask & (j <= i + delta)


def float64_attention(q, k, v, mask, sm_scale: float | None, do=None):
    """Float64 masked attention of ``q, k, v`` (any dtype): ``(out, lse)`` or, with ``do``,
    ``(out, lse, dq, dk, dv)``; ``sm_scale`` ``None`` is ``D ** -0.5``. What each op's reference
    returns once it has its element mask."""
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    q64, k64, v64 = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    with torch.enable_grad():
        out, lse = masked_attention(q64, k64, v64, mask, sm_scale)
        if do is None:
            return out.detach(), lse.detach()
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return out.detach(), lse.detach(), dq, dk, dv


__all__ = ["float64_attention", "masked_attention", "with_causal"]
