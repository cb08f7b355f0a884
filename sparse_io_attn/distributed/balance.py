"""Which rank owns which query-block rows: the balance of a
:class:`~sparse_io_attn.distributed.plan.ContextParallelPlan`.

* A static plan (:func:`balance_layout`) weighs each row by its kept blocks (:data:`FULL_WORK`,
  :data:`PARTIAL_WORK`), spreads the rows heavier than :data:`SPREAD_FRACTION` of a rank's mean
  (computed where their keys live), and takes among :data:`STRATEGIES` the assignment moving the
  fewest K/V and query tokens within the tolerance; the blocks each rank pair exchanges follow from
  it. The layout is read as runs of consecutive kept key blocks per row (one pass over the kept
  blocks), then O(runs + world_size * blocks) per candidate assignment, never the element mask or
  the block grid.
* A plan of a sequence length (:func:`sequence_owner`): zig-zag, contiguous or balanced ranges.
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import NamedTuple

import torch

from sparse_io_attn.layout.core import BlockSparseLayout

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


class Assignment(NamedTuple):
    """A static plan's balance: ``row_work``, ``spread``, ``block_work`` (``[num_blocks]``: the work
    of each query-block row, the spread rows, what the balance assigns with each block), the chosen
    ``strategy`` and its ``owner`` (int64 ``[num_blocks]``), ``work`` (int64 ``[world_size]``) and
    ``imbalance``; ``send`` and ``queries``: ``(blocks, offsets [W * W + 1])``, the K/V blocks and
    the spread query blocks of rank pair ``src * W + dst`` at ``blocks[offsets[p]:offsets[p + 1]]``."""
    row_work: torch.Tensor
    spread: torch.Tensor
    block_work: torch.Tensor
    strategy: str
    owner: torch.Tensor
    work: torch.Tensor
    imbalance: float
    send: tuple
    queries: tuple


def balance_layout(layout: BlockSparseLayout, world_size: int, block_sizes: torch.Tensor, balance: str,
                   tolerance: float, split_rows: bool) -> Assignment:
    """The balance of ``layout`` (the plan's own, causal applied) over ``world_size`` ranks;
    ``block_sizes``: real tokens per block; ``balance``, ``tolerance``, ``split_rows``: as
    :class:`~sparse_io_attn.distributed.plan.ContextParallelPlan` takes them (checked there)."""
    W, R = world_size, block_sizes.numel()
    count, partial = _row_costs(layout)
    row_work = FULL_WORK * count + (PARTIAL_WORK - FULL_WORK) * partial
    spread = torch.zeros(R, dtype=torch.bool)
    if split_rows and W > 1:
        spread = row_work * W > SPREAD_FRACTION * int(row_work.sum())
    spread_rows = spread.nonzero().squeeze(1)
    block_work = torch.where(spread, 0, row_work)
    if spread_rows.numel():                                          # their blocks count where the keys live
        _, c, pid = _row_entries(layout, spread_rows)
        block_work.index_add_(0, c, torch.where(pid >= 0, PARTIAL_WORK, FULL_WORK).to(torch.int64))
    runs = _kept_runs(layout)
    on_spread = spread[runs.row]
    kv_runs = _Runs(runs.row[~on_spread], runs.c0[~on_spread], runs.c1[~on_spread])   # K/V to the row's owner
    q_runs = _Runs(runs.row[on_spread], runs.c0[on_spread], runs.c1[on_spread])       # q to the keys' owners
    names = STRATEGIES if balance == "work" else (balance,)
    candidates = []
    for name in names:
        owner = _ASSIGN[name](block_work, W)
        if owner is None:
            continue
        work = torch.zeros(W, dtype=torch.int64).index_add_(0, owner, block_work)
        reads = (_coverage(owner[kv_runs.row], kv_runs.c0, kv_runs.c1, W, R) & _not_own(owner, W),
                 _owner_coverage(q_runs, owner, W, R) & _not_own(owner, W))
        moved = sum(int((read.to(torch.int64) * block_sizes).sum()) for read in reads)
        candidates.append((_imbalance(work), moved, name, owner, work, reads))
    if not candidates:
        raise ValueError(f"balance='zigzag' needs at least 2 * world_size = {2 * W} blocks, the "
                         f"layout has {R}; use balance='work' or a smaller block size")
    within = [cand for cand in candidates if cand[0] <= tolerance]
    best = (min(within, key=lambda cand: (cand[1], cand[0])) if within
            else min(candidates, key=lambda cand: (cand[0], cand[1])))
    imbalance, _, strategy, owner, work, (kv_read, q_read) = best
    return Assignment(row_work, spread, block_work, strategy, owner, work, imbalance,
                      _pair_csr(*_pairs(kv_read, owner), W), _pair_csr(*_pairs(q_read, owner), W))


def sequence_owner(weights: torch.Tensor, world_size: int, balance: str) -> torch.Tensor:
    """The owner of each query-block row of a plan of a sequence length (int64 ``[num_blocks]``):
    ``balance`` one of :data:`SEQUENCE_BALANCES`, ``weights`` the rows' work for ``"balanced"``."""
    R, W = weights.numel(), world_size
    if balance == "zigzag":
        owner = _zigzag(weights, W)
        if owner is None:
            raise ValueError(f"balance='zigzag' needs at least 2 * world_size = {2 * W} blocks, the sequence "
                             f"has {R}; use balance='contiguous' or a smaller block size")
    elif balance == "contiguous":
        owner = torch.arange(R) * W // R
    else:
        owner = _contiguous(weights, W)
    return owner


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + size)`` for each pair, int64."""
    total = int(sizes.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    return torch.arange(total) - torch.repeat_interleave(offsets - starts, sizes)

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

__all__ = ["Assignment", "BALANCES", "FULL_WORK", "PARTIAL_WORK", "SEQUENCE_BALANCES", "SPREAD_FRACTION",
           "STRATEGIES", "balance_layout", "sequence_owner"]
