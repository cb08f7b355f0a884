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
                   device=None, cu_seqlens=None) -> torch.Tensor:
    """``bool [batch, num_heads_q, Nq, seqlen_k]``: the keys each query row of each head may use.

    ``cu_seqlens`` (a tensor, or a pair for queries and keys): packed sequences, ``batch == 1``; each
    sequence's rows are expanded on their own (local blocks, causality per sequence) and placed on
    the diagonal block of the mask: no query sees another sequence's keys."""
    if cu_seqlens is not None:
        return _packed_mask(selection, num_heads_q, seqlen_k, causal, device, cu_seqlens)
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


def _packed_mask(selection: Selection, num_heads_q: int, seqlen_k: int, causal, device, cu_seqlens) -> torch.Tensor:
    """:func:`selection_mask` of packed sequences, one sequence at a time."""
    cu_q, cu_k = (cu_seqlens if isinstance(cu_seqlens, (tuple, list)) else (cu_seqlens, cu_seqlens))
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    idx = selection.indices if selection.indices.dim() == 3 else selection.indices[0]
    counts = selection.counts if selection.counts is None or selection.counts.dim() == 2 else selection.counts[0]
    mask = torch.zeros(1, num_heads_q, cu_q[-1], seqlen_k, dtype=torch.bool, device=device or selection.device)
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        part = Selection(idx[:, q0:q1], selection.block_size, None if counts is None else counts[:, q0:q1])
        mask[:, :, q0:q1, k0:k1] = selection_mask(part, 1, num_heads_q, k1 - k0, causal=causal, device=mask.device)
    return mask


def selection_reference(q, k, v, selection: Selection, *, causal=False, sm_scale: float | None = None,
                        do: torch.Tensor | None = None, sinks: torch.Tensor | None = None, cu_seqlens=None):
    """Float64 selection attention: ``(out, lse)`` or, with ``do``, ``(out, lse, dq, dk, dv)`` (and
    ``dsinks`` last when ``sinks [Hq]`` is given); ``cu_seqlens``: packed sequences (local blocks)."""
    B, Hq, _, _ = q.shape
    mask = selection_mask(selection, B, Hq, k.shape[2], causal=causal, device=q.device, cu_seqlens=cu_seqlens)
    return float64_attention(q, k, v, mask, sm_scale, do, sinks)


__all__ = ["selection_mask", "selection_reference"]
