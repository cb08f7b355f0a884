"""What the key-major and element-masked Triton families derive from a :class:`~.plan.SelectionPlan`,
on its device with tensor operations of shapes fixed by the inputs' shapes (no ``nonzero``,
``.item()`` or host copy), built once per plan and tile shape (:meth:`SelectionPlan.derived`).

* :func:`key_work` (family ``"key"``): the key-major lists (``plan.keys()``: per ``(l, c)`` the tokens
  that chose block ``c``, ascending) cut into tiles of ``block_t`` tokens; ``work int32 [2,
  capacity]`` names each tile's list ``l * num_kv_blocks + c`` and its index in the list (``-1`` past
  the last tile). ``capacity`` is a bound from the shapes (:func:`key_work_capacity`), so the grid
  is known without reading the lists.
* :func:`masked_tiles` (family ``"masked"``): the selection as element-masked tiles of ``block_t``
  consecutive query tokens x 64 consecutive keys: ``bits int64 [L, Nq, ceil(Nk / 64)]`` (bit ``j`` of
  word ``(l, t, kt)``: key ``64 kt + j`` is selected by token ``t`` and allowed: inside the keys and,
  causal, at or before the diagonal), their unions per query tile and per key tile (the keys the
  kernels load: a key no token selected is never read), the key tiles holding a bit of a query tile
  (ascending, fixed capacity, ``-1`` after) and the transposed lists (the query tiles of each key tile).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE
from sparse_io_attn.selection.plan import KeyLists


class KeyWork(NamedTuple):
    """Tiles of the key-major lists: ``work[0, p]`` the list ``l * num_kv_blocks + c`` of tile ``p``
    (``-1``: no tile), ``work[1, p]`` its index in that list (tokens ``[i * block_t, (i + 1) * block_t)``)."""
    work: torch.Tensor    # int32 [2, capacity]
    block_t: int

    @property
    def capacity(self) -> int:
        return self.work.shape[1]


def key_work_capacity(entries: int, lists: int, block_t: int) -> int:
    """An upper bound of the tiles of ``block_t`` tokens over ``lists`` lists holding ``entries`` in
    all: ``sum ceil(n / T) <= (entries + nonempty (T - 1)) / T`` with ``nonempty <= min(lists, entries)``."""
    return (entries + min(lists, entries) * (block_t - 1)) // block_t


def key_work(keys: KeyLists, num_layouts: int, num_kv_blocks: int, capacity_entries: int, block_t: int) -> KeyWork:
    """The :class:`KeyWork` of key lists ``keys`` (``capacity_entries = L * Nq * K``, the lists'
    capacity): tiles per list by their lengths, their ends by a cumulative sum, each tile's list by a
    binary search of those ends."""
    dev = keys.col_ptr.device
    n_lists = num_layouts * num_kv_blocks
    ptr = keys.col_ptr.to(torch.int64)
    n = (ptr[:, 1:] - ptr[:, :-1]).reshape(-1)                                     # [L * nkb]
    tiles = (n + block_t - 1) // block_t
    ends = torch.cumsum(tiles, 0)
    cap = key_work_capacity(capacity_entries, n_lists, block_t)
    p = torch.arange(cap, device=dev)
    lc = torch.searchsorted(ends, p, right=True)                                   # [cap] in [0, n_lists]
    used = lc < n_lists
    lcc = lc.clamp(max=max(n_lists - 1, 0))
    start = ends.gather(0, lcc) - tiles.gather(0, lcc) if n_lists else p
    work = torch.stack([torch.where(used, lc, -1), torch.where(used, p - start, 0)]).to(INDEX_DTYPE)
    return KeyWork(work.contiguous(), block_t)


class MaskedTiles(NamedTuple):
    """The selection as element-masked tiles (see the module docstring)."""
    bits: torch.Tensor          # int64 [L, Nq, nkt]: each token's selected, allowed keys of each key tile
    union: torch.Tensor         # int64 [L, nqt, nkt]: the keys some token of the query tile selected
    col_union: torch.Tensor     # int64 [L, nkt]: the keys some token selected
    row_tiles: torch.Tensor     # int32 [L, nqt, nkt]: key tiles of each query tile, ascending, -1 after
    row_counts: torch.Tensor    # int32 [L, nqt]
    col_tiles: torch.Tensor     # int32 [L, nkt, nqt]: query tiles of each key tile, ascending, -1 after
    col_counts: torch.Tensor    # int32 [L, nkt]
    block_t: int
    block_n: int


def _compact(present: torch.Tensor):
    """``present bool [..., n]`` -> (the indices where set, ascending, at the front and ``-1`` after,
    int32; their counts, int32)."""
    n = present.shape[-1]
    kept = present.to(torch.int64)
    slot = torch.where(present, torch.cumsum(kept, -1) - kept, n)                   # spare slot n
    out = torch.full((*present.shape[:-1], n + 1), -1, dtype=INDEX_DTYPE, device=present.device)
    idx = torch.arange(n, dtype=INDEX_DTYPE, device=present.device).expand_as(present)
    out.scatter_(-1, slot, idx)
    return out[..., :n].contiguous(), kept.sum(-1).to(INDEX_DTYPE)


def _words(flags: torch.Tensor) -> torch.Tensor:
    """``bool [..., 64]`` -> int64 ``[...]`` with bit ``j`` = ``flags[..., j]`` (distinct powers of two summed:
    bit 63 is the sign bit, no overflow)."""
    shifts = torch.arange(64, dtype=torch.int64, device=flags.device)
    return (flags.to(torch.int64) << shifts).sum(-1)


def masked_tiles(rows: torch.Tensor, block_size: int, seqlen_k: int, causal_offset: int | None, block_t: int,
                 block_n: int, table: torch.Tensor | None = None) -> MaskedTiles:
    """The :class:`MaskedTiles` of normalised ``rows [L, Nq, K]`` (blocks of ``block_size`` keys): each
    selected key (clipped to ``seqlen_k`` and the diagonal) becomes a bit of its token's word of its key
    tile (a row's keys are distinct, so a scatter-add of powers of two is their OR) and a flag of its query
    tile's union (scattered flags, packed); then the query tiles' key tiles, compacted both ways.
    ``table``: a packed plan's block table (:func:`~sparse_io_attn.selection.varlen.block_table`): each
    block's keys and each row's causal offset from it (``causal_offset`` then only says causal or not)."""
    if block_n != 64:
        raise ValueError(f"masked tiles hold one int64 word of 64 keys per token, got block_n={block_n}")
    L, Nq, K = rows.shape
    dev = rows.device
    nkt = -(-seqlen_k // block_n)
    nqt = -(-Nq // block_t)
    c = rows.to(torch.int64)[..., None]                                             # [L, Nq, K, 1]
    j = torch.arange(block_size, device=dev)
    t = torch.arange(Nq, device=dev)[:, None, None]
    if table is None:
        key, ok, limit = c * block_size + j, c >= 0, t + (causal_offset or 0)      # [L, Nq, K, bs]
        ok = ok & (key < seqlen_k)
    else:
        nkb = (table.numel() - Nq) // 2
        tab = table.to(torch.int64)
        cc = c.clamp(min=0)
        key, ok, limit = tab[cc] + j, (c >= 0) & (j < tab[nkb + cc] - tab[cc]), t + tab[2 * nkb:][:, None, None]
    if causal_offset is not None:
        ok &= key <= limit
    key = torch.where(ok, key, 0)
    word = torch.where(ok, torch.bitwise_left_shift(torch.ones_like(key), key % block_n), 0)
    bits = torch.zeros(L, Nq, nkt, dtype=torch.int64, device=dev)
    bits.scatter_add_(-1, (key // block_n).reshape(L, Nq, -1), word.reshape(L, Nq, -1))
    span = nkt * block_n
    flat = (torch.arange(L, device=dev)[:, None, None, None] * nqt
            + torch.arange(Nq, device=dev)[None, :, None, None] // block_t) * span + key
    flags = torch.zeros(L * nqt * span + 1, dtype=torch.bool, device=dev)
    flags.index_put_((torch.where(ok, flat, L * nqt * span).reshape(-1),), torch.ones((), dtype=torch.bool,
                                                                                        device=dev))
    flags = flags[:-1].view(L, nqt, nkt, block_n)
    union = _words(flags)                                                           # [L, nqt, nkt]
    col_union = _words(flags.any(1))                                                # [L, nkt]
    present = flags.any(-1)                                                         # [L, nqt, nkt]
    row_tiles, row_counts = _compact(present)
    col_tiles, col_counts = _compact(present.transpose(1, 2))
    return MaskedTiles(bits, union, col_union, row_tiles, row_counts, col_tiles, col_counts, block_t, block_n)


__all__ = ["KeyWork", "MaskedTiles", "key_work", "key_work_capacity", "masked_tiles"]
