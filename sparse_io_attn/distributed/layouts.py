"""The layout a static :class:`~sparse_io_attn.distributed.plan.ContextParallelPlan` is built from
and the layouts it gives each rank.

* :func:`causal_layout`: a layout intersected with the causal mask, element-exact, in O(kept
  blocks); the plan applies it when built with ``causal``.
* the plan's own copy of the layout (``_copy``: in-place edits of the caller's never reach it) and
  :func:`layout_digest`, the content fingerprint the ranks compare and
  :meth:`~sparse_io_attn.distributed.plan.ContextParallelPlan.check_source` re-reads;
* :class:`RankLayouts` and :func:`rank_layouts`: one rank's share (its rows x its own keys, x the
  keys it receives, the spread queries it receives x its keys), re-indexed into the rank's shard.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._assemble import inrange_words
from sparse_io_attn.layout.core import BlockSparseLayout, assemble


def causal_layout(layout: BlockSparseLayout) -> BlockSparseLayout:
    """``layout`` intersected with the causal mask ``j <= i``, element-exact, in O(kept blocks).

    Needs square blocks and ``seqlen_q == seqlen_k`` (then both causal alignments coincide): blocks
    below the diagonal keep their mask, diagonal blocks get theirs intersected with the lower
    triangle, blocks above it are dropped. A layout that is causal already (every row's last kept
    block at or left of the diagonal, diagonal masks inside the lower triangle: O(rows) to decide)
    is copied as it is; otherwise the kept blocks stay in CSR order (no sort): one pass drops the
    blocks above the diagonal, and only the diagonal blocks' masks are recomputed."""
    (b, _), n = layout.block_size, layout.seqlen_q
    R, L = layout.num_q_blocks, layout.num_layouts
    crow = layout.crow_indices.to(torch.int64)
    col, pid = layout.col_indices, layout.partial_ids
    nnz, dev = col.numel(), col.device
    name = f"causal({layout.name})"
    if nnz == 0:
        return _copy(layout, name)
    tril = _bits.pack(torch.ones(b, b, dtype=torch.bool, device=dev).tril())          # [b, W]
    r = torch.arange(R, device=dev).repeat(L)
    last = crow[:, 1:].reshape(-1) - 1
    nonempty = last >= crow[:, :-1].reshape(-1)
    last_c = col[last.clamp(min=0)].to(torch.int64)
    diag_rows = (nonempty & (last_c == r)).nonzero().squeeze(1)                        # [<= L R]
    d_pid = pid[last[diag_rows]].to(torch.int64)
    d_r = r[diag_rows]
    inr = inrange_words(d_r, d_r, layout.block_size, layout.seqlen)
    words = _words(layout.partial_masks, d_pid, inr)
    clipped = words & tril
    full_ok = (clipped == inr).flatten(1).all(1)                                       # a full diagonal block
    if not bool((nonempty & (last_c > r)).any()) and bool(torch.where(d_pid >= 0, (clipped == words).flatten(1).all(1),
                                                                       full_ok).all()):
        return _copy(layout, name)                                                       # causal already
    counts = (crow[:, 1:] - crow[:, :-1]).reshape(-1)
    flat = torch.repeat_interleave(torch.arange(L * R, device=dev), counts, output_size=nnz)
    c64 = col.to(torch.int64)
    rows = flat % R
    keep = c64 <= rows
    diag = (c64 == rows).nonzero().squeeze(1)                                           # the diagonal entries
    dr = rows[diag]
    inr = inrange_words(dr, dr, layout.block_size, layout.seqlen)
    p = pid[diag].to(torch.int64)
    words = _words(layout.partial_masks, p, inr) & tril
    empty = (words == 0).flatten(1).all(1)
    full = (words == inr).flatten(1).all(1)
    keep[diag[empty]] = False
    pid64 = pid.to(torch.int64)
    off = keep.clone()
    off[diag] = False                                                                   # kept off the diagonal
    used_old = torch.zeros(layout.partial_masks.shape[0] + 1, dtype=torch.bool, device=dev)
    used_old[torch.where(off & (pid64 >= 0), pid64, -1)] = True
    old_ids = used_old[:-1].nonzero().squeeze(1)
    new_words = ~empty & ~full
    masks, inverse = _bits.dedup(torch.cat([layout.partial_masks[old_ids], words[new_words]]))
    remap = torch.full((layout.partial_masks.shape[0] + 1,), -1, dtype=torch.int64, device=dev)
    remap[old_ids] = inverse[:old_ids.numel()]
    new_pid = remap[torch.where(pid64 >= 0, pid64, -1)]                              # -1: the spare, -1
    d_new = torch.full((diag.numel(),), -1, dtype=torch.int64, device=dev)
    d_new[new_words] = inverse[old_ids.numel():]
    new_pid[diag] = d_new
    kept_per_row = torch.zeros(L * R, dtype=torch.int64, device=dev).index_add_(0, flat, keep.to(torch.int64))
    offsets = torch.zeros(L * R + 1, dtype=torch.int64, device=dev)
    torch.cumsum(kept_per_row, 0, out=offsets[1:])
    new_crow = torch.cat([offsets[:-1].view(L, R), offsets[R::R].view(L, 1)], dim=1)
    out = BlockSparseLayout(new_crow, col[keep], block_size=layout.block_size, seqlen=(n, n),
                            layout_batch=layout.layout_batch, layout_heads=layout.layout_heads, name=name,
                            validate=False, partial_ids=new_pid[keep], partial_masks=masks)
    return out._mark_checked()


def _words(masks: torch.Tensor, ids: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The element masks of blocks with partial ids ``ids`` (``full``: the in-range words of full ones)."""
    padded = torch.cat([masks, masks.new_zeros((1, *masks.shape[1:]))])
    return torch.where((ids >= 0)[:, None, None], padded[torch.where(ids >= 0, ids, masks.shape[0])], full)


class RankLayouts(NamedTuple):
    """One rank's share of the plan's layout. ``local``: its query rows x its own key blocks (both in
    the rank's shard order, ``seqlen = (n_local, n_local)``). ``received``: its rows that are not
    spread x the K/V blocks it receives, in ascending global order (``seqlen = (n_local,
    n_received)``). ``foreign``: the spread query blocks it receives (ascending) x its own key blocks
    (``seqlen = (n_foreign, n_local)``). ``None`` when the rank receives no such block."""
    local: BlockSparseLayout
    received: BlockSparseLayout | None
    foreign: BlockSparseLayout | None


def rank_layouts(plan, rank: int) -> RankLayouts:
    """The layouts rank ``rank`` computes under ``plan`` (a static plan), element-exact."""
    lo = plan.layout
    lid, r, c = lo.entries()
    row_mine, col_mine = plan.owner[r] == rank, plan.owner[c] == rank
    mine = row_mine | col_mine
    lid, r, c, ids = lid[mine], r[mine], c[mine], lo.partial_ids[mine].to(torch.int64)
    row_mine, col_mine, spread = row_mine[mine], col_mine[mine], plan.spread[r]
    recv, foreign = plan.recv_blocks(rank), plan.recv_queries(rank)
    n_local = plan.num_tokens(rank)
    parts = []
    for sel, rows, cols, n_q, n_k, what in (
            (row_mine & col_mine, plan.local_index[r], plan.local_index[c], n_local, n_local, "local"),
            (row_mine & ~col_mine & ~spread, plan.local_index[r], torch.searchsorted(recv, c), n_local,
             plan.tokens(recv), "received"),
            (~row_mine & col_mine & spread, torch.searchsorted(foreign, r), plan.local_index[c],
             plan.tokens(foreign), n_local, "foreign")):
        if n_q == 0 or n_k == 0:
            parts.append(None)
            continue
        part = ids[sel] >= 0
        parts.append(assemble(lid[sel], rows[sel], cols[sel], lo.partial_masks[ids[sel][part]],
                              partial=part, block_size=lo.block_size, seqlen=(n_q, n_k),
                              layout_batch=lo.layout_batch, layout_heads=lo.layout_heads,
                              name=f"{lo.name}@rank{rank}.{what}"))
    return RankLayouts(*parts)


def _digest(*tensors: torch.Tensor) -> int:
    """A 63-bit fingerprint (BLAKE2b) of the tensors' dtypes, shapes and bytes, read on the CPU."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15 - 2 ** 64, 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (arithmetic shifts, wrapping products): a fixed scramble."""
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


def layout_digest(layout: BlockSparseLayout) -> int:
    """A 63-bit fingerprint of a layout's contents: sizes, kept blocks (``crow_indices``,
    ``col_indices``) and each partial block's position and element mask, the masks fingerprinted
    by content (equal layouts whose masks are stored in another order get the same digest).
    O(kept blocks + stored mask words); reads the layout on the CPU."""
    masks = layout.partial_masks.cpu().to(torch.int64).flatten(1)                 # [num_masks, words]
    position = torch.arange(masks.shape[1], dtype=torch.int64) * _GOLDEN
    mask_keys = _mix64(masks + position).sum(1)                                    # one 64-bit key per mask
    ids = layout.partial_ids.cpu()
    part = (ids >= 0).nonzero().squeeze(1)
    sizes = torch.tensor([*layout.block_size, *layout.seqlen, layout.layout_batch, layout.layout_heads])
    return _digest(sizes, layout.crow_indices, layout.col_indices, part, mask_keys[ids[part].to(torch.int64)])


def _copy(layout: BlockSparseLayout, name: str | None = None) -> BlockSparseLayout:
    """The layout on fresh storage (the plan's own: in-place edits of the caller's never reach it);
    index ranges validated unless the source's are known valid."""
    out = BlockSparseLayout(layout.crow_indices.clone(), layout.col_slots.clone(), block_size=layout.block_size,
                            seqlen=layout.seqlen, layout_batch=layout.layout_batch,
                            layout_heads=layout.layout_heads, name=name or layout.name, validate=False,
                            partial_ids=layout.partial_id_slots.clone(), partial_masks=layout.partial_masks.clone(),
                            fixed_capacity=layout.fixed_capacity)
    return out._mark_checked() if layout.checked else out.check()


__all__ = ["RankLayouts", "causal_layout", "layout_digest", "rank_layouts"]
