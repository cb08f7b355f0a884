"""Float64 dense references used by every test.

They expand a :class:`~sparse_io_attn.BlockSparseLayout` to an element mask and run ordinary masked
softmax attention in float64. A query row with no kept key returns output 0 and lse = -inf, and its
gradients are 0 (no NaN), matching the library's kernels.
"""
from __future__ import annotations

import torch

from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout


def element_mask(layout: BlockSparseLayout | None, batch: int, num_heads_q: int, seqlen_q: int,
                 seqlen_k: int, *, causal=False, device=None, num_heads_kv: int | None = None) -> torch.Tensor:
    """``bool [batch, num_heads_q, seqlen_q, seqlen_k]``: the elements attention may use (the layout's
    element mask, partial blocks included; a layout with one mask per KV head serves the query heads
    of each group of ``num_heads_kv``).

    ``causal`` (see :func:`~sparse_io_attn.layout.causal.causal_offset`): ``True``/``"top_left"``
    keeps key ``j`` for query ``i`` only if ``j <= i`` (as ``scaled_dot_product_attention(
    is_causal=True)``), ``"bottom_right"`` only if ``j <= i + seqlen_k - seqlen_q``.
    """
    if layout is None:
        mask = torch.ones(batch, num_heads_q, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    else:
        layout = layout.for_query_heads(num_heads_q, num_heads_kv or num_heads_q)
        mask = layout.to(device or layout.device).expand_dense_mask(batch, num_heads_q)
    delta = causal_offset(causal, seqlen_q, seqlen_k)
    if delta is not None:
        i = torch.arange(seqlen_q, device=mask.device)[:, None]
        j = torch.arange(seqlen_k, device=mask.device)[None, :]
        mask = mask & (j <= i + delta)
    return mask


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
    p = torch.where(mask, torch.exp(torch.where(mask, s, zero) - lse), zero)
    out = torch.matmul(p, v)
    lse = torch.where(row_empty, neg_inf, lse).squeeze(-1)
    return out, lse


def attention_reference(q, k, v, layout: BlockSparseLayout | None = None, *, causal=False,
                        sm_scale: float | None = None, do: torch.Tensor | None = None):
    """Float64 block-sparse attention: ``(out, lse)`` or, with ``do``, ``(out, lse, dq, dk, dv)``.

    Results are float64; compare a kernel's output ``x`` with ``(x.double() - ref).norm() / ref.norm()``.
    """
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    mask = element_mask(layout, B, Hq, Nq, Nk, causal=causal, device=q.device, num_heads_kv=k.shape[1])
    q64, k64, v64 = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    with torch.enable_grad():
        out, lse = masked_attention(q64, k64, v64, mask, sm_scale)
        if do is None:
            return out.detach(), lse.detach()
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return out.detach(), lse.detach(), dq, dk, dv


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (``||x - ref||`` when ``ref`` is all zeros)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num
