"""`ContextParallelPlan`: which rank owns which query-block rows (and the K/V blocks of the same
tokens), and which K/V blocks every rank pair exchanges.

Units are blocks (``BLOCK_SIZE_Q == BLOCK_SIZE_KV``, self-attention ``seqlen_q == seqlen_k``): block
``b`` holds tokens ``[b * BLOCK, min((b + 1) * BLOCK, seqlen))`` of q, k and v alike, and rank ``r``
owns q rows *and* k/v blocks of the same tokens. Everything is computed from the layout's kept
blocks (:meth:`~sparse_io_attn.BlockSparseLayout.entries`, ``partial_ids``): O(kept blocks), never
the element mask or the block grid.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from typing import NamedTuple, Sequence

import torch

from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout import _bits
from sparse_io_attn.layout.causal import causal_blocks
from sparse_io_attn.layout._assemble import inrange_words
from sparse_io_attn.layout.core import BlockSparseLayout, assemble

#: cost of a kept block in the balance: full blocks 4, partial blocks 5 (the element mask is read and
#: applied on every tile: about a quarter more than a full block)
FULL_WORK, PARTIAL_WORK = 4, 5
#: the assignments ``balance="work"`` chooses among, in no particular order
STRATEGIES = ("contiguous", "zigzag", "lpt")
#: a row is spread (computed where its keys live) when its work exceeds this fraction of a rank's mean
SPREAD_FRACTION = 0.5
BALANCES = ("work",) + STRATEGIES


def causal_layout(layout: BlockSparseLayout) -> BlockSparseLayout:
    """``layout`` intersected with the causal mask ``j <= i``, element-exact, in O(kept blocks).

    Needs square blocks and ``seqlen_q == seqlen_k`` (then both causal alignments coincide): blocks
    below the diagonal keep their mask, diagonal blocks get theirs intersected with the lower
    triangle, blocks above it are dropped."""
    (b, _), n = layout.block_size, layout.seqlen_q
    lid, r, c = layout.entries()
    alive = causal_blocks(r, c, layout.block_size, layout.seqlen, 0).alive
    ids = layout.partial_ids.to(torch.int64)
    lid, r, c, ids = lid[alive], r[alive], c[alive], ids[alive]
    diag, part = c == r, ids >= 0
    sel = diag | part                                                  # entries whose mask is written
    words = inrange_words(r[sel], c[sel], layout.block_size, layout.seqlen)
    stored = part[sel]
    words[stored] = layout.partial_masks[ids[sel][stored]]
    tril = _bits.pack(torch.ones(b, b, dtype=torch.bool, device=words.device).tril())  # [b, W]
    words = torch.where(diag[sel][:, None, None], words & tril, words)
    return assemble(lid, r, c, words, partial=sel, block_size=layout.block_size, seqlen=(n, n),
                    layout_batch=layout.layout_batch, layout_heads=layout.layout_heads,
                    name=f"causal({layout.name})")


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
    """Context parallelism for a block-sparse layout: query-block rows assigned to ranks so that the
    kept work per rank is balanced, and the K/V blocks each rank pair exchanges.

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
    plan from the edited layout.

    ``digest`` (a 63-bit int) fingerprints everything the ranks must share: the source layout's
    contents (``layout_digest``), causality, block size, sequence length, world size and the
    assignment (``owner``, ``spread``: so also ``balance``, ``tolerance``, ``split_rows``); ranks
    compare it before any exchange.

    Attributes: ``layout`` (the layout the ranks compute, causal already applied), ``world_size``,
    ``block_size``, ``seqlen``, ``num_blocks``, ``causal``, ``strategy``, ``owner`` (int64
    ``[num_blocks]``: the rank of each block), ``spread`` (bool ``[num_blocks]``: spread rows),
    ``row_work`` (int64 ``[num_blocks]``: work of each query-block row), ``block_work`` (what the
    balance assigns with each block), ``work`` (int64 ``[world_size]``), ``imbalance``.
    """

    def __init__(self, layout: BlockSparseLayout, world_size: int, *, causal=False, balance: str = "work",
                 tolerance: float = 1.05, split_rows: bool = True):
        if not isinstance(layout, BlockSparseLayout):
            raise TypeError(f"layout must be a BlockSparseLayout, got {type(layout).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
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
        R = layout.num_q_blocks
        if R < world_size:
            raise ValueError(f"the layout has {R} block rows for {world_size} ranks; every rank needs "
                             f"at least one: use a smaller block size or fewer ranks")
        self.world_size = world_size
        self.block_size = bq
        self.seqlen = layout.seqlen_q
        self.num_blocks = R
        self.causal = causal_offset(causal, self.seqlen, self.seqlen) is not None
        self.source_layout = layout
        self._source_version = layout.version_key()
        self.layout_digest = layout_digest(layout)
        self.layout = causal_layout(layout.to("cpu")) if self.causal else _copy(layout.to("cpu"))
        self.block_sizes = torch.full((R,), bq, dtype=torch.int64)      # real tokens per block
        self.block_sizes[-1] = self.seqlen - (R - 1) * bq
        _, r, c = self.layout.entries()
        cost = torch.where(self.layout.partial_ids >= 0, PARTIAL_WORK, FULL_WORK).to(torch.int64)
        self.row_work = torch.zeros(R, dtype=torch.int64).index_add_(0, r, cost)
        self.spread = torch.zeros(R, dtype=torch.bool)
        if split_rows and world_size > 1:
            self.spread = self.row_work * world_size > SPREAD_FRACTION * int(self.row_work.sum())
        on_spread = self.spread[r]
        self.block_work = torch.where(self.spread, 0, self.row_work).index_add_(0, c[on_spread], cost[on_spread])
        self._kv_entries = (r[~on_spread], c[~on_spread])                # K/V blocks go to the row's owner
        self._q_entries = (c[on_spread], r[on_spread])                   # spread q blocks go to the keys' owners
        names = STRATEGIES if balance == "work" else (balance,)
        candidates = []
        for name in names:
            owner = _ASSIGN[name](self.block_work, world_size)
            if owner is None:
                continue
            work = torch.zeros(world_size, dtype=torch.int64).index_add_(0, owner, self.block_work)
            moved = sum(int(self.block_sizes[_exchanged(*e, owner, world_size)[1]].sum())
                        for e in (self._kv_entries, self._q_entries))
            candidates.append((_imbalance(work), moved, name, owner, work))
        if not candidates:
            raise ValueError(f"balance='zigzag' needs at least 2 * world_size = {2 * world_size} blocks, the "
                             f"layout has {R}; use balance='work' or a smaller block size")
        within = [cand for cand in candidates if cand[0] <= tolerance]
        best = (min(within, key=lambda cand: (cand[1], cand[0])) if within
                else min(candidates, key=lambda cand: (cand[0], cand[1])))
        self.imbalance, _, self.strategy, self.owner, self.work = best
        self._finish()
        self.assignment_digest = _digest(self.owner, self.spread)
        self.digest = _digest(torch.tensor([self.layout_digest, self.assignment_digest, int(self.causal),
                                            self.block_size, self.seqlen, self.world_size]))

    # ------------------------------------------------------------------ derived indices
    def _finish(self) -> None:
        W, R = self.world_size, self.num_blocks
        order = torch.argsort(self.owner * R + torch.arange(R), stable=True)   # blocks by (rank, index)
        counts = torch.bincount(self.owner, minlength=W)
        self._row_offsets = torch.zeros(W + 1, dtype=torch.int64)
        self._row_offsets[1:] = torch.cumsum(counts, 0)
        self._rows_sorted = order
        self.local_index = torch.empty(R, dtype=torch.int64)             # position among its owner's blocks
        self.local_index[order] = torch.arange(R) - self._row_offsets[self.owner[order]]
        sizes = self.block_sizes[order]
        starts = torch.cumsum(sizes, 0) - sizes                         # token start in rank-major order
        self._local_start = torch.empty(R, dtype=torch.int64)            # token start inside its shard
        self._local_start[order] = starts - starts[self._row_offsets[:-1]][self.owner[order]]
        tok = torch.zeros(W + 1, dtype=torch.int64)
        tok[1:] = torch.cumsum(torch.zeros(W, dtype=torch.int64).index_add_(0, self.owner, self.block_sizes), 0)
        self._token_offsets = tok
        self._send_cols, self._send_offsets = _pair_csr(*_exchanged(*self._kv_entries, self.owner, W), W)
        self._q_cols, self._q_offsets = _pair_csr(*_exchanged(*self._q_entries, self.owner, W), W)
        del self._kv_entries, self._q_entries
        self._rank_layouts: dict[int, RankLayouts] = {}
        self._token_index: dict[int, torch.Tensor] = {}
        self._exchange: dict[int, Exchange] = {}

    def _check_rank(self, rank: int, what: str = "rank") -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def check_source(self) -> "ContextParallelPlan":
        """Raise ``ValueError`` if the layout the plan was built from (``source_layout``) was edited
        in place since: its tensors' version counters moved and its contents (``layout_digest``)
        differ. Counters that moved over unchanged contents (a buffer refilled with the same
        selection) are accepted and recorded. Returns the plan."""
        layout = self.source_layout
        version = layout.version_key()
        if version is None or version == self._source_version:
            return self
        if layout_digest(layout) != self.layout_digest:
            raise ValueError(f"the layout {layout.name!r} was edited in place after ContextParallelPlan was "
                             f"built from it (its contents changed; the plan's send lists and rank layouts "
                             f"are of the old contents); rebuild the plan: ContextParallelPlan(layout, "
                             f"{self.world_size}, causal={self.causal}) on every rank")
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
        return int(self._token_offsets[rank + 1] - self._token_offsets[rank])

    def tokens(self, blocks: torch.Tensor) -> int:
        """Real tokens in ``blocks`` (the last block of the sequence may be ragged)."""
        return int(self.block_sizes[blocks].sum())

    def send_blocks(self, src: int, dst: int) -> torch.Tensor:
        """K/V blocks ``src`` sends ``dst``: blocks ``src`` owns that some row of ``dst`` (not a spread
        row) reads in any of the layout's batch/head masks; sorted, int64 (empty for ``src == dst``)."""
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
        """The layouts rank ``rank`` computes (:class:`RankLayouts`), element-exact, cached."""
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
        """The token-level description of rank ``rank``'s exchange (:class:`Exchange`), cached."""
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
        return (f"ContextParallelPlan(layout={self.source_layout.name!r}, seqlen={self.seqlen}, "
                f"block={self.block_size}, world_size={self.world_size}, causal={self.causal}, "
                f"strategy={self.strategy!r}, imbalance={self.imbalance:.4f})")


# ---------------------------------------------------------------------------------------- helpers
def _digest(*tensors: torch.Tensor) -> int:
    """A 63-bit fingerprint (BLAKE2b) of the tensors' dtypes, shapes and bytes, read on the CPU."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15 - 2 ** 64, 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (arithmetic shifts, wrapping products): a fixed scramble."""
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


def layout_digest(layout: BlockSparseLayout) -> int:
    """A 63-bit fingerprint of a layout's contents: sizes, kept blocks (``crow_indices``,
    ``col_indices``) and each kept block's element mask, the masks fingerprinted by content (equal
    layouts whose masks are stored in another order get the same digest). O(kept blocks + stored
    mask words); reads the layout on the CPU."""
    masks = layout.partial_masks.cpu().to(torch.int64).flatten(1)                 # [num_masks, words]
    position = torch.arange(masks.shape[1], dtype=torch.int64) * _GOLDEN
    mask_keys = torch.cat([_mix64(masks + position).sum(1), torch.tensor([-1])])  # one 64-bit key per mask
    ids = layout.partial_ids.cpu().to(torch.int64)
    per_block = mask_keys[torch.where(ids >= 0, ids, mask_keys.numel() - 1)]
    sizes = torch.tensor([*layout.block_size, *layout.seqlen, layout.layout_batch, layout.layout_heads])
    return _digest(sizes, layout.crow_indices, layout.col_indices, per_block)


def _copy(layout: BlockSparseLayout) -> BlockSparseLayout:
    """The layout on fresh storage (the plan's own: in-place edits of the caller's never reach it),
    index ranges validated."""
    return BlockSparseLayout(layout.crow_indices.clone(), layout.col_slots.clone(), block_size=layout.block_size,
                             seqlen=layout.seqlen, layout_batch=layout.layout_batch,
                             layout_heads=layout.layout_heads, name=layout.name, validate=False,
                             partial_ids=layout.partial_id_slots.clone(), partial_masks=layout.partial_masks.clone(),
                             fixed_capacity=layout.fixed_capacity).check()


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


def _exchanged(rows: torch.Tensor, cols: torch.Tensor, owner: torch.Tensor,
               W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src * W + dst, col)`` of every K/V block sent (kept block ``(row, col)`` of any mask with
    ``owner[row] = dst != src = owner[col]``), unique, sorted by ``(src, dst, col)``: one ``[W, R]``
    flag grid, O(kept blocks + W R)."""
    R = owner.numel()
    read = torch.zeros(W, R, dtype=torch.bool)
    read[owner[rows], cols] = True
    read[owner, torch.arange(R)] = False                                # its own blocks: not sent
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

__all__ = ["BALANCES", "ContextParallelPlan", "Exchange", "FULL_WORK", "PARTIAL_WORK", "RankLayouts", "SPREAD_FRACTION",
           "STRATEGIES", "causal_layout", "layout_digest"]
