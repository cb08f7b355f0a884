"""`AttentionPlan`: a layout made ready for the kernels, built once and run many times.

``plan(layout, causal=...)`` does every piece of per-layout work the backends need, on the layout's
device with tensor operations only (no ``nonzero``, ``.item()`` or host copy), and returns an
:class:`AttentionPlan`:

* the kept blocks split into **full** and **partial** lists in CSR order (query-block rows: the
  forward and dQ kernels) and CSC order (key-block columns: dK/dV), with absolute int32 offsets
  (:class:`BlockLists`). A block is **dropped** when no element of it survives causality (its
  rectangle lies above the diagonal, or its element mask does:
  :func:`~sparse_io_attn.layout.causal.causal_blocks`); **full** when it is a full block of the layout,
  inside both lengths and wholly on the allowed side of the diagonal (the kernels run it without
  any mask); **partial** otherwise (padding, the causal test and, for ``mask_id >= 0``, the element
  mask ``masks[mask_id]``). Lists keep one slot per storage slot of the layout, the entries first, so
  their sizes depend on shapes only;
* the element masks and their transposes (what dK/dV reads on the CPU backend);
* all of it packed into one int32 tensor, :attr:`AttentionPlan.index` (each piece 16-byte
  aligned), which with the integers :attr:`AttentionPlan.meta` is how a plan crosses the custom
  op's boundary (:mod:`sparse_io_attn.block_sparse.op`).

Everything a backend derives from a plan (the head expansion of a per-KV-head layout, device
copies, the torch path's host plan) is kept in the plan itself (:meth:`AttentionPlan.derived`):
no backend keeps a cache of its own. ``plan(layout, ...)`` is cached on the layout until one of
its tensors is edited in place (the layout's one cache, keyed on its tensors' version counters);
a plan whose layout was edited since is refused by the attention call.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._grid_shape import GridShape
from sparse_io_attn.layout._csr import INDEX_DTYPE, csc_order, front_slots, group_offsets, pack_front, slot_entries
from sparse_io_attn.layout.causal import CAUSAL_MODES, causal_blocks, causal_offset, mask_offsets
from sparse_io_attn.layout.core import BlockSparseLayout

#: the integers of :attr:`AttentionPlan.meta`, in order
META_FIELDS = ("block_size_q", "block_size_kv", "seqlen_q", "seqlen_k", "layout_batch", "layout_heads",
               "slots", "num_masks", "checked")
_ALIGN = 4   # int32 entries: pieces of the packed index start at 16-byte boundaries


@dataclass(frozen=True)
class BlockLists:
    """One order (CSR or CSC) of the full and partial lists: ``*_ptr [L, n + 1]`` absolute offsets,
    ``*_idx`` the other-axis block index of each entry, ``part_mask`` the element-mask id (-1: none)."""
    full_ptr: torch.Tensor
    full_idx: torch.Tensor
    part_ptr: torch.Tensor
    part_idx: torch.Tensor
    part_mask: torch.Tensor

    def tensors(self) -> tuple:
        return (self.full_ptr, self.full_idx, self.part_ptr, self.part_idx, self.part_mask)


def _pieces(meta: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the packed index's pieces, in order."""
    bq, bk = meta["block_size_q"], meta["block_size_kv"]
    L = meta["layout_batch"] * meta["layout_heads"]
    R, C, n = math.ceil(meta["seqlen_q"] / bq), math.ceil(meta["seqlen_k"] / bk), meta["slots"]
    NM = max(1, meta["num_masks"])
    out = []
    for order, own in (("rows", R), ("cols", C)):
        out += [(f"{order}.full_ptr", (L, own + 1)), (f"{order}.full_idx", (n,)), (f"{order}.part_ptr", (L, own + 1)),
                (f"{order}.part_idx", (n,)), (f"{order}.part_mask", (n,))]
    return out + [("masks", (NM, bq, _bits.num_words(bk))), ("masks_t", (NM, bk, _bits.num_words(bq)))]


def _pack(parts: dict, meta: dict, device) -> torch.Tensor:
    chunks = []
    for name, shape in _pieces(meta):
        flat = parts[name].reshape(-1).to(INDEX_DTYPE)
        assert flat.numel() == math.prod(shape), (name, flat.numel(), shape)
        pad = -flat.numel() % _ALIGN
        chunks += [flat, torch.zeros(pad, dtype=INDEX_DTYPE, device=device)] if pad else [flat]
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=INDEX_DTYPE, device=device)


def _unpack(index: torch.Tensor, meta: dict) -> dict:
    views, pos = {}, 0
    for name, shape in _pieces(meta):
        size = math.prod(shape)
        views[name] = index[pos:pos + size].view(shape)
        pos += size + (-size % _ALIGN)
    if pos != index.numel():
        raise ValueError(f"the plan's index has {index.numel()} entries but its meta {meta} describes {pos}")
    return views


def _lists(L: int, n: int, own, other, pid, alive, full) -> BlockLists:
    """Entries (sorted by ``own``, the flat row ``l * n + i`` of the order) -> CSR-style full and
    partial lists over ``L * n`` rows, each packed at the front of a buffer with one slot per entry
    (slots past the last pointer hold block 0 / mask -1 and are never read)."""
    part = alive & ~full
    full_at, part_at = front_slots(full), front_slots(part)
    return BlockLists(group_offsets(own, full, L * n, L), pack_front(full_at, other, 0),
                      group_offsets(own, part, L * n, L), pack_front(part_at, other, 0),
                      pack_front(part_at, pid, -1))


def transpose_masks(masks: torch.Tensor, block_size_kv: int) -> torch.Tensor:
    """``int32 [NM, bq, ceil(bk/32)]`` -> ``int32 [NM, bk, ceil(bq/32)]``: bit ``(r, c)`` -> ``(c, r)``."""
    return _bits.pack(_bits.unpack(masks, block_size_kv).transpose(1, 2).contiguous())


def _build_parts(layout: BlockSparseLayout, delta: int | None) -> dict:
    """The lists and masks of ``layout`` under ``delta``: tensor operations over its storage slots."""
    L, R, C = layout.num_layouts, layout.num_q_blocks, layout.num_kv_blocks
    col = layout.col_slots.to(torch.int64)
    used, lid, r = slot_entries(layout.crow_indices, col.numel())   # unused capacity: used False
    pid = layout.partial_id_slots.to(torch.int64)
    offset = None
    if delta is not None and layout.partial_masks.shape[0]:
        per_mask = mask_offsets(layout.partial_masks, layout.BLOCK_SIZE_KV)
        offset = torch.where(pid >= 0, per_mask[pid.clamp(min=0)], -layout.BLOCK_SIZE_Q)
    live = causal_blocks(r, col, layout.block_size, layout.seqlen, delta, offset)
    alive, full = live.alive & used, live.alive & live.whole & (pid < 0) & used
    parts = {}
    rows = _lists(L, R, lid * R + r, col, pid, alive, full)
    order = csc_order(used, lid, r, col, R, C)
    cols = _lists(L, C, (lid * C + col)[order], r[order], pid[order], alive[order], full[order])
    for name, lists in (("rows", rows), ("cols", cols)):
        for field, t in zip(("full_ptr", "full_idx", "part_ptr", "part_idx", "part_mask"), lists.tensors()):
            parts[f"{name}.{field}"] = t
    masks = layout.partial_masks if layout.partial_masks.shape[0] else torch.zeros(
        1, *layout.partial_masks.shape[1:], dtype=torch.int32, device=layout.device)
    parts["masks"] = masks
    parts["masks_t"] = transpose_masks(masks, layout.BLOCK_SIZE_KV)
    return parts


#: the attribute of a plan's ``index`` tensor holding a weak reference to the plan (how the custom op
#: finds the plan object, with what it derived, from the tensor it receives)
PLAN_ATTR = "_sparse_io_attn_plan"


class AttentionPlan(GridShape):
    """A layout planned for the kernels under one causal mode (see the module docstring).

    Build it with :func:`plan`; pass it to :func:`~sparse_io_attn.block_sparse_attention` wherever a
    layout is accepted (the call's ``causal`` must equal the plan's). Attributes: ``causal`` (as
    given), ``causal_offset`` (the ``delta`` of ``j <= i + delta``, or ``None``), ``block_size``,
    ``seqlen``, ``layout_batch``, ``layout_heads``, ``rows`` / ``cols`` (:class:`BlockLists`),
    ``masks`` (``int32 [max(1, num_masks), bq, W]``), ``masks_t`` (transposed), ``index`` and
    ``meta`` (the packed form), ``layout`` (the layout it was built from, ``None`` for a plan
    rebuilt from an op's arguments), ``checked`` (index ranges known valid).
    """

    def __init__(self, index: torch.Tensor, meta: tuple, causal, *, layout: BlockSparseLayout | None = None,
                 source: BlockSparseLayout | None = None, version: tuple | None = None):
        self.index = index
        self.meta = tuple(int(x) for x in meta)
        m = dict(zip(META_FIELDS, self.meta))
        self.block_size = (m["block_size_q"], m["block_size_kv"])
        self.seqlen = (m["seqlen_q"], m["seqlen_k"])
        self.layout_batch, self.layout_heads = m["layout_batch"], m["layout_heads"]
        self.slots, self.num_masks, self.checked = m["slots"], m["num_masks"], bool(m["checked"])
        self.causal = causal
        self.causal_offset = causal_offset(causal, *self.seqlen)
        views = _unpack(index, m)
        self.rows = BlockLists(*(views[f"rows.{f}"] for f in ("full_ptr", "full_idx", "part_ptr", "part_idx",
                                                               "part_mask")))
        self.cols = BlockLists(*(views[f"cols.{f}"] for f in ("full_ptr", "full_idx", "part_ptr", "part_idx",
                                                               "part_mask")))
        self.masks, self.masks_t = views["masks"], views["masks_t"]
        self.layout = layout
        self.source = source if source is not None else layout   # the user's layout: staleness is its edits
        self.version = version
        self._derived: dict = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, layout: BlockSparseLayout, causal=False, *, source: BlockSparseLayout | None = None) -> "AttentionPlan":
        """Plan ``layout`` under ``causal`` (see :func:`plan`, which caches the result on the layout).
        ``source``: the user's layout ``layout`` was derived from (a head expansion), whose in-place
        edits make the plan stale."""
        if not isinstance(layout, BlockSparseLayout):
            raise TypeError(f"expected a BlockSparseLayout, got {type(layout).__name__}")
        if causal not in CAUSAL_MODES:
            raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
        layout.check()      # index ranges, once per layout version: no kernel reads outside its tensors
        version = (source if source is not None else layout).version_key()
        meta = dict(block_size_q=layout.BLOCK_SIZE_Q, block_size_kv=layout.BLOCK_SIZE_KV,
                    seqlen_q=layout.seqlen_q, seqlen_k=layout.seqlen_k, layout_batch=layout.layout_batch,
                    layout_heads=layout.layout_heads, slots=layout.col_slots.numel(),
                    num_masks=layout.partial_masks.shape[0], checked=1)
        parts = _build_parts(layout, causal_offset(causal, *layout.seqlen))
        index = _pack(parts, meta, layout.device)
        return cls(index, tuple(meta[f] for f in META_FIELDS), causal, layout=layout, source=source, version=version)

    @classmethod
    def from_op(cls, index: torch.Tensor, meta, causal_offset_: int | None) -> "AttentionPlan":
        """The plan behind a custom op's ``(index, meta, causal_offset)``: the plan that packed this
        ``index`` tensor when it is still alive, else a plan rebuilt over it (validated once unless
        its meta says it was built checked)."""
        ref = getattr(index, PLAN_ATTR, None)
        hit = ref() if ref is not None else None
        if hit is not None and hit.index is index and hit.meta[:-1] == tuple(meta)[:-1] \
                and hit.causal_offset == causal_offset_:
            return hit
        m = dict(zip(META_FIELDS, meta))
        delta_causal = _causal_for_offset(causal_offset_, m["seqlen_q"], m["seqlen_k"])
        plan = cls(index, meta, delta_causal)
        if not plan.checked:
            plan.validate()
        plan.register()
        return plan

    def register(self) -> "AttentionPlan":
        """Make this plan findable from its ``index`` tensor (what the custom op receives): a weak
        reference in an attribute of the tensor, so the plan lives as long as its holders do."""
        if not torch.compiler.is_compiling():
            setattr(self.index, PLAN_ATTR, weakref.ref(self))
        return self

    # ------------------------------------------------------------------ views
    @property
    def device(self) -> torch.device:
        return self.index.device

    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seqlen[0] / self.block_size[0])

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seqlen[1] / self.block_size[1])

    @property
    def kept_fraction(self) -> float:
        """Storage slots over the block grid (``slots / (layouts * R * C)``): the kept fraction of
        blocks, before causality (above it where the layout holds spare capacity). From the plan's
        integers only, never a device read: what autotuning buckets the work by."""
        return self.slots / max(1, self.num_layouts * self.num_q_blocks * self.num_kv_blocks)

    def is_stale(self) -> bool:
        """Whether the layout this plan was built from has been edited in place since."""
        return (self.source is not None and self.version is not None
                and not torch.compiler.is_compiling() and self.source.version_key() != self.version)

    def check_heads(self, batch: int, num_heads_q: int, num_heads_kv: int) -> None:
        """Refuse inputs of ``batch`` x ``num_heads_q`` heads the plan's masks do not broadcast over."""
        self.layout_strides(batch, num_heads_q)

    def layout_strides(self, batch: int, num_heads_q: int) -> tuple[int, int]:
        """``(stride_lb, stride_lh)``: batch ``b``, query head ``h`` use mask ``b * stride_lb + h *
        stride_lh``; ``ValueError`` when the plan's masks do not fit ``[batch, num_heads_q]``."""
        self.check_broadcast(batch, num_heads_q)
        return (self.layout_heads if self.layout_batch > 1 else 0), (1 if self.layout_heads > 1 else 0)

    def derived(self, key, build):
        """``build()``, computed once per plan under ``key`` and kept with it: what backends derive
        from a plan (device copies, head expansions, the torch path's host plan)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def to(self, device) -> "AttentionPlan":
        """This plan on ``device`` (kept: asking twice returns the same object)."""
        device = torch.device(device)
        if device == self.device or (device.type == self.device.type and device.index is None):
            return self
        return self.derived(("device", str(device)), lambda: AttentionPlan(
            self.index.to(device), self.meta, self.causal, layout=self.layout, source=self.source,
            version=self.version).register())

    def for_heads(self, num_heads_q: int, num_heads_kv: int) -> "AttentionPlan":
        """The plan serving ``num_heads_q`` query heads: ``self`` when the layout holds 1 or
        ``num_heads_q`` head masks; for one mask per KV head (a selection shared by each GQA group)
        the plan of the layout with its masks repeated for the query heads of each group (kept)."""
        lh = self.layout_heads
        if lh in (1, num_heads_q):
            return self
        if self.layout is None or num_heads_kv < 1 or num_heads_q % num_heads_kv or lh != num_heads_kv:
            raise ValueError(f"layout has {lh} head masks but q has {num_heads_q} heads and k/v {num_heads_kv}; "
                             f"build it with 1 (shared), {num_heads_q} (one per query head) or "
                             f"{num_heads_kv} (one per KV head) head masks")
        return self.derived(("heads", num_heads_q), lambda: AttentionPlan.build(
            self.layout.for_query_heads(num_heads_q, num_heads_kv), self.causal, source=self.source).register())

    # ------------------------------------------------------------------ validation
    def validate(self) -> "AttentionPlan":
        """Check every offset, block index and mask id against the plan's sizes (``ValueError``
        naming the bad piece), then mark the plan checked: a plan rebuilt from a direct op call
        may carry any values, and no kernel may read outside its tensors."""
        n, NM = self.slots, max(1, self.num_masks)
        for name, lists, own, other in (("rows", self.rows, self.num_q_blocks, self.num_kv_blocks),
                                        ("cols", self.cols, self.num_kv_blocks, self.num_q_blocks)):
            for kind, ptr, idx in (("full", lists.full_ptr, lists.full_idx), ("part", lists.part_ptr, lists.part_idx)):
                flat = torch.cat([ptr[:, :-1].reshape(-1), ptr[-1:, -1]]).to(torch.int64)
                ok = bool((flat[0] == 0) & (flat[1:] >= flat[:-1]).all() & (flat[-1] <= n)) if flat.numel() else True
                ok = ok and bool((ptr[1:, 0] == ptr[:-1, -1]).all())
                if not ok:
                    raise ValueError(f"plan {name}.{kind}_ptr: offsets must start at 0, never decrease and stay "
                                     f"<= {n} (the slots)")
                used = idx[:int(flat[-1])] if flat.numel() else idx[:0]
                if used.numel() and (int(used.min()) < 0 or int(used.max()) >= other):
                    raise ValueError(f"plan {name}.{kind}_idx: block indices must lie in [0, {other})")
            used = lists.part_mask[:int(lists.part_ptr[-1, -1])]
            if used.numel() and (int(used.min()) < -1 or int(used.max()) >= NM):
                raise ValueError(f"plan {name}.part_mask: mask ids must lie in [-1, {NM})")
        self.checked = True
        self.meta = self.meta[:-1] + (1,)
        return self

    # ------------------------------------------------------------------ copies
    def __reduce__(self):
        """Pickling, ``copy.copy`` and ``copy.deepcopy``: the packed index (without the weak reference
        :meth:`register` sets on it), ``meta``, ``causal`` and the layouts. The copy is a plan of its
        own: registered on its index, validated once, its version taken from its copied layout (a
        layout's version counters do not survive a copy), so it is stale exactly when this plan is;
        what backends derived (:meth:`derived`) is rebuilt on use."""
        return (_rebuilt_plan, (self.index.detach(), self.meta, self.causal, self.layout, self.source,
                                self.is_stale()))

    def __repr__(self) -> str:
        return (f"AttentionPlan(seqlen={self.seqlen}, block_size={self.block_size}, causal={self.causal!r}, "
                f"layouts={self.layout_batch}x{self.layout_heads}, slots={self.slots}, device={self.device})")


#: the version of a copied stale plan: equal to no layout's version_key(), so the copy stays stale
_STALE = ("stale",)


def _rebuilt_plan(index: torch.Tensor, meta: tuple, causal, layout, source, stale: bool) -> AttentionPlan:
    """A copy of a plan (:meth:`AttentionPlan.__reduce__`)."""
    version = _STALE if stale else (None if source is None else source.version_key())
    copy = AttentionPlan(index, tuple(meta)[:-1] + (0,), causal, layout=layout, source=source, version=version)
    return copy.validate().register()


def _causal_for_offset(delta: int | None, seqlen_q: int, seqlen_k: int):
    """A ``causal`` mode whose offset is ``delta`` (for plans rebuilt from an op's offset)."""
    if delta is None:
        return False
    if delta == 0:
        return "top_left"
    if delta == seqlen_k - seqlen_q:
        return "bottom_right"
    raise ValueError(f"causal_offset {delta} is neither 0 (top_left) nor seqlen_k - seqlen_q = "
                     f"{seqlen_k - seqlen_q} (bottom_right)")


def plan(layout: BlockSparseLayout, *, causal=False, num_heads_q: int | None = None,
         num_heads_kv: int | None = None) -> AttentionPlan:
    """The :class:`AttentionPlan` of ``layout`` under ``causal`` (``False``, ``True``/``"top_left"``,
    ``"bottom_right"``), built on the layout's device without host synchronisation, and cached on
    the layout until one of its tensors is edited in place. Hold it and pass it to
    :func:`~sparse_io_attn.block_sparse_attention` to skip even the cache lookup::

        p = sparse_io_attn.plan(layout, causal=True)
        out = block_sparse_attention(q, k, v, p, causal=True)

    With ``num_heads_q``/``num_heads_kv``, a layout holding one mask per KV head is planned directly
    for the query heads of each group (one plan, no intermediate one).
    """
    if not isinstance(layout, BlockSparseLayout):
        raise TypeError(f"plan() takes a BlockSparseLayout, got {type(layout).__name__}; for a per-token "
                        f"Selection use sparse_io_attn.selection.plan_selection")
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    mode = "top_left" if causal is True else causal
    lh = layout.layout_heads
    if num_heads_q is not None and lh not in (1, num_heads_q):
        kv = num_heads_kv if num_heads_kv is not None else lh
        return layout.cached(("plan", mode, num_heads_q), lambda: AttentionPlan.build(
            layout.for_query_heads(num_heads_q, kv), causal, source=layout).register())
    return layout.cached(("plan", mode), lambda: AttentionPlan.build(layout, causal).register())


__all__ = ["AttentionPlan", "BlockLists", "META_FIELDS", "plan", "transpose_masks"]
