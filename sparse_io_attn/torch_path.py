"""Backend ``"torch"``: block-sparse attention forward/backward in plain PyTorch (any device).

Never builds the dense ``Nq x Nk`` score matrix. The work is cut into *chunks*; a chunk is one or
a few batched matmuls ``S = Q_sel @ K_sel^T`` over whole query-block rows, so each row's softmax is
exact in one step (no online rescaling):

* A **unit** shares one layout mask and one K/V head: ``(b, kv head)`` with the query heads of its
  GQA group stacked as extra rows when the layout is shared across heads, ``(b, query head)``
  otherwise. Rows are ordered ``(position, head)`` inside a unit.
* A **task** is a set of units x a set of query-block rows that have the **same kept-key list**
  (all rows of a dense layout, the global rows of BigBird; identical rows of different layout
  masks are merged). Its rows are stacked into one matmul and its keys are read once per unit.
* Consecutive rows whose key ranges nest (causal prefixes) are stacked into one taller task over
  the union of their ranges when at most ``MERGE_WASTE`` of its scores are padding (masked).
* The kept key blocks of a row are merged into one run. Contiguous runs are read as views (no
  copy): one task batched over units, or a **strided** series of tasks whose row and key starts
  advance by fixed steps (a sliding window: one matmul per unit over overlapping key windows).
  Other tasks gather whole blocks with one ``index_select`` into a reused buffer.
* Elements to drop (causal ``j > i`` inside blocks that straddle the diagonal, key padding past
  ``seqlen_k``, blocks a stacked row does not keep) are set to ``-inf`` only in the block columns
  that need it; blocks entirely above the causal diagonal are removed from the plan.
* On CPU with several torch threads the chunks are shared by single-threaded worker threads
  (:func:`_for_each_chunk`): one parallel region per chunk rather than one per small op.

The plan depends only on the layout, ``(B, Hq, Hkv)``, ``causal`` and the device; it is built once
and cached on the layout object (attribute ``_torch_path_plans``). Compute is float32 (fp16/bf16
inputs are upcast; outputs are cast back). Scores are kept in base 2 (``Q`` is pre-scaled by
``sm_scale * log2(e)``; ``exp2`` is about twice as fast as ``exp`` on CPU). The returned ``lse``
is float32, natural log, ``-inf`` on rows with no kept key; such rows get output 0 and zero
gradients.

Backward recomputes ``P = exp2(S - lse2)`` per chunk (probabilities are never stored):
``dV += P^T dO``, ``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``, ``dQ = sm_scale
dS K``, ``dK += sm_scale dS^T Q``.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .layout import BlockSparseLayout

# Score elements (fp32) per chunk, summed over the chunk's units: 4 MiB of scores, big enough for
# efficient batched GEMMs, small enough to stay in the last-level cache between softmax passes and
# below glibc's mmap threshold (fresh large buffers page-fault on every call).
SCORE_BUDGET = 1 << 20
# Query rows (x stacked heads) a matmul should reach when rows can be stacked: M >= 256 runs ~15%
# faster than M = 64 on CPU. Consecutive rows with different key ranges are stacked over the union
# of their ranges when at most MERGE_WASTE of the scores are masked-out padding.
MIN_ROWS_M = 256
MERGE_WASTE = 0.10
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
_PLAN_ATTR = "_torch_path_plans"


# ------------------------------------------------------------------------------------------ plan
@dataclass
class _Task:
    units: tuple[int, ...]
    rows: tuple[int, ...]   # query blocks, stacked into one matmul
    cols: tuple[int, ...]   # key blocks read for these rows
    kept: tuple | None = None  # per row, the blocks of `cols` it keeps (None: all of them)


@dataclass
class _Chunk:
    """``steps`` matmuls of ``nb`` items each; an item is ``R`` query blocks x ``C`` key blocks.

    kind ``"units"``: one step, items = the units ``u0 + i*du`` (kv ``kv0 + i*dkv``), all reading
    query blocks ``[q0, q0+R)`` and key blocks ``[k0, k0+C)`` as views.
    kind ``"strided"``: one step per unit (``units``/``kv_units``), items ``j < nb`` read query
    blocks ``[q0 + j*qstep, +R)`` and key blocks ``[k0 + j*kstep, +C)`` as views.
    kind ``"gather"``: one step; ``q_idx``/``k_idx`` are flat block ids (``unit*nqb + row``,
    ``kv_unit*nkb + col``) of the ``nb`` items.
    ``k_idx`` is also set for the strided kind (scatter-add of dK/dV over overlapping windows).
    ``mask`` bool ``[nb or 1, R*BLOCK_SIZE_Q, 1, ncols]`` (True = drop) covers score columns
    ``mask_cols``.
    """
    kind: str
    steps: int
    nb: int
    R: int
    C: int
    units: list = field(default_factory=list)
    kv_units: list = field(default_factory=list)
    q0: int = 0
    k0: int = 0
    qstep: int = 0
    kstep: int = 0
    du: int = 0
    dkv: int = 0
    q_idx: torch.Tensor | None = None
    k_idx: torch.Tensor | None = None
    mask_cols: slice | None = None
    mask: torch.Tensor | None = None


@dataclass
class _Plan:
    num_units: int
    heads_per_unit: int
    chunks: list
    max_scores: int        # largest chunk, in score elements
    max_q_rows: int        # largest chunk, in gathered query rows (items x rows)
    max_k_rows: int        # largest chunk, in gathered key rows
    has_empty_rows: bool   # some (unit, query block) keeps no key block: its output must be zeroed
    chunks_by_cost: list = field(default_factory=list)   # largest first (work-queue order)
    cache: dict = field(default_factory=dict)            # per-worker-count splits


def _unit_maps(layout: BlockSparseLayout, B: int, Hq: int, Hkv: int):
    """``(U, heads_per_unit, layout_index[U], kv_unit[U])``."""
    stride_lb, stride_lh = layout.broadcast_strides(B, Hq)
    group = Hq // Hkv
    if layout.layout_heads == 1:
        U = B * Hkv
        return U, group, [(u // Hkv) * stride_lb for u in range(U)], list(range(U))
    U = B * Hq
    lidx = [(u // Hq) * stride_lb + (u % Hq) * stride_lh for u in range(U)]
    return U, 1, lidx, [(u // Hq) * Hkv + (u % Hq) // group for u in range(U)]


def _row_lists(layout: BlockSparseLayout, l: int, causal: bool) -> list[tuple[int, ...]]:
    """Kept key blocks of each query-block row of mask ``l``, minus blocks fully above the causal
    diagonal (every key position > every query position of the row)."""
    bq, bk = layout.block_size
    crow = layout.crow_indices[l].tolist()
    col = layout.col_indices[crow[0]:crow[-1]].tolist()
    base = crow[0]
    rows = []
    for r in range(layout.num_q_blocks):
        cols = col[crow[r] - base:crow[r + 1] - base]
        if causal:
            last_q = min((r + 1) * bq, layout.seqlen_q) - 1
            cols = [c for c in cols if c * bk <= last_q]
        rows.append(tuple(cols))
    return rows


def _contiguous(ids) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def _arith(xs) -> int | None:
    """The common step of an arithmetic sequence, or None."""
    if len(xs) < 2:
        return 0
    d = xs[1] - xs[0]
    return d if all(b - a == d for a, b in zip(xs, xs[1:])) else None


def _tasks(layout: BlockSparseLayout, units_of: dict, G: int, causal: bool) -> tuple[list[_Task], bool]:
    """Rows with identical key lists (merged across masks), split to fit the score budget; and
    whether some row keeps no key block."""
    bq, bk = layout.block_size
    by_cols: dict[tuple, dict[int, list[int]]] = {}   # cols -> row -> units
    has_empty = False
    for l, units in units_of.items():
        for r, cols in enumerate(_row_lists(layout, l, causal)):
            if cols:
                by_cols.setdefault(cols, {}).setdefault(r, []).extend(units)
            else:
                has_empty = True
    tasks = []
    for cols, row_units in by_cols.items():
        groups: dict[tuple, list[int]] = {}
        for r in sorted(row_units):
            groups.setdefault(tuple(sorted(row_units[r])), []).append(r)
        for units, rows in groups.items():
            per_row = G * bq * len(cols) * bk     # score elements of one row of one unit
            step = max(-(-MIN_ROWS_M // (G * bq)), SCORE_BUDGET // (len(units) * per_row))
            step = max(1, min(step, SCORE_BUDGET // per_row))
            # split into contiguous pieces of at most `step` rows
            pieces, cur = [], [rows[0]]
            for r in rows[1:]:
                if r == cur[-1] + 1 and len(cur) < step:
                    cur.append(r)
                else:
                    pieces.append(cur)
                    cur = [r]
            pieces.append(cur)
            # non-contiguous rows of one class can share a matmul (gathered); keep pieces if contiguous
            if len(pieces) > 1 and all(len(p) == 1 for p in pieces):
                pieces = [rows[i:i + step] for i in range(0, len(rows), step)]
            tasks += [_Task(units, tuple(p), cols) for p in pieces]
    return _merge_rows(tasks, G * bq, bk), has_empty


def _merge_rows(tasks: list[_Task], rows_m: int, bk: int) -> list[_Task]:
    """Stack runs of consecutive single-row tasks with contiguous key ranges (a causal prefix,
    a band) into one task over the union of their ranges when that wastes at most
    ``MERGE_WASTE`` of the scores: taller matmuls (up to ``MIN_ROWS_M`` rows) run faster; the
    blocks a row does not keep are masked (``kept``)."""
    single, out = {}, []
    for t in tasks:
        if len(t.rows) == 1 and _contiguous(t.cols):
            single.setdefault(t.units, []).append(t)
        else:
            out.append(t)
    gmax = max(1, MIN_ROWS_M // rows_m)
    for units, ts in single.items():
        ts.sort(key=lambda t: t.rows[0])
        group = [ts[0]]
        for t in ts[1:] + [None]:
            if t is not None and len(group) < gmax and t.rows[0] == group[-1].rows[0] + 1:
                lo = min(g.cols[0] for g in group + [t])
                hi = max(g.cols[-1] for g in group + [t])
                width = hi - lo + 1
                waste = sum(width - len(g.cols) for g in group + [t]) / (width * (len(group) + 1))
                if waste <= MERGE_WASTE and (len(group) + 1) * rows_m * width * bk <= SCORE_BUDGET:
                    group.append(t)
                    continue
            if len(group) == 1:
                out.append(group[0])
            else:
                lo, hi = min(g.cols[0] for g in group), max(g.cols[-1] for g in group)
                cols = tuple(range(lo, hi + 1))
                kept = tuple(g.cols for g in group)
                out.append(_Task(units, tuple(g.rows[0] for g in group), cols,
                                 None if all(k == cols for k in kept) else kept))
            group = [t]
    return out


def _drop_mask(t: _Task, layout: BlockSparseLayout, causal: bool):
    """bool ``[len(rows)*bq, len(cols)*bk]`` (True = drop: key padding, causal ``j > i``, a block
    the row does not keep), or None if nothing is dropped."""
    bq, bk = layout.block_size
    qpos = (torch.tensor(t.rows).view(-1, 1) * bq + torch.arange(bq)).view(-1)
    kpos = (torch.tensor(t.cols).view(-1, 1) * bk + torch.arange(bk)).view(-1)
    drop = (kpos >= layout.seqlen_k).view(1, -1).expand(qpos.numel(), -1)
    if causal:
        drop = drop | (kpos.view(1, -1) > qpos.view(-1, 1))
    if t.kept is not None:
        keep = torch.tensor([[c in set(k) for c in t.cols] for k in t.kept])   # [rows, cols]
        drop = drop | ~keep.repeat_interleave(bq, 0).repeat_interleave(bk, 1)
    return drop if bool(drop.any()) else None


def _set_mask(ch: _Chunk, items: list, layout: BlockSparseLayout, causal: bool) -> None:
    """``items``: the task of each item (or one task shared by all items)."""
    bk = layout.BLOCK_SIZE_KV
    memo: dict[int, torch.Tensor | None] = {}
    masks = [memo[id(t)] if id(t) in memo else memo.setdefault(id(t), _drop_mask(t, layout, causal))
             for t in items]
    if all(m is None for m in masks):
        return
    hit = torch.zeros(ch.C, dtype=torch.bool)
    for m in masks:
        if m is not None:
            hit |= m.view(m.shape[0], ch.C, bk).any(dim=2).any(dim=0)
    cols = hit.nonzero().view(-1).tolist()
    ch.mask_cols = slice(cols[0] * bk, (cols[-1] + 1) * bk)
    sub = [m[:, ch.mask_cols] if m is not None else None for m in masks]
    like = next(m for m in sub if m is not None)
    ch.mask = torch.stack([m if m is not None else torch.zeros_like(like) for m in sub]).unsqueeze(2)


def _build_plan(layout: BlockSparseLayout, B: int, Hq: int, Hkv: int, causal: bool,
                device: torch.device) -> _Plan:
    bq, bk = layout.block_size
    nqb, nkb = layout.num_q_blocks, layout.num_kv_blocks
    U, G, lidx, kv_unit = _unit_maps(layout, B, Hq, Hkv)
    units_of: dict[int, list[int]] = {}
    for u, l in enumerate(lidx):
        units_of.setdefault(l, []).append(u)

    viewable, gathered = {}, {}
    tasks, has_empty = _tasks(layout, units_of, G, causal)
    for t in tasks:
        key = (len(t.rows), len(t.cols))
        if _contiguous(t.rows) and _contiguous(t.cols):
            viewable.setdefault((t.units,) + key, []).append(t)
        else:
            gathered.setdefault(key, []).append(t)

    chunks: list[_Chunk] = []
    for (units, R, C), tasks in viewable.items():
        per_item = G * R * bq * C * bk
        tasks.sort(key=lambda t: t.rows[0])
        kvs = [kv_unit[u] for u in units]
        du, dkv = _arith(list(units)), _arith(kvs)
        # strided series: row and key starts advancing by fixed steps, one matmul per unit
        i = 0
        while i < len(tasks):
            j = i + 1
            cap = max(1, SCORE_BUDGET // (per_item * len(units)))
            if j < len(tasks) and tasks[j].cols[0] >= tasks[i].cols[0]:
                qstep = tasks[j].rows[0] - tasks[i].rows[0]
                kstep = tasks[j].cols[0] - tasks[i].cols[0]
                while (j < len(tasks) and j - i < cap and tasks[j].rows[0] - tasks[j - 1].rows[0] == qstep
                       and tasks[j].cols[0] - tasks[j - 1].cols[0] == kstep):
                    j += 1
            run = tasks[i:j]
            t0 = run[0]
            if len(run) == 1 and du is not None and dkv is not None:
                cap_u = max(1, SCORE_BUDGET // per_item)     # units per chunk
                for a in range(0, len(units), cap_u):
                    sub, sub_kv = list(units[a:a + cap_u]), kvs[a:a + cap_u]
                    ch = _Chunk("units", 1, len(sub), R, C, sub, sub_kv, q0=t0.rows[0], k0=t0.cols[0],
                                du=du, dkv=dkv)
                    _set_mask(ch, [t0], layout, causal)
                    chunks.append(ch)
                i = j
                continue
            else:
                qstep = run[1].rows[0] - t0.rows[0] if len(run) > 1 else R
                kstep = run[1].cols[0] - t0.cols[0] if len(run) > 1 else 0
                ch = _Chunk("strided", len(units), len(run), R, C, list(units), kvs, q0=t0.rows[0],
                            k0=t0.cols[0], qstep=qstep, kstep=kstep, du=du)
                ch.k_idx = torch.tensor([kv * nkb + t.cols[0] + c for kv in kvs for t in run for c in range(C)],
                                        dtype=torch.int64)
                _set_mask(ch, run, layout, causal)
                if ch.mask is not None and ch.mask.shape[0] > 1 and all(
                        torch.equal(ch.mask[0], m) for m in ch.mask[1:]):
                    ch.mask = ch.mask[:1]
            chunks.append(ch)
            i = j
    for (R, C), tasks in gathered.items():
        per_item = G * R * bq * C * bk
        cap = max(1, SCORE_BUDGET // per_item)
        items = [(u, t) for t in tasks for u in t.units]
        for i in range(0, len(items), cap):
            part = items[i:i + cap]
            ch = _Chunk("gather", 1, len(part), R, C)
            ch.q_idx = torch.tensor([u * nqb + r for u, t in part for r in t.rows], dtype=torch.int64)
            ch.k_idx = torch.tensor([kv_unit[u] * nkb + c for u, t in part for c in t.cols], dtype=torch.int64)
            same = all(t is part[0][1] for _, t in part)
            _set_mask(ch, [t for _, t in (part[:1] if same else part)], layout, causal)
            chunks.append(ch)

    for ch in chunks:
        for name in ("q_idx", "k_idx", "mask"):
            t = getattr(ch, name)
            if t is not None:
                setattr(ch, name, t.to(device))
    max_scores = max((ch.steps * ch.nb * G * ch.R * bq * ch.C * bk for ch in chunks), default=0)
    max_q = max((ch.steps * ch.nb * ch.R * bq for ch in chunks), default=0)
    max_k = max((ch.steps * ch.nb * ch.C * bk for ch in chunks), default=0)
    by_cost = sorted(chunks, key=lambda ch: -(ch.steps * ch.nb * ch.R * ch.C))
    return _Plan(U, G, chunks, max_scores, max_q, max_k, has_empty, by_cost)


def _get_plan(layout: BlockSparseLayout, B: int, Hq: int, Hkv: int, causal: bool,
              device: torch.device) -> _Plan:
    cache = layout.__dict__.setdefault(_PLAN_ATTR, {})
    key = (B, Hq, Hkv, bool(causal), str(device))
    if key not in cache:
        cache[key] = _build_plan(layout, B, Hq, Hkv, causal, device)
    return cache[key]


# ------------------------------------------------------------------------------ unit-major tensors
def _q_units(x: torch.Tensor, G: int, Nqp: int, fill=0.0, scale=None) -> torch.Tensor:
    """``[B, Hq, Nq, *tail]`` -> float32 contiguous ``[U, Nqp, G, *tail]`` (padding = ``fill``)."""
    B, Hq, Nq = x.shape[:3]
    tail = x.shape[3:]
    xv = x.reshape(B * Hq // G, G, Nq, *tail).transpose(1, 2)
    out = torch.empty(xv.shape[0], Nqp, G, *tail, dtype=torch.float32, device=x.device)
    if scale is None:
        out[:, :Nq].copy_(xv)
    elif x.dtype in (torch.float32, torch.float64):
        torch.mul(xv, scale, out=out[:, :Nq])
    else:  # scale after the upcast: a low-precision product would round the scores
        out[:, :Nq].copy_(xv)
        out[:, :Nq].mul_(scale)
    if Nqp > Nq:
        out[:, Nq:].fill_(fill)
    return out


def _from_q_units(x: torch.Tensor, B: int, Hq: int, Nq: int) -> torch.Tensor:
    """``[U, Nqp, G, *tail]`` -> ``[B, Hq, Nq, *tail]``."""
    return x[:, :Nq].transpose(1, 2).reshape(B, Hq, Nq, *x.shape[3:])


def _kv_units(x: torch.Tensor, Nkp: int) -> torch.Tensor:
    """``[B, Hkv, Nk, D]`` -> float32 contiguous ``[B*Hkv, Nkp, D]`` (zero padded)."""
    B, H, Nk, D = x.shape
    if Nkp == Nk and x.dtype == torch.float32 and x.is_contiguous():
        return x.view(B * H, Nk, D)
    out = torch.zeros(B * H, Nkp, D, dtype=torch.float32, device=x.device)
    out[:, :Nk].copy_(x.reshape(B * H, Nk, D))
    return out


# --------------------------------------------------------------------------------- chunk access
def _view(x: torch.Tensor, offset: int, size, stride) -> torch.Tensor:
    return x.as_strided(size, stride, x.storage_offset() + offset)


class _Exec:
    """Per-call tensors and reused work buffers; turns chunks into views and matmuls."""

    def __init__(self, plan: _Plan, bq: int, bk: int, D: int, device, *, backward: bool = False):
        self.plan, self.bq, self.bk, self.G, self.D = plan, bq, bk, plan.heads_per_unit, D
        f32 = dict(dtype=torch.float32, device=device)
        self.buf_s = torch.empty(plan.max_scores, **f32)
        self.buf_q = torch.empty(plan.max_q_rows * self.G * D, **f32)
        self.buf_k = torch.empty(plan.max_k_rows * D, **f32)
        self.buf_v = torch.empty_like(self.buf_k)
        if backward:
            self.buf_do = torch.empty_like(self.buf_q)
            self.buf_dp = torch.empty_like(self.buf_s)

    # q side: x is [U, Nqp, G, *tail] contiguous; returns per-step [nb, R*bq*G, *tail]
    def q_steps(self, x: torch.Tensor, ch: _Chunk, gather_buf: torch.Tensor | None = None) -> list:
        bq, G = self.bq, self.G
        Nqp = x.shape[1]
        tail = tuple(x.shape[3:])
        inner = math.prod(tail)
        M = ch.R * bq * G
        blk = bq * G * inner            # elements per query block of one unit
        if ch.kind == "units":
            return [_view(x, ch.units[0] * Nqp * G * inner + ch.q0 * blk, (ch.nb, M) + tail,
                          (ch.du * Nqp * G * inner, inner) + ((1,) if tail else ()))]
        if ch.kind == "strided":
            return [_view(x, u * Nqp * G * inner + ch.q0 * blk, (ch.nb, M) + tail,
                          (ch.qstep * blk, inner) + ((1,) if tail else ())) for u in ch.units]
        blocks = x.view(-1, bq * G, *tail)
        n = ch.q_idx.numel()
        out = None if gather_buf is None else gather_buf[:n * blk].view(n, bq * G, *tail)
        g = torch.index_select(blocks, 0, ch.q_idx, out=out) if out is not None else blocks.index_select(0, ch.q_idx)
        return [g.view(ch.nb, M, *tail)]

    # k side: x is [Ukv, Nkp, D] contiguous; returns per-step [nb, C*bk, D]
    def k_steps(self, x: torch.Tensor, ch: _Chunk, buf: torch.Tensor | None) -> list:
        bk, D = self.bk, self.D
        Nkp = x.shape[1]
        N = ch.C * bk
        if ch.kind == "units":
            return [_view(x, ch.kv_units[0] * Nkp * D + ch.k0 * bk * D, (ch.nb, N, D), (ch.dkv * Nkp * D, D, 1))]
        if ch.kind == "strided":
            return [_view(x, kv * Nkp * D + ch.k0 * bk * D, (ch.nb, N, D), (ch.kstep * bk * D, D, 1))
                    for kv in ch.kv_units]
        n = ch.k_idx.numel()
        out = buf[:n * bk * D].view(n, bk, D)
        torch.index_select(x.view(-1, bk, D), 0, ch.k_idx, out=out)
        return [out.view(ch.nb, N, D)]

    def scores(self, qs: list, ks: list, ch: _Chunk) -> torch.Tensor:
        """``S = Q K^T`` (base-2 scale already in Q), dropped elements ``-inf``:
        ``[steps * nb, R*bq*G, C*bk]`` in the score buffer."""
        M, N = ch.R * self.bq * self.G, ch.C * self.bk
        s = self.buf_s[:ch.steps * ch.nb * M * N].view(ch.steps, ch.nb, M, N)
        for i, (a, b) in enumerate(zip(qs, ks)):
            torch.bmm(a, b.transpose(1, 2), out=s[i])
        if ch.mask is not None:
            s5 = s.view(ch.steps, ch.nb, ch.R * self.bq, self.G, N)[..., ch.mask_cols]
            s5.masked_fill_(ch.mask, float("-inf"))
        return s.view(ch.steps * ch.nb, M, N)

    def write_q(self, dst: torch.Tensor, val: torch.Tensor, ch: _Chunk) -> None:
        """Store ``val [steps*nb, R*bq*G, *tail]`` at the chunk's query rows of ``dst [U, Nqp, G, *tail]``
        (every (unit, query block) belongs to exactly one chunk)."""
        if ch.kind == "gather":
            blocks = dst.view(-1, self.bq * self.G, *dst.shape[3:])
            blocks.index_copy_(0, ch.q_idx, val.reshape(-1, *blocks.shape[1:]))
            return
        grid = self.q_grid(dst, ch)
        if grid is not None:
            grid.copy_(val.view(grid.shape))
            return
        for d, v in zip(self.q_steps(dst, ch), val.view(ch.steps, ch.nb, *val.shape[1:])):
            d.copy_(v)

    def q_rows(self, x: torch.Tensor, ch: _Chunk) -> torch.Tensor:
        """The chunk's rows of a per-row tensor ``x [U, Nqp, G]`` as ``[steps*nb, R*bq*G, 1]``."""
        grid = self.q_grid(x, ch)
        rows = torch.stack(self.q_steps(x, ch)) if grid is None else grid
        return rows.reshape(ch.steps * ch.nb, -1, 1)

    def q_grid(self, x: torch.Tensor, ch: _Chunk) -> torch.Tensor | None:
        """All query rows of a view-kind chunk as one ``[steps, nb, R*bq*G, *tail]`` view of
        ``x [U, Nqp, G, *tail]`` (None for gathers and irregular unit sets)."""
        if ch.kind == "units":
            return self.q_steps(x, ch)[0].unsqueeze(0)
        if ch.kind == "gather" or ch.du is None:
            return None
        Nqp, tail = x.shape[1], tuple(x.shape[3:])
        inner = math.prod(tail)
        blk = self.bq * self.G * inner
        return _view(x, ch.units[0] * Nqp * self.G * inner + ch.q0 * blk,
                     (ch.steps, ch.nb, ch.R * self.bq * self.G) + tail,
                     (ch.du * Nqp * self.G * inner, ch.qstep * blk, inner) + ((1,) if tail else ()))

    def add_k(self, dst: torch.Tensor, val: torch.Tensor, ch: _Chunk) -> None:
        """``dst [Ukv, Nkp, D] += val [steps*nb, C*bk, D]`` at the chunk's key rows (overlaps add)."""
        if ch.kind == "units" and ch.dkv != 0:
            self.k_steps(dst, ch, None)[0].add_(val)
            return
        if ch.kind == "units":  # several items on one kv unit (stride 0): sum them first
            self.k_steps(dst, ch, None)[0][:1].add_(val.sum(0, keepdim=True))
            return
        dst.view(-1, self.bk, self.D).index_add_(0, ch.k_idx, val.reshape(-1, self.bk, self.D))


# ------------------------------------------------------------------------------- chunk scheduling
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_PID = 0     # a forked child inherits the pool object but not its threads: rebuild there
_POOL_LOCK = threading.Lock()


def _init_worker(started: threading.Barrier) -> None:
    torch.get_num_threads()   # ATen's per-thread lazy init first, or it would undo the next line
    torch.set_num_threads(1)
    started.wait()


def _pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` worker threads whose PyTorch ops run single-threaded."""
    global _POOL, _POOL_SIZE, _POOL_PID
    with _POOL_LOCK:
        if _POOL_PID != os.getpid():
            _POOL, _POOL_SIZE, _POOL_PID = None, 0, os.getpid()
        if _POOL_SIZE < n:
            main_threads = torch.get_num_threads()
            started = threading.Barrier(n + 1)
            pool = ThreadPoolExecutor(n, thread_name_prefix="sparse_io_attn")
            for _ in range(n):           # start every worker now, each set to one thread
                pool.submit(_init_worker, started)
            started.wait()
            torch.set_num_threads(main_threads)  # set_num_threads also changes the process default
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = pool, n
        return _POOL


def _split(plan: _Plan, n: int) -> list[list[_Chunk]]:
    """Chunks dealt to ``n`` workers, largest first to the least loaded (fixed for a plan and n)."""
    key = ("split", n)
    if key not in plan.cache:
        loads, parts = [0] * n, [[] for _ in range(n)]
        for ch in plan.chunks_by_cost:
            w = loads.index(min(loads))
            parts[w].append(ch)
            loads[w] += ch.steps * ch.nb * ch.R * ch.C
        plan.cache[key] = parts
    return plan.cache[key]


def _for_each_chunk(plan: _Plan, device: torch.device, make_state, fn, *, deterministic: bool) -> list:
    """Call ``fn(chunk, state)`` for every chunk; return the states.

    On CPU with several torch threads, ``n`` single-threaded workers, one ``make_state()`` each,
    share the chunks: one parallel region per chunk instead of one per small op, which matters on a
    loaded machine where every OpenMP barrier may wait for a descheduled thread. Chunks write
    disjoint query rows; key-side sums go to the worker's own state. ``deterministic``: a fixed
    split (the same sums in the same order on every call) instead of a shared work queue.
    Elsewhere (CUDA, one thread, one chunk) the chunks run in order in the calling thread.
    """
    n = min(torch.get_num_threads(), len(plan.chunks)) if device.type == "cpu" else 1
    if n <= 1:
        state = make_state()
        for ch in plan.chunks:
            fn(ch, state)
        return [state]
    states = [make_state() for _ in range(n)]
    queue = iter(plan.chunks_by_cost)
    lock = threading.Lock()

    def next_chunk():
        with lock:
            return next(queue, None)

    def work(state, mine):
        with torch.no_grad():
            for ch in mine if mine is not None else iter(next_chunk, None):
                fn(ch, state)

    parts = _split(plan, n) if deterministic else [None] * n
    futures = [_pool(n).submit(work, st, part) for st, part in zip(states, parts)]
    for f in futures:
        f.result()
    return states


# ------------------------------------------------------------------------------------ interface
def forward(q, k, v, layout: BlockSparseLayout, *, causal: bool, sm_scale: float):
    """``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32 natural log)``."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    bq, bk = layout.block_size
    Nqp, Nkp = layout.num_q_blocks * bq, layout.num_kv_blocks * bk
    plan = _get_plan(layout, B, Hq, Hkv, causal, q.device)
    dev = q.device

    qu = _q_units(q, plan.heads_per_unit, Nqp, scale=sm_scale * LOG2E)   # [U, Nqp, G, D], base-2 scores
    ku, vu = _kv_units(k, Nkp), _kv_units(v, Nkp)
    out = torch.empty_like(qu)
    lse = torch.empty(qu.shape[:3], dtype=torch.float32, device=dev)
    if plan.has_empty_rows:                             # rows without keys: out 0, lse -inf
        out.zero_()
        lse.fill_(float("-inf"))

    def chunk_fwd(ch: _Chunk, ex: _Exec):
        s = ex.scores(ex.q_steps(qu, ch, ex.buf_q), ex.k_steps(ku, ch, ex.buf_k), ch)
        m = s.amax(dim=-1, keepdim=True)                # [n, M, 1]
        if ch.mask is not None:                         # rows whose keys are all dropped
            m.masked_fill_(m == float("-inf"), 0.0)
        s.sub_(m).exp2_()                               # unnormalised p
        l = s.sum(dim=-1, keepdim=True)
        vs = ex.k_steps(vu, ch, ex.buf_v)
        o = torch.empty(ch.steps, ch.nb, s.shape[1], D, dtype=torch.float32, device=dev)
        for i, (p_i, v_i) in enumerate(zip(s.view(ch.steps, ch.nb, *s.shape[1:]), vs)):
            torch.bmm(p_i, v_i, out=o[i])
        o = o.view(-1, s.shape[1], D).div_(l.clamp(min=1e-30))   # l == 0 only where o == 0
        ex.write_q(out, o, ch)
        ex.write_q(lse, (torch.log2(l).add_(m)).mul_(LN2).squeeze(-1), ch)

    # every output row comes from one chunk, so the queue order does not change the result
    _for_each_chunk(plan, dev, lambda: _Exec(plan, bq, bk, D, dev), chunk_fwd, deterministic=False)
    return _from_q_units(out, B, Hq, Nq).to(q.dtype), _from_q_units(lse, B, Hq, Nq)


def backward(do, q, k, v, out, lse, layout: BlockSparseLayout, *, causal: bool, sm_scale: float):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv summed over each GQA group."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    bq, bk = layout.block_size
    Nqp, Nkp = layout.num_q_blocks * bq, layout.num_kv_blocks * bk
    plan = _get_plan(layout, B, Hq, Hkv, causal, q.device)
    G = plan.heads_per_unit
    dev = q.device

    qu = _q_units(q, G, Nqp, scale=sm_scale * LOG2E)
    dou = _q_units(do, G, Nqp)
    delta = _q_units((do.float() * out.float()).sum(-1), G, Nqp)     # [U, Nqp, G]
    # base-2 lse; rows with no key (-inf) and padded rows get +inf so that p = exp2(s - lse2) = 0
    lse2 = _q_units(lse, G, Nqp, fill=float("inf"), scale=LOG2E)
    lse2.masked_fill_(lse2 == float("-inf"), float("inf"))
    ku, vu = _kv_units(k, Nkp), _kv_units(v, Nkp)
    dq = torch.zeros_like(qu) if plan.has_empty_rows else torch.empty_like(qu)

    def make_state():  # work buffers + this worker's dK/dV sums
        dk_ = torch.zeros(ku.shape[0], Nkp, D, dtype=torch.float32, device=dev)
        return _Exec(plan, bq, bk, D, dev, backward=True), dk_, torch.zeros_like(dk_)

    def chunk_bwd(ch: _Chunk, state):
        ex, dk, dv = state
        qs, dos = ex.q_steps(qu, ch, ex.buf_q), ex.q_steps(dou, ch, ex.buf_do)
        ks, vs = ex.k_steps(ku, ch, ex.buf_k), ex.k_steps(vu, ch, ex.buf_v)
        p = ex.scores(qs, ks, ch)
        n, M, N = p.shape
        p.sub_(ex.q_rows(lse2, ch)).exp2_()
        d_s = ex.buf_dp[:n * M * N].view(ch.steps, ch.nb, M, N)
        dvs = torch.empty(ch.steps, ch.nb, N, D, dtype=torch.float32, device=dev)
        p4 = p.view(ch.steps, ch.nb, M, N)
        for i in range(ch.steps):
            torch.bmm(p4[i].transpose(1, 2), dos[i], out=dvs[i])
            torch.bmm(dos[i], vs[i].transpose(1, 2), out=d_s[i])          # dP
        d_s = d_s.view(n, M, N)
        d_s.sub_(ex.q_rows(delta, ch)).mul_(p)                              # dS (natural units)
        dqs = torch.empty(ch.steps, ch.nb, M, D, dtype=torch.float32, device=dev)
        dks = torch.empty(ch.steps, ch.nb, N, D, dtype=torch.float32, device=dev)
        d_s4 = d_s.view(ch.steps, ch.nb, M, N)
        for i in range(ch.steps):
            torch.bmm(d_s4[i], ks[i], out=dqs[i])
            torch.bmm(d_s4[i].transpose(1, 2), qs[i], out=dks[i])
        ex.write_q(dq, dqs.view(n, M, D), ch)
        ex.add_k(dk, dks.view(n, N, D), ch)
        ex.add_k(dv, dvs.view(n, N, D), ch)

    states = _for_each_chunk(plan, dev, make_state, chunk_bwd, deterministic=True)
    _, dk, dv = states[0]
    for _, dk_i, dv_i in states[1:]:
        dk.add_(dk_i)
        dv.add_(dv_i)
    dq.mul_(sm_scale)
    dk.mul_(LN2)                     # Q carried sm_scale * log2(e); dK needs sm_scale only
    dq = _from_q_units(dq, B, Hq, Nq).to(q.dtype)
    dk = dk[:, :Nk].reshape(B, Hkv, Nk, D).to(k.dtype)
    dv = dv[:, :Nk].reshape(B, Hkv, Nk, D).to(v.dtype)
    return dq, dk, dv
