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
owns q rows *and* k/v blocks of the same tokens. Who owns which rows is decided in :mod:`.balance`
(a static plan's balance by kept work, a sequence's ranges); a static plan's views are built beside
their types: each rank's layouts in :mod:`.layouts`, each rank's exchange in :mod:`.exchange`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from sparse_io_attn.distributed import step as _step
from sparse_io_attn.distributed.balance import (BALANCES, FULL_WORK, PARTIAL_WORK, SEQUENCE_BALANCES, SPREAD_FRACTION,
                                                STRATEGIES, _imbalance, _ranges, balance_layout, sequence_owner)
from sparse_io_attn.distributed.exchange import Exchange, rank_exchange
from sparse_io_attn.distributed.layouts import (RankLayouts, _copy, _digest, causal_layout, layout_digest,
                                                rank_layouts)
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout


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
        self.source_layout = layout
        self._source_version = layout.version_key()
        self.layout_digest = layout_digest(layout)
        self.layout = causal_layout(layout.to("cpu")) if self.causal else _copy(layout.to("cpu"))
        a = balance_layout(self.layout, world_size, self.block_sizes, balance, tolerance, split_rows)
        self.row_work, self.spread, self.block_work, self.strategy = a.row_work, a.spread, a.block_work, a.strategy
        self.work, self.imbalance = a.work, a.imbalance
        self._own(a.owner)
        (self._send_cols, self._send_offsets), (self._q_cols, self._q_offsets) = a.send, a.queries
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
        owner = sequence_owner(weights, W, balance)
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
        return self._pair("send_blocks", self._send_cols, self._send_offsets, src, dst)

    def recv_blocks(self, dst: int) -> torch.Tensor:
        """Every block ``dst`` receives (the union of :meth:`send_blocks` ``(src, dst)``), ascending."""
        return torch.sort(torch.cat([self.send_blocks(s, dst) for s in range(self.world_size)])).values

    def send_queries(self, src: int, dst: int) -> torch.Tensor:
        """Spread query blocks ``src`` owns whose row reads some K/V block ``dst`` owns: ``src`` sends
        ``dst`` their queries, ``dst`` sends back its partial results; sorted, int64."""
        return self._pair("send_queries", self._q_cols, self._q_offsets, src, dst)

    def recv_queries(self, dst: int) -> torch.Tensor:
        """Every spread query block ``dst`` computes a part of for another rank, ascending."""
        return torch.sort(torch.cat([self.send_queries(s, dst) for s in range(self.world_size)])).values

    def _pair(self, what: str, blocks: torch.Tensor, offsets: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        """The blocks of rank pair ``(src, dst)`` in one of a static plan's pair lists."""
        self._require_layout(what)
        self._check_rank(src, "src")
        self._check_rank(dst, "dst")
        p = src * self.world_size + dst
        return blocks[offsets[p]:offsets[p + 1]]

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
            self._rank_layouts[rank] = rank_layouts(self, rank)
        return self._rank_layouts[rank]

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
            self._exchange[rank] = rank_exchange(self, rank)
        return self._exchange[rank]

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


def _dim(x: torch.Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d tensor, got {dim!r}")
    return dim % x.dim()


def _block_tokens(blocks: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    starts = blocks * block
    return _ranges(starts, torch.clamp(seqlen - starts, max=block))


__all__ = ["BALANCES", "ContextParallelPlan", "Exchange", "FULL_WORK", "PARTIAL_WORK", "RankLayouts",
           "SEQUENCE_BALANCES", "SPREAD_FRACTION", "STRATEGIES", "causal_layout", "layout_digest"]
