"""The float64 masked-softmax reference the attention ops' references build on
(:mod:`sparse_io_attn.block_sparse.reference`: block layouts; :mod:`sparse_io_attn.selection.reference`:
per-token selections; :mod:`sparse_io_attn.sparse_operands.reference`)."""
from __future__ import annotations

import torch

from sparse_io_attn.layout.causal import causal_offset


def masked_attention(q, k, v, mask, sm_scale, sinks=None):
    """Masked softmax attention in the input's dtype, differentiable, NaN-free on empty rows.

    ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B, Hkv, Nk, Dv]`` (GQA: query head ``h`` uses kv
    head ``h // (Hq // Hkv)``), ``mask`` broadcastable to ``[B, Hq, Nq, Nk]``, or None for every key
    (no masking passes over the scores); ``sinks [Hq]`` (or None): one logit per head that joins
    every row's denominator with no value (gpt-oss's and FlashMLA's sinks: a score column appended
    to the scaled scores). Returns ``(out, lse)`` with ``lse`` in natural-log units, the sink included.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    if sinks is not None:      # one more score column, allowed where the sink is finite
        B, Hq, Nq, Nk = s.shape
        col = sinks.to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
        keys = torch.ones(s.shape, dtype=torch.bool, device=s.device) if mask is None else mask.expand(B, Hq, Nq, Nk)
        mask = torch.cat([keys, torch.isfinite(col)], dim=-1)
        s = torch.cat([s, col], dim=-1)
    if mask is None:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse)
    else:
        mask = mask.expand_as(s)
        row_empty = ~mask.any(dim=-1, keepdim=True)
        neg_inf = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        s_for_lse = torch.where(row_empty, zero, torch.where(mask, s, neg_inf))
        lse = torch.logsumexp(s_for_lse, dim=-1, keepdim=True)
        # masked elements take exp(-inf) = 0 (never exp(0 - lse): past lse < -709 that overflows float64,
        # and where()'s backward multiplies its 0 by the inf derivative: NaN gradients at extreme logits)
        p = torch.exp(torch.where(mask, s - lse, neg_inf))
        lse = torch.where(row_empty, neg_inf, lse)
    out = torch.matmul(p[..., :v.shape[-2]], v)
    return out, lse.squeeze(-1)


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


def float64_attention(q, k, v, mask, sm_scale: float | None, do=None, sinks=None):
    """Float64 masked attention of ``q, k, v`` (any dtype): ``(out, lse)`` or, with ``do``,
    ``(out, lse, dq, dk, dv)`` and, when ``sinks`` is given too, ``dsinks`` after them;
    ``sm_scale`` ``None`` is ``D ** -0.5``. What each op's reference returns once it has its element
    mask."""
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    grad = do is not None
    q64, k64, v64 = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
    s64 = None if sinks is None else sinks.detach().double().requires_grad_(grad)
    with torch.enable_grad():
        out, lse = masked_attention(q64, k64, v64, mask, sm_scale, s64)
        if not grad:
            return out.detach(), lse.detach()
        wrt = (q64, k64, v64) if s64 is None else (q64, k64, v64, s64)
        grads = torch.autograd.grad(out, wrt, do.double())
    return (out.detach(), lse.detach(), *grads)


__all__ = ["float64_attention", "masked_attention", "with_causal"]
