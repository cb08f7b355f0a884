"""The causal mask: ``causal=`` -> the offset ``delta`` of ``j <= i + delta`` (:func:`causal_offset`,
what every backend, reference, traffic model and selection applies), and block liveness under it
(:func:`causal_blocks`, the one decision the attention plan, the FlexAttention conversion and the
top-k selection share; a partial block whose element mask lies wholly above the diagonal is dead:
:func:`mask_offsets` gives each mask's lowest ``j - i``).

The causal mask with offset ``delta`` allows key ``j`` for query ``i`` iff ``j <= i + delta``
(``delta = 0``: top-left alignment; ``seqlen_k - seqlen_q``: bottom-right). Block ``(r, c)`` of a
layout with ``block_size = (bq, bk)`` covers queries ``r*bq .. min((r+1)*bq, seqlen_q) - 1`` and keys
``c*bk .. min((c+1)*bk, seqlen_k) - 1`` (the last block of each axis is cut at the sequence end).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn.layout._bits import unpack


CAUSAL_MODES = (False, True, "top_left", "bottom_right")


def causal_offset(causal, seqlen_q: int, seqlen_k: int) -> int | None:
    """``causal`` -> the offset ``delta`` of the causal mask ``j <= i + delta``, or ``None``.

    ``False``: no causal mask. ``True`` or ``"top_left"``: ``delta = 0`` (query ``i`` sees keys
    ``0..i``, like ``scaled_dot_product_attention(is_causal=True)``). ``"bottom_right"``:
    ``delta = seqlen_k - seqlen_q`` (the last query sees every key; FlashAttention-2's convention
    for ``seqlen_q != seqlen_k``, what decoding with a KV cache and chunked prefill need).
    """
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return 0
    if causal == "bottom_right":
        return int(seqlen_k) - int(seqlen_q)
    raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")


class CausalBlocks(NamedTuple):
    """Per block: ``alive`` (some element of the block inside both lengths is allowed) and
    ``whole`` (every element of the ``bq x bk`` rectangle lies inside both lengths and is allowed).
    A kept block is dead when not ``alive``, full when ``whole`` (and full in the layout), partial
    otherwise."""
    alive: torch.Tensor
    whole: torch.Tensor


#: ``mask_offsets`` of a mask without any set bit (never alive)
NO_ELEMENT = 1 << 40


def mask_offsets(masks: torch.Tensor, block_size_kv: int) -> torch.Tensor:
    """For bit-packed element masks ``int32 [NM, bq, W]`` (:mod:`._bits`), the lowest ``j - i`` over
    each mask's set bits (row ``i``, column ``j``), ``int64 [NM]`` (:data:`NO_ELEMENT` for an empty
    mask). Element ``(i, j)`` of block ``(r, c)`` is causally allowed iff ``c*bk + j <= r*bq + i +
    delta``, so a partial block holds an allowed element iff its mask's offset is at most
    ``r*bq - c*bk + delta``."""
    NM, bq, _ = masks.shape
    if NM == 0:
        return torch.zeros(0, dtype=torch.int64, device=masks.device)
    bits = unpack(masks, block_size_kv)                                            # [NM, bq, bk]
    diag = (torch.arange(block_size_kv, device=masks.device)[None, :]
            - torch.arange(bq, device=masks.device)[:, None])                      # [bq, bk]
    return torch.where(bits, diag, NO_ELEMENT).flatten(1).amin(1)


def causal_blocks(r: torch.Tensor, c: torch.Tensor, block_size, seqlen, causal_offset: int | None,
                  mask_offset: torch.Tensor | None = None) -> CausalBlocks:
    """Liveness of blocks ``(r, c)`` (int tensors of one broadcastable shape) for ``block_size =
    (bq, bk)``, ``seqlen = (seqlen_q, seqlen_k)`` and ``causal_offset`` (``None``: no causal mask,
    every block alive). ``mask_offset`` (int64, the blocks' shape) is, for partial blocks, their
    element mask's :func:`mask_offsets` entry and, for full blocks, any value ``<= -bq``: a partial
    block whose mask lies wholly above the diagonal is then dead too. The bounds are computed on
    ``r`` and ``c`` as given (a ``[M, 1]`` and a ``[1, N]`` stay small); only the comparisons take
    the broadcast shape."""
    (bq, bk), (sq, sk) = block_size, seqlen
    q_lo, q_hi = r * bq, torch.clamp((r + 1) * bq, max=sq) - 1
    k_lo, k_hi = c * bk, torch.clamp((c + 1) * bk, max=sk) - 1
    whole = ((r + 1) * bq <= sq) & ((c + 1) * bk <= sk)
    if causal_offset is None:
        return CausalBlocks(torch.ones_like(whole), whole)
    alive = k_lo <= q_hi + causal_offset
    if mask_offset is not None:
        alive = alive & (mask_offset <= q_lo - k_lo + causal_offset)
    return CausalBlocks(alive, whole & (k_hi <= q_lo + causal_offset))
