"""Float64 dense references used by every test.

They expand a :class:`~sparse_io_attn.BlockSparseLayout` to an element mask and run ordinary masked
softmax attention in float64. A query row with no kept key returns output 0 and lse = -inf, and its
gradients are 0 (no NaN), matching the library's kernels.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.reference import float64_attention, masked_attention, with_causal
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
    return with_causal(mask, causal)


def attention_reference(q, k, v, layout: BlockSparseLayout | None = None, *, causal=False,
                        sm_scale: float | None = None, do: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None):
    """Float64 block-sparse attention: ``(out, lse)`` or, with ``do``, ``(out, lse, dq, dk, dv)`` (and
    ``dsinks`` last when ``sinks [Hq]`` is given).

    Results are float64; compare a kernel's output ``x`` with ``(x.double() - ref).norm() / ref.norm()``.
    """
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    mask = element_mask(layout, B, Hq, Nq, Nk, causal=causal, device=q.device, num_heads_kv=k.shape[1])
    return float64_attention(q, k, v, mask, sm_scale, do, sinks)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (``||x - ref||`` when ``ref`` is all zeros)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num
