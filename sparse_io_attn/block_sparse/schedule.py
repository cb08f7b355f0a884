"""The kernels' view of a layout: kept blocks split into **full** and **partial** lists.

For a layout and a causal offset (``None``: no causal mask; ``delta``: key ``j`` allowed for query
``i`` iff ``j <= i + delta``, 0 for top-left, ``seqlen_k - seqlen_q`` for bottom-right alignment)
a block is

* dropped when no element of it survives the causal mask,
* **full** when it is a full block of the layout, lies entirely inside both sequence lengths and
  entirely on the allowed side of the causal diagonal: the kernels run it without any mask (no
  bounds checks, no causal test, no bit loads),
* **partial** otherwise: the kernels apply the key/query padding, the causal test and, when
  ``mask_id >= 0``, the layout's element mask ``partial_masks[mask_id]``.

Both lists exist in CSR order (query-block rows, for the forward and dQ kernels) and CSC order
(key-block columns, for dK/dV), with absolute int32 offsets like the layout's own CSR. A schedule
depends only on the layout and the offset; :func:`schedule` caches it per layout (weakly).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE, _absolute_crow
from sparse_io_attn.layout.causal import causal_blocks
from sparse_io_attn.layout.core import BlockSparseLayout


@dataclass(frozen=True)
class BlockLists:
    """One order (CSR or CSC) of the full and partial lists: ``*_ptr [L, n + 1]`` absolute offsets,
    ``*_idx`` the other-axis block index of each entry, ``part_mask`` the element-mask id (-1: none)."""
    full_ptr: torch.Tensor
    full_idx: torch.Tensor
    part_ptr: torch.Tensor
    part_idx: torch.Tensor
    part_mask: torch.Tensor


@dataclass(frozen=True)
class Schedule:
    rows: BlockLists      # CSR: per query-block row, key blocks
    cols: BlockLists      # CSC: per key-block column, query blocks
    masks: torch.Tensor   # int32 [max(1, num_masks), BLOCK_SIZE_Q, W], the layout's partial masks
    causal_offset: int | None

    def to(self, device) -> "Schedule":
        mv = lambda lists: BlockLists(*(t.to(device) for t in (lists.full_ptr, lists.full_idx,  # noqa: E731
                                                                   lists.part_ptr, lists.part_idx, lists.part_mask)))
        return Schedule(mv(self.rows), mv(self.cols), self.masks.to(device), self.causal_offset)


_CACHE: "weakref.WeakKeyDictionary[BlockSparseLayout, dict]" = weakref.WeakKeyDictionary()


def schedule(layout: BlockSparseLayout, causal_offset: int | None) -> Schedule:
    """The full/partial split of ``layout`` under ``causal_offset`` (cached per layout)."""
    per = _CACHE.setdefault(layout, {})
    if causal_offset not in per:
        per[causal_offset] = _build(layout, causal_offset)
    return per[causal_offset]


def classify(layout: BlockSparseLayout, causal_offset: int | None, lid, r, c, pid):
    """For kept blocks ``(lid, r, c)`` with partial ids ``pid``: ``(alive, full)`` bool masks
    (liveness decided by :func:`~sparse_io_attn.layout.causal.causal_blocks`)."""
    live = causal_blocks(r, c, layout.block_size, layout.seqlen, causal_offset)
    return live.alive, live.alive & live.whole & (pid < 0)


def _lists(L: int, n: int, own, other, pid, alive, full) -> BlockLists:
    """Entries (in the wanted order) -> CSR-style full/partial lists over ``L * n`` rows."""
    def ptr(sel):
        counts = torch.bincount((own[sel]), minlength=L * n)
        flat = torch.zeros(L * n + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=flat[1:])
        return _absolute_crow(flat, L, n).to(INDEX_DTYPE)
    part = alive & ~full
    return BlockLists(ptr(full), other[full].to(INDEX_DTYPE), ptr(part), other[part].to(INDEX_DTYPE),
                      pid[part].to(INDEX_DTYPE))


def _build(layout: BlockSparseLayout, causal_offset: int | None) -> Schedule:
    lo = layout.to("cpu")
    L, R, C = lo.num_layouts, lo.num_q_blocks, lo.num_kv_blocks
    lid, r, c = lo.entries()
    pid = lo.partial_ids.to(torch.int64)
    alive, full = classify(lo, causal_offset, lid, r, c, pid)
    rows = _lists(L, R, lid * R + r, c, pid, alive, full)
    # CSC order: sort by (lid, c, r)
    order = torch.argsort((lid * C + c) * R + r)
    cols = _lists(L, C, (lid * C + c)[order], r[order], pid[order], alive[order], full[order])
    masks = lo.partial_masks if lo.partial_masks.shape[0] else torch.zeros(
        1, *lo.partial_masks.shape[1:], dtype=torch.int32)
    return Schedule(rows, cols, masks.contiguous(), causal_offset).to(layout.device)
