"""`SelectionPlan`: what the kernels need to run one :class:`~sparse_io_attn.layout.selection.Selection`,
built once on the selection's device with tensor operations only (no ``nonzero``, ``.item()`` or host
copy: shapes depend on the inputs' shapes alone), then run forward and backward.

Two views of the same (query token, key block) pairs:

* **Rows** (query-major; forward and dQ): ``rows int32 [L, Nq, K]``, each query row's blocks
  normalised: the valid entries (``0 <= c < num_kv_blocks``, inside ``counts``, not wholly in the
  causal future ``c * block_size > t + delta``), each block once, ascending, packed at the front;
  ``-1`` after. ``row_counts int32 [L, Nq]``. ``L = layout_batch * G`` (selection ``l = b *
  stride_lb + g``).
* **Columns** (key-major; dK/dV, and the forward of gathered-query kernels): for every ``(l, c)``
  the query tokens that chose block ``c``, ascending: ``col_ptr int32 [L, num_kv_blocks + 1]``
  (absolute offsets, like a layout's CSR), ``col_query int32 [L * Nq * K]`` (the token ``t``) and
  ``col_slot int32 [L * Nq * K]`` (the pair's slot ``j`` in row ``t``: ``rows[l, t, j] == c``);
  entries past ``col_ptr[-1, -1]`` are unused capacity. Built on first use (one stable sort).

Because rows are normalised (ascending, unique), results do not depend on the order or repetition
of the user's indices, and every backend walks each row's blocks in the same order.

**Packed sequences** (``cu_seqlens``, :mod:`.varlen`): the user's local block numbers become global
ones (each sequence's blocks after the previous sequences'), normalised as above, and the plan keeps
the **block table** ``table int32 [2 num_kv_blocks + Nq]`` (each block's first key and end, each
row's causal offset), which every backend reads in place of ``c * block_size`` and ``delta``
(:meth:`SelectionPlan.key_start`, :meth:`~SelectionPlan.key_count`, :meth:`~SelectionPlan.causal_limit`);
``table`` is None on the fixed grid.

On CPU tensors, once the library's C++ extension is loaded (the first ``backend="cpu"`` call, or
``backend="auto"`` on CPU, loads it; :func:`sparse_io_attn.selection.cpu.load` does it directly),
:func:`normalize_rows` and :func:`key_lists` run its ops ``selection_rows`` (a bitmap per row
instead of a sort) and ``selection_keys`` (a counting sort): element for element the same results,
tens of times faster. The torch code below is the reference and the path on other devices and
under ``torch.compile``.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE, check_index_capacity, group_offsets
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.varlen import Varlen, block_table, capacity, global_blocks


def _native_ops(t: torch.Tensor):
    """The C++ extension's op namespace when ``t`` is a CPU tensor and the extension is loaded (its
    ops registered), else None. Never builds it, and stays out of code traced by torch.compile."""
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    ops = torch.ops.sparse_io_attn_cpu
    try:
        ops.selection_keys  # noqa: B018  (resolves only once the extension registered it)
    except (AttributeError, RuntimeError):
        return None
    return ops


class KeyLists(NamedTuple):
    """The key-major view: per ``(l, c)``, the query tokens that chose block ``c`` (ascending)."""
    col_ptr: torch.Tensor     # int32 [L, num_kv_blocks + 1], absolute offsets
    col_query: torch.Tensor   # int32 [L * Nq * K]: query token of each entry
    col_slot: torch.Tensor    # int32 [L * Nq * K]: slot j of the entry in its row


class HeadMap(NamedTuple):
    """How ``[B, Hq]`` index the plan: selection ``l = b * stride_lb + h // heads_per_selection``;
    KV head ``h // (Hq // Hkv)``."""
    stride_lb: int
    heads_per_selection: int


def normalize_rows(indices: torch.Tensor, counts: torch.Tensor | None, num_kv_blocks: int, block_size: int,
                   causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``indices [L, Nq, K]`` -> ``(rows int32 [L, Nq, K], row_counts int32 [L, Nq])``: each row's valid,
    causally alive blocks, each once, ascending, at the front; ``-1`` after (see the module docstring)."""
    ops = _native_ops(indices)
    if ops is not None:
        rows, row_counts = ops.selection_rows(indices, counts, num_kv_blocks, block_size, causal_offset)
        return rows, row_counts
    L, Nq, K = indices.shape
    dev = indices.device
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < num_kv_blocks)
    if counts is not None:
        valid &= torch.arange(K, device=dev) < counts.to(torch.int64)[..., None]
    if causal_offset is not None:      # the block's first key must be allowed for this query
        t = torch.arange(Nq, device=dev)[:, None]
        valid &= idx * block_size <= t + causal_offset
    ordered = torch.sort(torch.where(valid, idx, num_kv_blocks), dim=-1).values     # invalid last
    keep = ordered < num_kv_blocks
    keep[..., 1:] &= ordered[..., 1:] != ordered[..., :-1]                          # each block once
    kept = keep.to(torch.int64)
    slot = torch.where(keep, torch.cumsum(kept, -1) - kept, K)                      # spare slot K
    rows = torch.full((L, Nq, K + 1), -1, dtype=INDEX_DTYPE, device=dev)
    rows.scatter_(-1, slot, ordered.to(INDEX_DTYPE))
    return rows[..., :K].contiguous(), kept.sum(-1).to(INDEX_DTYPE)


def key_lists(rows: torch.Tensor, num_kv_blocks: int) -> KeyLists:
    """The key-major view of normalised ``rows [L, Nq, K]``: one stable sort of the pairs by
    ``(l, c)`` (entries come in ``(t, j)`` order, so tokens stay ascending), offsets by scatter-add."""
    L, Nq, K = rows.shape
    dev = rows.device
    n = L * Nq * K
    check_index_capacity(n, "selection")
    ops = _native_ops(rows)
    if ops is not None:
        return KeyLists(*ops.selection_keys(rows, num_kv_blocks))
    c = rows.reshape(-1).to(torch.int64)
    used = c >= 0
    flat = torch.arange(n, device=dev)
    lid = flat // (Nq * K)
    group = torch.where(used, lid * num_kv_blocks + c, L * num_kv_blocks)
    order = torch.sort(group, stable=True).indices
    col_ptr = group_offsets(group, used, L * num_kv_blocks, L)
    return KeyLists(col_ptr, ((order // K) % Nq).to(INDEX_DTYPE), (order % K).to(INDEX_DTYPE))


#: the integers of :attr:`SelectionPlan.meta`, in order (how a plan crosses the custom op's boundary)
META_FIELDS = ("block_size", "seqlen_q", "seqlen_k", "num_selections", "layout_batch", "batched", "num_kv_blocks",
               "checked")

#: the attribute of a plan's ``rows`` tensor holding a weak reference to the plan (how the custom op
#: finds the plan object, with its key lists, from the tensor it receives)
PLAN_ATTR = "_sparse_io_attn_plan"


class SelectionPlan:
    """One selection planned for ``seqlen = (Nq, Nk)`` and a causal offset (``None`` or the ``delta``
    of ``s <= t + delta``): the normalised rows now, the key-major lists on first use.

    Build it with :func:`plan_selection` (or let :func:`sparse_io_attn.selection_attention` build it);
    pass it to :func:`~sparse_io_attn.selection_attention` in place of the selection to reuse it
    across calls (layers sharing a selection, forward and backward). It belongs to the device of
    the selection it was built from.
    """

    def __init__(self, selection: Selection, seqlen_k: int, causal_offset: int | None, varlen: Varlen | None = None):
        if not isinstance(selection, Selection):
            raise TypeError(f"expected a Selection, got {type(selection).__name__}")
        self.selection = selection
        self.block_size = selection.block_size
        self.seqlen = (selection.seqlen_q, int(seqlen_k))
        self.num_selections = selection.num_selections
        self.layout_batch = selection.batch or 1
        self.batched = selection.batch is not None
        L = self.layout_batch * self.num_selections
        Nq, K = selection.seqlen_q, selection.max_blocks
        counts = None if selection.counts is None else selection.counts.reshape(L, Nq)
        indices = selection.indices.reshape(L, Nq, K)
        self.varlen_causal = None if varlen is None else varlen.causal
        if varlen is None:
            self.num_kv_blocks = math.ceil(self.seqlen[1] / self.block_size)
            self.causal_offset, self.table = causal_offset, None
        else:
            if self.layout_batch != 1:
                raise ValueError(f"with cu_seqlens the batch is one packed sequence: pass indices [G, total, K] or "
                                 f"[1, G, total, K], got batch {self.layout_batch}")
            self.num_kv_blocks = capacity(self.seqlen[1], self.block_size, varlen.num_sequences)
            self.causal_offset = None if varlen.causal is None else 0     # causal; the table holds each row's offset
            self.table = block_table(varlen, self.block_size, Nq, self.seqlen[1])
            indices, causal_offset = global_blocks(indices, varlen, self.block_size, self.seqlen[1]), None
        self.rows, self.row_counts = normalize_rows(indices, counts, self.num_kv_blocks, self.block_size, causal_offset)
        self.checked = True              # normalised here: every entry in range, rows ascending and unique
        self._keys: KeyLists | None = None
        self._derived: dict = {}

    @property
    def meta(self) -> tuple:
        """The plan's integers (:data:`META_FIELDS`): with :attr:`rows`, :attr:`row_counts` and the
        causal offset, what the custom op receives."""
        return (self.block_size, self.seqlen[0], self.seqlen[1], self.num_selections, self.layout_batch,
                int(self.batched), self.num_kv_blocks, int(self.checked))

    def register(self) -> "SelectionPlan":
        """Make this plan findable from its ``rows`` tensor (what the custom op receives)."""
        if not torch.compiler.is_compiling():
            setattr(self.rows, PLAN_ATTR, weakref.ref(self))
        return self

    @classmethod
    def from_op(cls, rows: torch.Tensor, row_counts: torch.Tensor, table: torch.Tensor | None, meta,
                causal_offset: int | None) -> "SelectionPlan":
        """The plan behind a custom op's arguments: the plan whose ``rows`` these are when it is still
        alive (its key lists kept), else a plan over them (validated once unless its meta says it was
        built by :class:`SelectionPlan`)."""
        ref = getattr(rows, PLAN_ATTR, None)
        hit = ref() if ref is not None else None
        if hit is not None and hit.rows is rows and hit.row_counts is row_counts and hit.table is table \
                and hit.meta[:-1] == tuple(meta)[:-1] and hit.causal_offset == causal_offset:
            return hit
        m = dict(zip(META_FIELDS, (int(x) for x in meta)))
        plan = cls.__new__(cls)
        plan.selection = None
        plan.block_size = m["block_size"]
        plan.seqlen = (m["seqlen_q"], m["seqlen_k"])
        plan.num_kv_blocks = m["num_kv_blocks"]
        plan.causal_offset, plan.table, plan.varlen_causal = causal_offset, table, None
        plan.num_selections, plan.layout_batch, plan.batched = m["num_selections"], m["layout_batch"], bool(m["batched"])
        plan.rows, plan.row_counts, plan.checked = rows, row_counts, bool(m["checked"])
        plan._keys = None
        plan._derived = {}
        L = plan.layout_batch * plan.num_selections
        if tuple(rows.shape[:2]) != (L, plan.seqlen[0]) or tuple(row_counts.shape) != (L, plan.seqlen[0]):
            raise ValueError(f"selection plan: rows {tuple(rows.shape)} and row_counts {tuple(row_counts.shape)} do not "
                             f"match {L} selections of {plan.seqlen[0]} query rows")
        grid = math.ceil(plan.seqlen[1] / plan.block_size)
        if (table is None and plan.num_kv_blocks != grid) or (table is not None and (
                table.dtype != INDEX_DTYPE or tuple(table.shape) != (2 * plan.num_kv_blocks + plan.seqlen[0],))):
            raise ValueError(f"selection plan: {plan.num_kv_blocks} key blocks need a block table int32 "
                             f"[2 * num_kv_blocks + Nq] (or none and {grid} blocks), got "
                             f"{None if table is None else (table.dtype, tuple(table.shape))}")
        if not plan.checked:
            plan.validate()
        return plan.register()

    def validate(self) -> "SelectionPlan":
        """Check normalised rows from outside (a direct op call): entries in ``[-1, num_kv_blocks)``,
        each row's first ``row_counts`` entries ascending and valid, ``-1`` after; a block table's
        blocks inside the keys, at most ``block_size`` each and contiguous (``ValueError``)."""
        if self.table is not None:
            n, Nk = self.num_kv_blocks, self.seqlen[1]
            start, end = self.table[:n].to(torch.int64), self.table[n:2 * n].to(torch.int64)
            ok = bool(((start >= 0) & (start <= end) & (end <= Nk) & (end - start <= self.block_size)).all())
            if not ok or not bool((start[1:] == end[:-1]).all()):
                raise ValueError(f"selection plan: the block table's blocks must lie in [0, {Nk}], hold at most "
                                 f"{self.block_size} keys and follow each other; a direct op call passed others")
        K = self.rows.shape[-1]
        r = self.rows.to(torch.int64)
        n = self.row_counts.to(torch.int64)
        used = torch.arange(K, device=r.device) < n[..., None]
        ok = bool(((n >= 0) & (n <= K)).all()) and bool(torch.where(used, (r >= 0) & (r < self.num_kv_blocks),
                                                                      r == -1).all())
        ok = ok and bool(((r[..., 1:] > r[..., :-1]) | ~used[..., 1:]).all())
        if not ok:
            raise ValueError(f"selection plan rows must hold, per row, row_counts ascending key blocks in "
                             f"[0, {self.num_kv_blocks}) then -1; a direct op call passed other values")
        self.checked = True
        return self

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def num_layouts(self) -> int:
        """``L = layout_batch * G``: the selections stored."""
        return self.rows.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.rows.shape[-1]

    # ------------------------------------------------------------------- the blocks' keys
    def key_start(self, blocks: torch.Tensor) -> torch.Tensor:
        """int64: the first key of each block in ``blocks`` (block numbers ``>= 0``)."""
        if self.table is None:
            return blocks.to(torch.int64) * self.block_size
        return self.table.to(torch.int64)[blocks]

    def key_count(self, blocks: torch.Tensor) -> torch.Tensor:
        """int64: the keys of each block in ``blocks`` (the last block of a sequence may be ragged)."""
        if self.table is None:
            return (self.seqlen[1] - blocks.to(torch.int64) * self.block_size).clamp(max=self.block_size)
        n = self.num_kv_blocks
        t = self.table.to(torch.int64)
        return t[n:2 * n][blocks] - t[:n][blocks]

    def causal_limit(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64: the last key each query token may use under causality (``t + delta``, or per row)."""
        if self.table is None:
            return tokens.to(torch.int64) + self.causal_offset
        return tokens.to(torch.int64) + self.table.to(torch.int64)[2 * self.num_kv_blocks:][tokens]

    @property
    def varlen(self) -> bool:
        """Whether the plan is of packed sequences (a block table)."""
        return self.table is not None

    def keys(self, build=None) -> KeyLists:
        """The key-major lists (built on first use, then kept): :func:`key_lists`, or ``build(plan)`` (a
        backend's device builder of the same lists, e.g. the Triton backend's on CUDA)."""
        if self._keys is None:
            self._keys = key_lists(self.rows, self.num_kv_blocks) if build is None else build(self)
        return self._keys

    def check_heads(self, batch: int, num_heads_q: int, num_heads_kv: int) -> None:
        """Refuse inputs whose batch and heads the plan's selections cannot serve (:meth:`head_map`)."""
        self.head_map(batch, num_heads_q, num_heads_kv)

    def derived(self, key, build):
        """What a backend derives from this plan (the Triton families' work lists, :mod:`.worklists`),
        built by ``build()`` on first use under ``key`` and kept with the plan."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def head_map(self, batch: int, num_heads_q: int, num_heads_kv: int) -> HeadMap:
        """How a call's ``[batch, heads]`` index this plan; ``ValueError`` when they do not fit."""
        G = self.num_selections
        if self.batched and self.layout_batch != batch:
            raise ValueError(f"the selection was made for batch {self.layout_batch} but the inputs have batch "
                             f"{batch}; pass indices [{batch}, G, Nq, K] or [G, Nq, K] (shared by the batch)")
        if num_heads_q % G:
            raise ValueError(f"the selection has G = {G} selections but q has {num_heads_q} heads; G must "
                             f"divide num_heads_q (1: shared, num_heads_kv: per GQA group, num_heads_q: per head)")
        if num_heads_kv % G and G % num_heads_kv:
            raise ValueError(f"the selection has G = {G} selections and k/v {num_heads_kv} heads: each selection "
                             f"must serve whole GQA groups or part of one (G divides num_heads_kv or "
                             f"num_heads_kv divides G); use G in (1, {num_heads_kv}, {num_heads_q})")
        return HeadMap(G if self.batched else 0, num_heads_q // G)

    def __repr__(self) -> str:
        return (f"SelectionPlan(G={self.num_selections}, seqlen={self.seqlen}, block_size={self.block_size}, "
                f"K={self.max_blocks}, causal_offset={self.causal_offset}, layout_batch={self.layout_batch})")


def plan_selection(selection: Selection, seqlen_k: int, *, causal_offset: int | None = None,
                   varlen: Varlen | None = None) -> SelectionPlan:
    """Plan ``selection`` against ``seqlen_k`` keys (see :class:`SelectionPlan`); ``varlen``: packed
    sequences (:func:`~sparse_io_attn.selection.varlen.varlen_of`), local block numbers."""
    return SelectionPlan(selection, seqlen_k, causal_offset, varlen)


__all__ = ["HeadMap", "KeyLists", "SelectionPlan", "key_lists", "normalize_rows", "plan_selection"]
