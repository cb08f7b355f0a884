"""Float64 reference of per-token selection attention, independent of the plan and the kernels.

The selection is expanded to a dense element mask ``[B, Hq, Nq, Nk]`` straight from the user's
indices (union of each row's valid listed blocks inside ``counts``, intersected with causality),
then ordinary masked softmax attention runs in float64. Rows with no allowed key give output 0,
lse ``-inf`` and zero gradients.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn._attention.reference import float64_attention, with_causal
from sparse_io_attn.layout.selection import Selection


def selection_mask(selection: Selection, batch: int, num_heads_q: int, seqlen_k: int, *, causal=False,
                   device=None) -> torch.Tensor:
    """``bool [batch, num_heads_q, Nq, seqlen_k]``: the keys each query row of each head may use."""
    idx = selection.indices.to(device or selection.device).to(torch.int64)
    if idx.dim() == 3:
        idx = idx.unsqueeze(0)
    Lb, G, Nq, K = idx.shape
    bs = selection.block_size
    nkb = math.ceil(seqlen_k / bs)
    valid = (idx >= 0) & (idx < nkb)
    if selection.counts is not None:
        counts = selection.counts.to(idx.device).to(torch.int64).reshape(Lb, G, Nq)
        valid &= torch.arange(K, device=idx.device) < counts[..., None]
    blocks = torch.zeros(Lb, G, Nq, nkb + 1, dtype=torch.bool, device=idx.device)
    blocks.scatter_(-1, torch.where(valid, idx, nkb), True)
    keys = blocks[..., :nkb].repeat_interleave(bs, dim=-1)[..., :seqlen_k]        # [Lb, G, Nq, Nk]
    mask = keys.repeat_interleave(num_heads_q // G, dim=1).expand(batch, num_heads_q, Nq, seqlen_k)
    return with_causal(mask, causal)


def selection_reference(q, k, v, selection: Selection, *, causal=False, sm_scale: float | None = None,
                        do: torch.Tensor | None = None):
    """Float64 selection attention: ``(out, lse)`` or, with ``do``, ``(out, lse, dq, dk, dv)``."""
    B, Hq, _, _ = q.shape
    mask = selection_mask(selection, B, Hq, k.shape[2], causal=causal, device=q.device)
    return float64_attention(q, k, v, mask, sm_scale, do)


__all__ = ["selection_mask", "selection_reference"]
