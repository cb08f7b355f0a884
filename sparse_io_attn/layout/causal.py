"""Block liveness under the causal mask: the one decision the schedule, the torch path's plan and
the FlexAttention conversion share.

The causal mask with offset ``delta`` allows key ``j`` for query ``i`` iff ``j <= i + delta``
(``delta = 0``: top-left alignment; ``seqlen_k - seqlen_q``: bottom-right). Block ``(r, c)`` of a
layout with ``block_size = (bq, bk)`` covers queries ``r*bq .. min((r+1)*bq, seqlen_q) - 1`` and keys
``c*bk .. min((c+1)*bk, seqlen_k) - 1`` (the last block of each axis is cut at the sequence end).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class CausalBlocks(NamedTuple):
    """Per block: ``alive`` (some element of the block inside both lengths is allowed) and
    ``whole`` (every element of the ``bq x bk`` rectangle lies inside both lengths and is allowed).
    A kept block is dead when not ``alive``, full when ``whole`` (and full in the layout), partial
    otherwise."""
    alive: torch.Tensor
    whole: torch.Tensor


def causal_blocks(r: torch.Tensor, c: torch.Tensor, block_size, seqlen, causal_offset: int | None) -> CausalBlocks:
    """Liveness of blocks ``(r, c)`` (int tensors of one broadcastable shape) for ``block_size =
    (bq, bk)``, ``seqlen = (seqlen_q, seqlen_k)`` and ``causal_offset`` (``None``: no causal mask,
    every block alive)."""
    (bq, bk), (sq, sk) = block_size, seqlen
    r, c = torch.broadcast_tensors(r, c)
    q_lo, q_hi = r * bq, torch.clamp((r + 1) * bq, max=sq) - 1
    k_lo, k_hi = c * bk, torch.clamp((c + 1) * bk, max=sk) - 1
    whole = ((r + 1) * bq <= sq) & ((c + 1) * bk <= sk)
    if causal_offset is None:
        return CausalBlocks(torch.ones_like(whole), whole)
    alive = k_lo <= q_hi + causal_offset
    return CausalBlocks(alive, whole & (k_hi <= q_lo + causal_offset))
