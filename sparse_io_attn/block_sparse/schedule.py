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
depends only on the layout and the offset; :func:`schedule` caches it per layout (weakly) and
rebuilds it when the layout's tensors are edited in place. Lists have one slot per storage slot of
the layout (the entries first, unused slots after the last pointer), so building them is a fixed
amount of tensor work on the layout's device, without host synchronisation.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from sparse_io_attn.layout._csr import csc_order, front_slots, group_offsets, pack_front, slot_entries
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
    """The full/partial split of ``layout`` under ``causal_offset``, built on the layout's device
    and cached per layout until one of its tensors is edited in place (its version key changes)."""
    per = _CACHE.setdefault(layout, {})
    key = layout.version_key()
    hit = per.get(causal_offset)
    if hit is None or hit[0] != key or key is None:
        hit = per[causal_offset] = (key, _build(layout, causal_offset))
    return hit[1]


def classify(layout: BlockSparseLayout, causal_offset: int | None, lid, r, c, pid):
    """For kept blocks ``(lid, r, c)`` with partial ids ``pid``: ``(alive, full)`` bool masks
    (liveness decided by :func:`~sparse_io_attn.layout.causal.causal_blocks`)."""
    live = causal_blocks(r, c, layout.block_size, layout.seqlen, causal_offset)
    return live.alive, live.alive & live.whole & (pid < 0)


def _lists(L: int, n: int, own, other, pid, alive, full) -> BlockLists:
    """Entries (sorted by ``own``, the flat row ``l * n + i`` of the order) -> CSR-style full and
    partial lists over ``L * n`` rows, each packed at the front of a buffer with one slot per entry
    (slots past the last pointer hold block 0 / mask -1 and are never read)."""
    part = alive & ~full
    full_at, part_at = front_slots(full), front_slots(part)
    return BlockLists(group_offsets(own, full, L * n, L), pack_front(full_at, other, 0),
                      group_offsets(own, part, L * n, L), pack_front(part_at, other, 0),
                      pack_front(part_at, pid, -1))


def _build(layout: BlockSparseLayout, causal_offset: int | None) -> Schedule:
    """Tensor operations on the layout's device over its storage slots (O(slots), fixed sizes: no
    ``nonzero``, no ``.item()``, no host copy), so a layout chosen on the device every step is
    scheduled without synchronising."""
    L, R, C = layout.num_layouts, layout.num_q_blocks, layout.num_kv_blocks
    col = layout.col_slots.to(torch.int64)
    used, lid, r = slot_entries(layout.crow_indices, col.numel())   # unused capacity: used False
    pid = layout.partial_id_slots.to(torch.int64)
    alive, full = classify(layout, causal_offset, lid, r, col, pid)
    alive, full = alive & used, full & used
    rows = _lists(L, R, lid * R + r, col, pid, alive, full)
    order = csc_order(used, lid, r, col, R, C)
    cols = _lists(L, C, (lid * C + col)[order], r[order], pid[order], alive[order], full[order])
    masks = layout.partial_masks if layout.partial_masks.shape[0] else torch.zeros(
        1, *layout.partial_masks.shape[1:], dtype=torch.int32, device=layout.device)
    return Schedule(rows, cols, masks.contiguous(), causal_offset)
