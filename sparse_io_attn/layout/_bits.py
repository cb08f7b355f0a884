"""Bit-packed element masks of partial blocks.

A partial block's element mask is stored as ``int32 [BLOCK_SIZE_Q, W]`` with ``W =
ceil(BLOCK_SIZE_KV / 32)``: bit ``j`` (``(word >> j) & 1``) of word ``w`` in row ``r`` is element
``(r, 32 * w + j)`` of the block (row = query offset, column = key offset inside the block). Bits
past ``BLOCK_SIZE_KV`` and rows/columns past the sequence ends are 0. The kernels read the same
words (:mod:`sparse_io_attn.block_sparse.triton`), so this module is the format's one definition.
"""
from __future__ import annotations

import torch

WORD_BITS = 32


def num_words(block_size_kv: int) -> int:
    """Words per mask row, ``ceil(BLOCK_SIZE_KV / 32)``."""
    return -(-block_size_kv // WORD_BITS)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """``bool [..., bq, bk]`` -> ``int32 [..., bq, ceil(bk / 32)]``."""
    *lead, bq, bk = mask.shape
    W = num_words(bk)
    if W * WORD_BITS != bk:
        pad = torch.zeros(*lead, bq, W * WORD_BITS - bk, dtype=torch.bool, device=mask.device)
        mask = torch.cat([mask, pad], dim=-1)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        WORD_BITS, device=mask.device)
    words = (mask.view(*lead, bq, W, WORD_BITS).to(torch.int64) * weights).sum(-1)  # [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)                 # as int32 bits
    return words.to(torch.int32)


def unpack(words: torch.Tensor, block_size_kv: int) -> torch.Tensor:
    """``int32 [..., bq, W]`` -> ``bool [..., bq, block_size_kv]``."""
    shifts = torch.arange(WORD_BITS, device=words.device)
    bits = (words.to(torch.int64)[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :block_size_kv].bool()


def row_extents(words: torch.Tensor, block_size_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per mask row of ``words [..., bq, W]``: the first and last set column and the count of set
    columns, ``int64 [..., bq]`` each (``block_size_kv`` and ``-1`` on a row without a set bit)."""
    bits = unpack(words, block_size_kv)
    cols = torch.arange(block_size_kv, device=words.device)
    return (torch.where(bits, cols, block_size_kv).amin(-1), torch.where(bits, cols, -1).amax(-1),
            bits.sum(-1))


def to_bytes(words: torch.Tensor, block_size_kv: int) -> torch.Tensor:
    """``int32 [..., bq, W]`` -> ``uint8 [..., bq, ceil(block_size_kv / 8)]``: bit ``j`` of byte ``b``
    is column ``8 * b + j`` (the same bits, a quarter of the word per byte)."""
    shifts = 8 * torch.arange(WORD_BITS // 8, device=words.device)
    nbytes = -(-block_size_kv // 8)
    return ((words.to(torch.int64)[..., None] >> shifts) & 0xFF).flatten(-2)[..., :nbytes].to(torch.uint8)


def popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits per mask, ``int64 [...]`` for ``words [..., bq, W]``: a branch-free bit count of each
    32-bit word in int64 lanes (memory of the words' size, not one value per bit)."""
    v = words.to(torch.int64) & 0xFFFFFFFF
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    v = ((v * 0x01010101) & 0xFFFFFFFF) >> 24
    return v.sum(dim=(-2, -1))


def dedup(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique masks of ``words [P, bq, W]``: ``(unique [U, bq, W], inverse int64 [P])``."""
    if words.shape[0] == 0:
        return words, torch.zeros(0, dtype=torch.int64, device=words.device)
    flat = words.reshape(words.shape[0], -1)
    uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
    return uniq.view(-1, *words.shape[1:]).contiguous(), inverse


_EVAL_ELEMENTS = 1 << 22  # element slots evaluated per chunk by :func:`block_counts` (bool bytes)


def block_counts(r: torch.Tensor, c: torch.Tensor, ids: torch.Tensor, masks: torch.Tensor, block_size,
                 seqlen, delta: int | None = None) -> torch.Tensor:
    """Allowed elements of each kept block, ``int64 [E]``, without one value per element.

    Blocks ``(r, c)`` (block row and column, ``[E]``) with ``ids`` (``-1``: full, every in-range
    element allowed; ``p >= 0``: the element mask ``masks[p]``, ``int32 [U, bq, W]``, canonical as a
    layout stores them: no bit past the sequence ends) of a score matrix of ``seqlen = (sq, sk)``
    elements cut into ``block_size = (bq, bk)`` blocks. A full block
    counts its in-range rectangle; a partial one the set bits of its mask, counted once per stored
    mask. With ``delta`` only elements ``(i, j)`` with ``j <= i + delta`` count: blocks wholly on one
    side of that diagonal are decided from their corners, and the blocks it crosses are evaluated
    once per distinct (mask, diagonal shift, in-range extent), so memory stays O(E + U) words.
    """
    (bq, bk), (sq, sk) = block_size, seqlen
    r, c = r.to(torch.int64), c.to(torch.int64)
    ids = ids.to(torch.int64)
    rows_in = torch.clamp(sq - r * bq, 0, bq)
    cols_in = torch.clamp(sk - c * bk, 0, bk)
    set_bits = popcount(masks) if masks.shape[0] else torch.zeros(1, dtype=torch.int64, device=masks.device)
    counts = torch.where(ids < 0, rows_in * cols_in, set_bits[ids.clamp(min=0)])
    if delta is None:
        return counts
    shift = r * bq + delta - c * bk          # (a, b) inside the block is allowed iff b - a <= shift
    below = cols_in - 1 <= shift             # the block's last key column against its first query row
    above = shift < -(rows_in - 1)           # its first key column after its last query row
    counts = torch.where(above, 0, counts)
    cross = ~below & ~above
    if bool(cross.any()):
        keys = torch.stack([ids[cross], shift[cross], rows_in[cross], cols_in[cross]], dim=1)
        uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
        per_key = torch.empty(uniq.shape[0], dtype=torch.int64, device=uniq.device)
        a = torch.arange(bq, device=uniq.device)[None, :, None]
        b = torch.arange(bk, device=uniq.device)[None, None, :]
        step = max(1, _EVAL_ELEMENTS // (bq * bk))
        for s in range(0, uniq.shape[0], step):
            u = uniq[s:s + step]
            sh, ri, ci = (u[:, k, None, None] for k in (1, 2, 3))
            allowed = (a < ri) & (b < ci) & (b - a <= sh)
            part = u[:, 0] >= 0
            if bool(part.any()):
                allowed[part] &= unpack(masks[u[part, 0]], bk)
            per_key[s:s + step] = allowed.sum((1, 2))
        counts[cross] = per_key[inverse]
    return counts
