"""`ContextParallelPlan`: which rank owns which query-block rows (and the K/V blocks of the same
tokens), and which K/V blocks every rank pair exchanges.

A plan has two lifetimes:

* **per sequence length** (this object): the ownership, which query rows and K/V tokens each rank
  holds (``owner``, ``rows``, ``shard``/``unshard``). :meth:`ContextParallelPlan.for_sequence` builds
  only this (contiguous, zig-zag or balanced ranges), for selections that change every step;
  ``ContextParallelPlan(layout, world_size)`` also balances the ranks by a layout known in advance
  and fixes its send sets (the **static** plan).
* **per step**: :meth:`ContextParallelPlan.step` turns one step's layout or per-token selection into
  a :class:`~sparse_io_attn.distributed.step.ContextParallelStep` (which K/V blocks this rank needs
  from which rank, its local and received parts' plans), on the device with tensor operations.

Units are blocks (``BLOCK_SIZE_Q == BLOCK_SIZE_KV``, self-attention ``seqlen_q == seqlen_k``): block
``b`` holds tokens ``[b * BLOCK, min((b + 1) * BLOCK, seqlen))`` of q, k and v alike, and rank ``r``
owns q rows *and* k/v blocks of the same tokens. A static plan is computed from the layout's kept
blocks as runs of consecutive key blocks per row (one pass over the kept blocks, then O(runs +
world_size * blocks) per candidate assignment), never the element mask or the block grid.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from typing import NamedTuple, Sequence

import torch

from sparse_io_attn.distributed import step as _step
from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._assemble import inrange_words
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout, assemble

#: cost of a kept block in the balance: full blocks 4, partial blocks 5 (the element mask is read and
#: applied on every tile: about a quarter more than a full block)
FULL_WORK, PARTIAL_WORK = 4, 5
#: the assignments ``balance="work"`` chooses among, in no particular order
STRATEGIES = ("contiguous", "zigzag", "lpt")
#: a row is spread (computed where its keys live) when its work exceeds this fraction of a rank's mean
SPREAD_FRACTION = 0.5
BALANCES = ("work",) + STRATEGIES
#: the ownerships :meth:`ContextParallelPlan.for_sequence` builds
SEQUENCE_BALANCES = ("contiguous", "zigzag", "balanced")


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


class Exchange(NamedTuple):
    """What one rank's ``all_to_all_single`` moves, in tokens. ``send_index[dst]``: positions in the
    rank's shard of the tokens it sends ``dst`` (blocks ascending); ``send_splits``/``recv_splits``:
    tokens sent to / received from each rank; ``recv_order``: row of the receive buffer (grouped by
    source rank) holding each received token in ascending global order; ``recv_inverse`` its inverse.
    The ``q_`` fields describe the query tokens of spread rows the same way."""
    send_index: tuple
    send_splits: list
    recv_splits: list
    recv_order: torch.Tensor
    recv_inverse: torch.Tensor
    q_send_index: tuple
    q_send_splits: list
    q_recv_splits: list
    q_recv_order: torch.Tensor
    q_recv_inverse: torch.Tensor


class ContextParallelPlan:
    """Context parallelism: query-block rows (and the K/V blocks of the same tokens) assigned to
    ranks, for a sequence length (:meth:`for_sequence`) or for a block-sparse layout known in
    advance (this constructor: the **static** plan, balanced by the layout's kept work, with the
    K/V blocks each rank pair exchanges).

    Args:
        layout: a :class:`~sparse_io_attn.BlockSparseLayout` with ``BLOCK_SIZE_Q == BLOCK_SIZE_KV``
            and ``seqlen_q == seqlen_k``, shared or per (batch, head).
        world_size: number of ranks; the layout needs at least that many block rows.
        causal: intersect the layout with the causal mask (``True``, ``"top_left"`` and
            ``"bottom_right"`` coincide for ``seqlen_q == seqlen_k``). Part of the plan because it
            decides which blocks are read, so which are sent; :func:`context_parallel_attention`
            takes the same value.
        balance: ``"work"`` (default): among the strategies below, the one moving the fewest K/V
            and query tokens whose imbalance is at most ``tolerance`` (the most balanced if none
            is); ``"contiguous"``: one contiguous range of blocks per rank, cut at the least
            possible maximum work; ``"zigzag"``: ``2 * world_size`` equal chunks, rank ``r`` holding
            chunks ``r`` and ``2 * world_size - 1 - r`` (balances causal work; needs ``2 *
            world_size`` blocks); ``"lpt"``: blocks by decreasing work, each to the least loaded
            rank (longest processing time first).
        tolerance: the imbalance ``"work"`` accepts (max / mean work).
        split_rows: spread the rows heavier than :data:`SPREAD_FRACTION` of a rank's mean work
            (BigBird's and Longformer's global query rows, which read every key): such a row's
            blocks are computed by the ranks owning their keys, which receive the row's queries and
            send back partial results, instead of its owner receiving every K/V block. Without it,
            the imbalance is at least the heaviest row's work over the mean.

    A kept block costs :data:`FULL_WORK` if full and :data:`PARTIAL_WORK` if partial, summed over
    the layout's batch/head masks; a spread row's blocks count for the owners of their keys
    (``block_work``). Rank ``r`` owns the blocks :meth:`rows` ``(r)`` (ascending);
    its shard of q, k, v (:meth:`shard`) is their tokens in that order, so the last, ragged block
    (if it owns it) comes last.

    The plan keeps its own copy of the layout: every view it gives (rank layouts, send lists) is of
    the layout as it was at build. A layout edited in place afterwards (a refilled selection buffer)
    is detected by :meth:`check_source` (its tensors' version counters, then its contents), which
    :func:`~sparse_io_attn.distributed.context_parallel_attention` calls on every rank: rebuild the
    plan from the edited layout, or use :meth:`for_sequence` and :meth:`step` for a selection that
    changes every step.

    ``digest`` (a 63-bit int) fingerprints everything the ranks must share: the source layout's
    contents (``layout_digest``; 0 for a plan of a sequence length), causality, block size, sequence
    length, world size and the assignment (``owner``, ``spread``: so also ``balance``,
    ``tolerance``, ``split_rows``); ranks compare it before any exchange.

    Attributes: ``layout`` (the layout the ranks compute, causal already applied; ``None`` for a
    plan of a sequence length), ``world_size``, ``block_size``, ``seqlen``, ``num_blocks``,
    ``causal``, ``strategy``, ``owner`` (int64 ``[num_blocks]``: the rank of each block), ``spread``
    (bool ``[num_blocks]``: spread rows), ``row_work`` (int64 ``[num_blocks]``: work of each
    query-block row), ``block_work`` (what the balance assigns with each block), ``work`` (int64
    ``[world_size]``), ``imbalance``.
    """

    def __init__(self, layout: BlockSparseLayout, world_size: int, *, causal=False, balance: str = "work",
                 tolerance: float = 1.05, split_rows: bool = True):
        if not isinstance(layout, BlockSparseLayout):
            raise TypeError(f"layout must be a BlockSparseLayout, got {type(layout).__name__}; for a selection "
                            f"that changes every step use ContextParallelPlan.for_sequence(...).step(selection)")
        world_size = _world(world_size)
        bq, bk = layout.block_size
        if bq != bk:
            raise ValueError(f"context parallelism works in blocks of the same tokens for q and k/v: "
                             f"BLOCK_SIZE_Q must equal BLOCK_SIZE_KV, got {layout.block_size}; build "
                             f"the layout with one block size")
        if layout.seqlen_q != layout.seqlen_k:
            raise ValueError(f"context parallelism shards self-attention: seqlen_q must equal seqlen_k, "
                             f"got {layout.seqlen}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        if not (isinstance(tolerance, (int, float)) and tolerance >= 1):
            raise ValueError(f"tolerance is a max/mean work ratio, at least 1; got {tolerance!r}")
        self._sequence(layout.seqlen_q, bq, world_size, causal)
        W, R = world_size, self.num_blocks
        self.source_layout = layout
        self._source_version = layout.version_key()
        self.layout_digest = layout_digest(layout)
        self.layout = causal_layout(layout.to("cpu")) if self.causal else _copy(layout.to("cpu"))
        count, partial = _row_costs(self.layout)
        self.row_work = FULL_WORK * count + (PARTIAL_WORK - FULL_WORK) * partial
        self.spread = torch.zeros(R, dtype=torch.bool)
        if split_rows and W > 1:
            self.spread = self.row_work * W > SPREAD_FRACTION * int(self.row_work.sum())
        spread_rows = self.spread.nonzero().squeeze(1)
        self.block_work = torch.where(self.spread, 0, self.row_work)
        if spread_rows.numel():                                          # their blocks count where the keys live
            _, c, pid = _row_entries(self.layout, spread_rows)
            self.block_work.index_add_(0, c, torch.where(pid >= 0, PARTIAL_WORK, FULL_WORK).to(torch.int64))
        runs = _kept_runs(self.layout)
        on_spread = self.spread[runs.row]
        kv_runs = _Runs(runs.row[~on_spread], runs.c0[~on_spread], runs.c1[~on_spread])   # K/V to the row's owner
        q_runs = _Runs(runs.row[on_spread], runs.c0[on_spread], runs.c1[on_spread])       # q to the keys' owners
        names = STRATEGIES if balance == "work" else (balance,)
        candidates = []
        for name in names:
            owner = _ASSIGN[name](self.block_work, W)
            if owner is None:
                continue
            work = torch.zeros(W, dtype=torch.int64).index_add_(0, owner, self.block_work)
            reads = (_coverage(owner[kv_runs.row], kv_runs.c0, kv_runs.c1, W, R) & _not_own(owner, W),
                     _owner_coverage(q_runs, owner, W, R) & _not_own(owner, W))
            moved = sum(int((read.to(torch.int64) * self.block_sizes).sum()) for read in reads)
            candidates.append((_imbalance(work), moved, name, owner, work, reads))
        if not candidates:
            raise ValueError(f"balance='zigzag' needs at least 2 * world_size = {2 * W} blocks, the "
                             f"layout has {R}; use balance='work' or a smaller block size")
        within = [cand for cand in candidates if cand[0] <= tolerance]
        best = (min(within, key=lambda cand: (cand[1], cand[0])) if within
                else min(candidates, key=lambda cand: (cand[0], cand[1])))
        self.imbalance, _, self.strategy, owner, self.work, (kv_read, q_read) = best
        self._own(owner)
        self._send_cols, self._send_offsets = _pair_csr(*_pairs(kv_read, owner), W)
        self._q_cols, self._q_offsets = _pair_csr(*_pairs(q_read, owner), W)
        self._finish_digest()

    @classmethod
    def for_sequence(cls, seqlen: int, block_size: int, world_size: int, *, causal,
                     balance: str = "zigzag", row_work: torch.Tensor | None = None) -> "ContextParallelPlan":
        """The plan of a sequence length: which query rows and K/V tokens each rank owns, fixed for
        every step; each step's selection becomes a :meth:`step`.

        Args:
            seqlen: tokens of the sequence (self-attention: queries and keys alike).
            block_size: tokens per block, the unit of ownership; a step's layout has this block size,
                a per-token selection's key blocks divide it.
            world_size: ranks; the sequence needs at least that many blocks.
            causal: whether the attention is causal (``True``, ``"top_left"`` or ``"bottom_right"``:
                they coincide for self-attention); :func:`context_parallel_attention` takes the same.
            balance: ``"zigzag"`` (default; ``2 * world_size`` equal chunks, rank ``r`` holding
                chunks ``r`` and ``2 * world_size - 1 - r``: causal rows' work balanced whatever the
                selection, needs ``2 * world_size`` blocks), ``"contiguous"`` (equal contiguous
                ranges: the fewest rank boundaries, balanced when each row reads about as many
                blocks, e.g. top-k selections) or ``"balanced"`` (contiguous ranges cut at the least
                maximum of ``row_work``).
            row_work: int ``[num_blocks]``, the expected work of each query-block row for
                ``"balanced"`` (default: ``row + 1`` when causal, 1 otherwise: dense causal work).

        ``digest`` covers the sequence length, block size, world size, causality and the ownership
        (``layout_digest`` is 0: there is no layout); ``layout`` is ``None`` and the static views
        (:meth:`send_blocks`, :meth:`rank_layouts`, :meth:`exchange`) refuse.
        """
        if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
            raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size!r}")
        world_size = _world(world_size)
        if balance not in SEQUENCE_BALANCES:
            raise ValueError(f"balance must be one of {SEQUENCE_BALANCES} for a plan of a sequence length, got "
                             f"{balance!r}")
        plan = cls.__new__(cls)
        plan._sequence(seqlen, block_size, world_size, causal)
        R, W = plan.num_blocks, world_size
        if row_work is not None:
            if balance != "balanced":
                raise ValueError(f"row_work weighs the rows of balance='balanced'; balance={balance!r} ignores it")
            if not isinstance(row_work, torch.Tensor) or row_work.dtype.is_floating_point \
                    or row_work.dtype == torch.bool or tuple(row_work.shape) != (R,) or bool((row_work < 0).any()):
                got = tuple(row_work.shape) if isinstance(row_work, torch.Tensor) else type(row_work).__name__
                raise ValueError(f"row_work must be a non-negative int tensor of shape [{R}] (one weight per "
                                 f"query-block row), got {got}")
            weights = row_work.detach().cpu().to(torch.int64)
        else:
            weights = torch.arange(1, R + 1) if plan.causal else torch.ones(R, dtype=torch.int64)
        if balance == "zigzag":
            owner = _zigzag(weights, W)
            if owner is None:
                raise ValueError(f"balance='zigzag' needs at least 2 * world_size = {2 * W} blocks, the sequence "
                                 f"has {R}; use balance='contiguous' or a smaller block size")
        elif balance == "contiguous":
            owner = torch.arange(R) * W // R
        else:
            owner = _contiguous(weights, W)
        plan.source_layout = plan.layout = None
        plan._source_version = None
        plan.layout_digest = 0
        plan.strategy = balance
        plan.row_work = plan.block_work = weights
        plan.spread = torch.zeros(R, dtype=torch.bool)
        plan.work = torch.zeros(W, dtype=torch.int64).index_add_(0, owner, weights)
        plan.imbalance = _imbalance(plan.work)
        plan._own(owner)
        empty = torch.zeros(W * W + 1, dtype=torch.int64)
        plan._send_cols = plan._q_cols = torch.zeros(0, dtype=torch.int64)
        plan._send_offsets = plan._q_offsets = empty
        plan._finish_digest()
        return plan

    # ------------------------------------------------------------------ ownership (both lifetimes)
    def _sequence(self, seqlen: int, block: int, world_size: int, causal) -> None:
        R = math.ceil(seqlen / block)
        if R < world_size:
            raise ValueError(f"the sequence has {R} block rows for {world_size} ranks; every rank needs "
                             f"at least one: use a smaller block size or fewer ranks")
        self.world_size = world_size
        self.block_size = block
        self.seqlen = seqlen
        self.num_blocks = R
        self.causal = causal_offset(causal, seqlen, seqlen) is not None
        self.block_sizes = torch.full((R,), block, dtype=torch.int64)      # real tokens per block
        self.block_sizes[-1] = seqlen - (R - 1) * block

    def _own(self, owner: torch.Tensor) -> None:
        """Everything that follows from ``owner`` alone: each rank's blocks, shard positions, tokens."""
        W, R = self.world_size, self.num_blocks
        self.owner = owner
        order = torch.argsort(owner * R + torch.arange(R), stable=True)   # blocks by (rank, index)
        counts = torch.bincount(owner, minlength=W)
        self._row_offsets = torch.zeros(W + 1, dtype=torch.int64)
        self._row_offsets[1:] = torch.cumsum(counts, 0)
        self._rows_sorted = order
        self.local_index = torch.empty(R, dtype=torch.int64)             # position among its owner's blocks
        self.local_index[order] = torch.arange(R) - self._row_offsets[owner[order]]
        sizes = self.block_sizes[order]
        starts = torch.cumsum(sizes, 0) - sizes                         # token start in rank-major order
        self._local_start = torch.empty(R, dtype=torch.int64)            # token start inside its shard
        self._local_start[order] = starts - starts[self._row_offsets[:-1]][owner[order]]
        tok = torch.zeros(W + 1, dtype=torch.int64)
        tok[1:] = torch.cumsum(torch.zeros(W, dtype=torch.int64).index_add_(0, owner, self.block_sizes), 0)
        self._token_offsets = tok
        self._shard_tokens = (tok[1:] - tok[:-1]).tolist()                # host ints: asked every step
        self._rank_layouts: dict[int, RankLayouts] = {}
        self._token_index: dict[int, torch.Tensor] = {}
        self._exchange: dict[int, Exchange] = {}
        self._on_device: dict[str, dict] = {}

    def _finish_digest(self) -> None:
        self.assignment_digest = _digest(self.owner, self.spread)
        self.digest = _digest(torch.tensor([self.layout_digest, self.assignment_digest, int(self.causal),
                                            self.block_size, self.seqlen, self.world_size]))

    def device_tensors(self, device) -> dict:
        """``owner``, ``local_index``, ``local_start`` and ``block_sizes`` on ``device`` (kept): what a
        :meth:`step` built there indexes with."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = {name: t.to(device) for name, t in (
                ("owner", self.owner), ("local_index", self.local_index), ("local_start", self._local_start),
                ("block_sizes", self.block_sizes))}
        return self._on_device[key]

    @property
    def is_static(self) -> bool:
        """Whether the plan was built from a layout (its send sets fixed); ``False`` for
        :meth:`for_sequence`, whose exchanges come from each :meth:`step`."""
        return self.layout is not None

    def step(self, selection, *, rank: int | None = None, num_heads_kv: int | None = None):
        """This step's part of the plan on rank ``rank``: a
        :class:`~sparse_io_attn.distributed.step.ContextParallelStep` for
        :func:`~sparse_io_attn.distributed.context_parallel_attention`.

        ``selection``: a :class:`~sparse_io_attn.BlockSparseLayout` of the whole sequence (``seqlen
        = (seqlen, seqlen)``, block size ``block_size``) or a per-token
        :class:`~sparse_io_attn.layout.selection.Selection` whose key blocks divide ``block_size``,
        with one row per token of the sequence (token order) or per token of this rank's shard
        (shard order). Only the rank's own rows are read. ``rank``: default the caller's rank in the
        default process group (0 without ``torch.distributed``). ``num_heads_kv``: the K/V heads of
        the call, needed when the selection holds more groups than there are K/V heads (one per
        query head): the blocks a K/V head sends are then the union over its query heads.

        Built on the selection's device with tensor operations; one read of a small count tensor
        (what the exchange's buffers are sized by) is its one host synchronisation (a layout without
        fixed capacity, i.e. not from ``topk``/``from_kv_indices``, adds one: its longest row).
        Selection entries out of range count as empty slots (as ``selection_attention(check=False)``)."""
        return _step.build(self, selection, rank=rank, num_heads_kv=num_heads_kv)

    def _check_rank(self, rank: int, what: str = "rank") -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def _require_layout(self, what: str) -> None:
        if self.layout is None:
            raise ValueError(f"{what} belongs to a plan built from a layout; this plan of a sequence length "
                             f"(ContextParallelPlan.for_sequence) moves what each step selects: use "
                             f"plan.step(selection)")

    def check_source(self) -> "ContextParallelPlan":
        """Raise ``ValueError`` if the layout the plan was built from (``source_layout``) was edited
        in place since: its tensors' version counters moved and its contents (``layout_digest``)
        differ. Counters that moved over unchanged contents (a buffer refilled with the same
        selection) are accepted and recorded. Returns the plan (a plan of a sequence length has no
        layout: nothing to check)."""
        layout = self.source_layout
        if layout is None:
            return self
        version = layout.version_key()
        if version is None or version == self._source_version:
            return self
        if layout_digest(layout) != self.layout_digest:
            raise ValueError(f"the layout {layout.name!r} was edited in place after ContextParallelPlan was "
                             f"built from it (its contents changed; the plan's send lists and rank layouts "
                             f"are of the old contents); rebuild the plan: ContextParallelPlan(layout, "
                             f"{self.world_size}, causal={self.causal}) on every rank, or use "
                             f"ContextParallelPlan.for_sequence(...).step(layout) for a layout chosen every step")
        self._source_version = version
        return self

    # ------------------------------------------------------------------ public views
    def rows(self, rank: int) -> torch.Tensor:
        """The query blocks (and K/V blocks) rank ``rank`` owns, ascending, int64."""
        self._check_rank(rank)
        return self._rows_sorted[self._row_offsets[rank]:self._row_offsets[rank + 1]]

    def num_tokens(self, rank: int) -> int:
        """Tokens of the shard of rank ``rank`` (``n_local``)."""
        self._check_rank(rank)
        return self._shard_tokens[rank]

    def tokens(self, blocks: torch.Tensor) -> int:
        """Real tokens in ``blocks`` (the last block of the sequence may be ragged)."""
        return int(self.block_sizes[blocks].sum())

    def send_blocks(self, src: int, dst: int) -> torch.Tensor:
        """K/V blocks ``src`` sends ``dst``: blocks ``src`` owns that some row of ``dst`` (not a spread
        row) reads in any of the layout's batch/head masks; sorted, int64 (empty for ``src == dst``;
        a static plan only)."""
        self._require_layout("send_blocks")
        self._check_rank(src, "src")
        self._check_rank(dst, "dst")
        p = src * self.world_size + dst
        return self._send_cols[self._send_offsets[p]:self._send_offsets[p + 1]]

    def recv_blocks(self, dst: int) -> torch.Tensor:
        """Every block ``dst`` receives (the union of :meth:`send_blocks` ``(src, dst)``), ascending."""
        return torch.sort(torch.cat([self.send_blocks(s, dst) for s in range(self.world_size)])).values

    def send_queries(self, src: int, dst: int) -> torch.Tensor:
        """Spread query blocks ``src`` owns whose row reads some K/V block ``dst`` owns: ``src`` sends
        ``dst`` their queries, ``dst`` sends back its partial results; sorted, int64."""
        self._require_layout("send_queries")
        self._check_rank(src, "src")
        self._check_rank(dst, "dst")
        p = src * self.world_size + dst
        return self._q_cols[self._q_offsets[p]:self._q_offsets[p + 1]]

    def recv_queries(self, dst: int) -> torch.Tensor:
        """Every spread query block ``dst`` computes a part of for another rank, ascending."""
        return torch.sort(torch.cat([self.send_queries(s, dst) for s in range(self.world_size)])).values

    def token_index(self, rank: int) -> torch.Tensor:
        """Global token positions of the shard of ``rank``, in shard order (int64 ``[n_local]``)."""
        self._check_rank(rank)
        if rank not in self._token_index:
            self._token_index[rank] = _block_tokens(self.rows(rank), self.block_size, self.seqlen)
        return self._token_index[rank]

    def local_positions(self, blocks: torch.Tensor) -> torch.Tensor:
        """Positions inside their owner's shard of the tokens of ``blocks`` (all of one owner), int64."""
        starts = self._local_start[blocks]
        sizes = self.block_sizes[blocks]
        return _ranges(starts, sizes)

    def shard(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """The tokens of rank ``rank`` along ``dim`` of ``x`` (``x.shape[dim] == seqlen``), in shard
        order: a view when they are one contiguous range, else a copy."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = _dim(x, dim)
        if x.shape[dim] != self.seqlen:
            raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim} but the plan shards "
                             f"{self.seqlen}; pass the whole sequence")
        blocks = self.rows(rank)
        if bool((blocks[1:] - blocks[:-1] == 1).all()):
            start = int(blocks[0]) * self.block_size
            return x.narrow(dim, start, self.num_tokens(rank))
        return x.index_select(dim, self.token_index(rank).to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`shard`: the shards of every rank (in rank order) back in token order
        along ``dim`` (differentiable)."""
        if not isinstance(shards, (list, tuple)) or len(shards) != self.world_size:
            got = len(shards) if isinstance(shards, (list, tuple)) else type(shards).__name__
            raise ValueError(f"unshard needs a list of {self.world_size} shards (one per rank), got {got}")
        for r, s in enumerate(shards):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"unshard takes one tensor per rank (what context_parallel_attention or "
                                f"plan.shard returned), got {type(s).__name__} for shard {r}")
        dim = _dim(shards[0], dim)
        for r, s in enumerate(shards):
            if s.shape[dim] != self.num_tokens(r):
                raise ValueError(f"shard {r} has {s.shape[dim]} tokens along dim {dim}; the plan gives "
                                 f"rank {r} {self.num_tokens(r)}")
        whole = torch.cat(list(shards), dim)
        perm = torch.cat([self.token_index(r) for r in range(self.world_size)])
        if torch.equal(perm, torch.arange(self.seqlen)):
            return whole
        return whole.index_select(dim, torch.argsort(perm).to(whole.device))

    def rank_layouts(self, rank: int) -> RankLayouts:
        """The layouts rank ``rank`` computes (:class:`RankLayouts`), element-exact, cached (a static
        plan only)."""
        self._require_layout("rank_layouts")
        self._check_rank(rank)
        if rank not in self._rank_layouts:
            self._rank_layouts[rank] = self._build_rank_layouts(rank)
        return self._rank_layouts[rank]

    def _build_rank_layouts(self, rank: int) -> RankLayouts:
        lo = self.layout
        lid, r, c = lo.entries()
        row_mine, col_mine = self.owner[r] == rank, self.owner[c] == rank
        mine = row_mine | col_mine
        lid, r, c, ids = lid[mine], r[mine], c[mine], lo.partial_ids[mine].to(torch.int64)
        row_mine, col_mine, spread = row_mine[mine], col_mine[mine], self.spread[r]
        recv, foreign = self.recv_blocks(rank), self.recv_queries(rank)
        n_local = self.num_tokens(rank)
        parts = []
        for sel, rows, cols, n_q, n_k, what in (
                (row_mine & col_mine, self.local_index[r], self.local_index[c], n_local, n_local, "local"),
                (row_mine & ~col_mine & ~spread, self.local_index[r], torch.searchsorted(recv, c), n_local,
                 self.tokens(recv), "received"),
                (~row_mine & col_mine & spread, torch.searchsorted(foreign, r), self.local_index[c],
                 self.tokens(foreign), n_local, "foreign")):
            if n_q == 0 or n_k == 0:
                parts.append(None)
                continue
            part = ids[sel] >= 0
            parts.append(assemble(lid[sel], rows[sel], cols[sel], lo.partial_masks[ids[sel][part]],
                                  partial=part, block_size=lo.block_size, seqlen=(n_q, n_k),
                                  layout_batch=lo.layout_batch, layout_heads=lo.layout_heads,
                                  name=f"{lo.name}@rank{rank}.{what}"))
        return RankLayouts(*parts)

    @property
    def exchanges(self) -> bool:
        """Whether any rank sends any K/V or query block (else the attention runs no collective)."""
        return self._send_cols.numel() > 0 or self.spreads

    @property
    def spreads(self) -> bool:
        """Whether any spread row has blocks on another rank (then partial results travel back)."""
        return self._q_cols.numel() > 0

    def exchange(self, rank: int) -> Exchange:
        """The token-level description of rank ``rank``'s exchange (:class:`Exchange`), cached (a
        static plan only)."""
        self._require_layout("exchange")
        self._check_rank(rank)
        if rank not in self._exchange:
            self._exchange[rank] = Exchange(*self._tokens_moved(rank, self.send_blocks),
                                            *self._tokens_moved(rank, self.send_queries))
        return self._exchange[rank]

    def _tokens_moved(self, rank: int, sends) -> tuple:
        W = self.world_size
        send = tuple(self.local_positions(sends(rank, dst)) for dst in range(W))
        incoming = [sends(src, rank) for src in range(W)]
        blocks = torch.cat(incoming)
        sizes = self.block_sizes[blocks]
        starts = torch.cumsum(sizes, 0) - sizes                          # buffer row of each block
        order = torch.argsort(blocks)
        recv_order = _ranges(starts[order], sizes[order])
        return send, [int(t.numel()) for t in send], [self.tokens(b) for b in incoming], recv_order, \
            torch.argsort(recv_order)

    def __repr__(self) -> str:
        what = f"layout={self.source_layout.name!r}, " if self.source_layout is not None else ""
        return (f"ContextParallelPlan({what}seqlen={self.seqlen}, block={self.block_size}, "
                f"world_size={self.world_size}, causal={self.causal}, strategy={self.strategy!r}, "
                f"imbalance={self.imbalance:.4f})")


# ---------------------------------------------------------------------------------------- helpers
def _world(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


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


def _dim(x: torch.Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d tensor, got {dim!r}")
    return dim % x.dim()


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + size)`` for each pair, int64."""
    total = int(sizes.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    return torch.arange(total) - torch.repeat_interleave(offsets - starts, sizes)


def _block_tokens(blocks: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    starts = blocks * block
    return _ranges(starts, torch.clamp(seqlen - starts, max=block))


class _Runs(NamedTuple):
    """Maximal runs of consecutive kept key blocks ``c0 .. c1`` (inclusive) in query-block row
    ``row`` of some mask (int64 ``[n]`` each)."""
    row: torch.Tensor
    c0: torch.Tensor
    c1: torch.Tensor


def _kept_runs(layout: BlockSparseLayout) -> _Runs:
    """The kept blocks as runs: a sliding window or a causal row is one run, a random selection about
    one per block. One pass over the kept blocks (a break where the column does not follow the one
    before, or a row starts), then O(runs)."""
    crow = layout.crow_indices.to(torch.int64)
    R = layout.num_q_blocks
    col = layout.col_indices
    nnz = col.numel()
    if nnz == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return _Runs(empty, empty, empty)
    brk = torch.empty(nnz, dtype=torch.bool)
    brk[0] = True
    torch.ne(col[1:], col[:-1] + 1, out=brk[1:])
    starts = crow[:, :-1].reshape(-1)
    brk[starts[starts < nnz]] = True
    s = brk.nonzero().squeeze(1)
    e = torch.cat([s[1:], s.new_tensor([nnz])]) - 1
    flat = torch.searchsorted(crow[:, 1:].reshape(-1).contiguous(), s, right=True)
    return _Runs(flat % R, col[s].to(torch.int64), col[e].to(torch.int64))


def _row_costs(layout: BlockSparseLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept blocks and partial kept blocks per query-block row, summed over the masks (int64 ``[R]``)."""
    crow = layout.crow_indices.to(torch.int64)
    R = layout.num_q_blocks
    count = (crow[:, 1:] - crow[:, :-1]).sum(0)
    part = (layout.partial_ids >= 0).nonzero().squeeze(1)
    flat = torch.searchsorted(crow[:, 1:].reshape(-1).contiguous(), part, right=True)
    return count, torch.bincount(flat % R, minlength=R)


def _row_entries(layout: BlockSparseLayout, rows: torch.Tensor):
    """``(row, col, partial id)`` (int64) of the kept blocks of query-block ``rows`` in every mask."""
    crow = layout.crow_indices.to(torch.int64)
    starts, ends = crow[:, rows].reshape(-1), crow[:, rows + 1].reshape(-1)
    pos = _ranges(starts, ends - starts)
    r = torch.repeat_interleave(rows.repeat(crow.shape[0]), ends - starts)
    return r, layout.col_indices[pos].to(torch.int64), layout.partial_ids[pos].to(torch.int64)


def _coverage(dst: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, W: int, R: int) -> torch.Tensor:
    """bool ``[W, R]``: rank ``w`` reads block ``c`` iff some run of a row it owns (``dst``) covers
    ``c``; one difference array per rank, O(runs + W R)."""
    diff = torch.zeros(W * (R + 1), dtype=torch.int32)
    ones = torch.ones(dst.numel(), dtype=torch.int32)
    diff.index_add_(0, dst * (R + 1) + c0, ones)
    diff.index_add_(0, dst * (R + 1) + c1 + 1, -ones)
    return torch.cumsum(diff.view(W, R + 1), 1)[:, :R] > 0


def _owner_coverage(runs: _Runs, owner: torch.Tensor, W: int, R: int) -> torch.Tensor:
    """bool ``[W, R]``: rank ``w`` computes a part of spread row ``r`` iff it owns a key block some
    run of row ``r`` covers (per-rank prefix counts of owned blocks: O(W (runs + R)))."""
    out = torch.zeros(W, R, dtype=torch.int32)
    if runs.row.numel():
        owned = torch.zeros(W, R + 1, dtype=torch.int64)
        owned[owner, torch.arange(R) + 1] = 1
        owned = torch.cumsum(owned, 1)
        hit = (owned[:, runs.c1 + 1] - owned[:, runs.c0]) > 0                 # [W, runs]
        out.index_add_(1, runs.row, hit.to(torch.int32))
    return out > 0


def _not_own(owner: torch.Tensor, W: int) -> torch.Tensor:
    """bool ``[W, R]``: block ``c`` is not rank ``w``'s own."""
    return owner[None, :] != torch.arange(W)[:, None]


def _pairs(read: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src * W + dst, block)`` of every flagged ``read[dst, block]`` (``src`` its owner), sorted by
    ``(src, dst, block)``."""
    W, R = read.shape
    dst, col = read.nonzero(as_tuple=True)
    key, _ = torch.sort((owner[col] * W + dst) * R + col)
    return key // R, key % R


def _pair_csr(pair: torch.Tensor, col: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(col, offsets [W * W + 1])``: the blocks of pair ``src * W + dst`` at ``col[offsets[p]:offsets[p + 1]]``."""
    offsets = torch.zeros(W * W + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(pair, minlength=W * W), 0)
    return col, offsets


def _imbalance(work: torch.Tensor) -> float:
    mean = float(work.sum()) / work.numel()
    return float(work.max()) / mean if mean > 0 else 1.0


def _contiguous(row_work: torch.Tensor, W: int) -> torch.Tensor:
    """One contiguous range per rank (at least one row each) at the least maximum work: binary search
    over the bottleneck with a greedy cut (O(W log R) per step)."""
    R = row_work.numel()
    prefix = [0] + torch.cumsum(row_work, 0).tolist()

    def cuts(limit: int) -> list[int] | None:
        out, start = [0], 0
        for k in range(W):
            last = R - (W - 1 - k)                                       # leave a row for each later rank
            end = min(bisect.bisect_right(prefix, prefix[start] + limit) - 1, last)
            if k == W - 1:
                end = R
            if end <= start or prefix[end] - prefix[start] > limit:
                return None
            out.append(end)
            start = end
        return out

    lo, hi = max(math.ceil(prefix[-1] / W), int(row_work.max())), prefix[-1]
    best = cuts(hi)
    while best is None:                                                  # every rank needs a row
        hi = 2 * hi + 1
        best = cuts(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found = cuts(mid)
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    sizes = torch.tensor(best[1:]) - torch.tensor(best[:-1])
    return torch.repeat_interleave(torch.arange(W), sizes)


def _zigzag(row_work: torch.Tensor, W: int) -> torch.Tensor | None:
    """``2 W`` chunks of (nearly) equal length; rank ``r`` holds chunks ``r`` and ``2 W - 1 - r``."""
    R = row_work.numel()
    if R < 2 * W:
        return None
    chunk = torch.arange(R) * (2 * W) // R                               # chunk of each row
    return torch.where(chunk < W, chunk, 2 * W - 1 - chunk)


def _lpt(row_work: torch.Tensor, W: int) -> torch.Tensor:
    """Rows by decreasing work (ties: lower index first), each to the least loaded rank (ties: lower
    rank); the first ``W`` rows go to distinct ranks so each holds one."""
    order = torch.argsort(-row_work, stable=True).tolist()
    work = row_work.tolist()
    owner = [0] * len(order)
    heap = []
    for rank, row in enumerate(order[:W]):
        owner[row] = rank
        heap.append((work[row], rank))
    heapq.heapify(heap)
    for row in order[W:]:
        load, rank = heapq.heappop(heap)
        owner[row] = rank
        heapq.heappush(heap, (load + work[row], rank))
    return torch.tensor(owner, dtype=torch.int64)


_ASSIGN = {"contiguous": _contiguous, "zigzag": _zigzag, "lpt": _lpt}

__all__ = ["BALANCES", "ContextParallelPlan", "Exchange", "FULL_WORK", "PARTIAL_WORK", "RankLayouts",
           "SEQUENCE_BALANCES", "SPREAD_FRACTION", "STRATEGIES", "causal_layout", "layout_digest"]
