"""Host plans of the PyTorch backend: which chunks of matmuls compute an attention plan (see the
package docstring).

A host plan depends only on the :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan` (its lists,
in which causally dead blocks are already dropped), ``(B, Hq, Hkv)`` and the device; :func:`get_plan`
builds it once and keeps it in the attention plan (:meth:`~sparse_io_attn.block_sparse.plan.AttentionPlan.derived`).
A chunk reads only blocks its rows keep; elements to drop inside them (key padding, the causal
diagonal, the element masks of partial blocks) are set to ``-inf`` through the chunk's ``mask``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparse_io_attn.block_sparse.plan import AttentionPlan
from sparse_io_attn.layout import _bits

SCORE_BUDGET = 1 << 20
# Query rows (x stacked heads) a matmul should reach when rows with the same keys can be stacked:
# M >= 256 runs ~15% faster than M = 64 on CPU.
MIN_ROWS_M = 256


# ------------------------------------------------------------------------------------------ plan
@dataclass
class _Task:
    units: tuple[int, ...]
    rows: tuple[int, ...]   # query blocks, stacked into one matmul
    cols: tuple[int, ...]   # key blocks read for these rows (kept by every one of them)
    pids: tuple[int, ...] = ()  # per col, the partial-mask id shared by the rows (-1: full block)


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
    ``masks``: ``(cols, bias)`` pairs, one per run of consecutive key blocks with something to
    drop; ``bias`` float32 ``[nb or 1, R*BLOCK_SIZE_Q, 1, len(cols)]`` (``-inf`` = drop, else 0)
    is added to score columns ``cols`` (a slice; an add runs ~5x faster than ``masked_fill_``
    with a broadcast boolean mask on CPU). Full blocks between the runs are never touched.
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
    masks: list = field(default_factory=list)


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


def _unit_maps(layout: AttentionPlan, B: int, Hq: int, Hkv: int):
    """``(U, heads_per_unit, layout_index[U], kv_unit[U])``."""
    stride_lb, stride_lh = layout.layout_strides(B, Hq)
    group = Hq // Hkv
    if layout.layout_heads == 1:
        U = B * Hkv
        return U, group, [(u // Hkv) * stride_lb for u in range(U)], list(range(U))
    U = B * Hq
    lidx = [(u // Hq) * stride_lb + (u % Hq) * stride_lh for u in range(U)]
    return U, 1, lidx, [(u // Hq) * Hkv + (u % Hq) // group for u in range(U)]


def _row_lists(layout: AttentionPlan, l: int, delta: int | None) -> list[tuple[tuple[int, int], ...]]:
    """Kept ``(key block, partial id)`` pairs of each query-block row of mask ``l``, by key block: the
    plan's full and partial lists (blocks with no allowed element after causality are not in them)."""
    R = layout.num_q_blocks
    out = [[] for _ in range(R)]
    lists = layout.rows
    for ptr, idx, pid in ((lists.full_ptr, lists.full_idx, None), (lists.part_ptr, lists.part_idx, lists.part_mask)):
        starts = ptr[l].tolist()
        cols = idx[starts[0]:starts[-1]].tolist()
        pids = pid[starts[0]:starts[-1]].tolist() if pid is not None else [-1] * len(cols)
        base = starts[0]
        for r in range(R):
            out[r] += zip(cols[starts[r] - base:starts[r + 1] - base], pids[starts[r] - base:starts[r + 1] - base])
    return [tuple(sorted(pairs)) for pairs in out]


def _contiguous(ids) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def _arith(xs) -> int | None:
    """The common step of an arithmetic sequence, or None."""
    if len(xs) < 2:
        return 0
    d = xs[1] - xs[0]
    return d if all(b - a == d for a, b in zip(xs, xs[1:])) else None


def _tasks(layout: AttentionPlan, units_of: dict, G: int, delta: int | None) -> tuple[list[_Task], bool]:
    """Rows with identical kept blocks and element masks (merged across masks), split to fit the
    score budget; and whether some row keeps no key block."""
    bq, bk = layout.block_size
    by_cols: dict[tuple, dict[int, list[int]]] = {}   # (col, pid) pairs -> row -> units
    has_empty = False
    for l, units in units_of.items():
        for r, pairs in enumerate(_row_lists(layout, l, delta)):
            if pairs:
                by_cols.setdefault(pairs, {}).setdefault(r, []).extend(units)
            else:
                has_empty = True
    tasks = []
    for pairs, row_units in by_cols.items():
        cols = tuple(c for c, _ in pairs)
        pids = tuple(p for _, p in pairs)
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
            tasks += [_Task(units, tuple(p), cols, pids) for p in pieces]
    return tasks, has_empty


def _drop_mask(t: _Task, layout: AttentionPlan, delta: int | None):
    """bool ``[len(rows)*bq, len(cols)*bk]`` (True = drop: key padding, causal ``j > i + delta``,
    an element a partial block's mask removes), or None if nothing is dropped."""
    bq, bk = layout.block_size
    qpos = (torch.tensor(t.rows).view(-1, 1) * bq + torch.arange(bq)).view(-1)
    kpos = (torch.tensor(t.cols).view(-1, 1) * bk + torch.arange(bk)).view(-1)
    drop = (kpos >= layout.seqlen_k).view(1, -1).expand(qpos.numel(), -1)
    if delta is not None:
        drop = drop | (kpos.view(1, -1) > qpos.view(-1, 1) + delta)
    if any(p >= 0 for p in t.pids):
        masks = layout.masks.cpu()
        allowed = torch.stack([_bits.unpack(masks[p], bk) if p >= 0 else torch.ones(bq, bk, dtype=torch.bool)
                               for p in t.pids], dim=1).view(bq, -1)       # [bq, cols*bk]
        drop = drop | ~allowed.repeat(len(t.rows), 1)
    return drop if bool(drop.any()) else None


def _set_mask(ch: _Chunk, items: list, layout: AttentionPlan, delta: int | None) -> None:
    """``items``: the task of each item (or one task shared by all items)."""
    bk = layout.BLOCK_SIZE_KV
    memo: dict[int, torch.Tensor | None] = {}
    masks = [memo[id(t)] if id(t) in memo else memo.setdefault(id(t), _drop_mask(t, layout, delta))
             for t in items]
    if all(m is None for m in masks):
        return
    hit = torch.zeros(ch.C, dtype=torch.bool)
    for m in masks:
        if m is not None:
            hit |= m.view(m.shape[0], ch.C, bk).any(dim=2).any(dim=0)
    cols = hit.nonzero().view(-1).tolist()
    runs = []                                   # consecutive block columns with something to drop
    for c in cols:
        if runs and c == runs[-1][1]:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    for a, b in runs:
        sl = slice(a * bk, b * bk)
        sub = [m[:, sl] if m is not None else None for m in masks]
        like = next(m for m in sub if m is not None)
        drop = torch.stack([m if m is not None else torch.zeros_like(like) for m in sub]).unsqueeze(2)
        if drop.shape[0] > 1 and all(torch.equal(drop[0], d) for d in drop[1:]):
            drop = drop[:1]                     # the same drop mask for every item
        ch.masks.append((sl, torch.zeros(drop.shape).masked_fill_(drop, float("-inf"))))


def _build_plan(layout: AttentionPlan, B: int, Hq: int, Hkv: int, delta: int | None,
                device: torch.device) -> _Plan:
    bq, bk = layout.block_size
    nqb, nkb = layout.num_q_blocks, layout.num_kv_blocks
    U, G, lidx, kv_unit = _unit_maps(layout, B, Hq, Hkv)
    units_of: dict[int, list[int]] = {}
    for u, l in enumerate(lidx):
        units_of.setdefault(l, []).append(u)

    viewable, gathered = {}, {}
    tasks, has_empty = _tasks(layout, units_of, G, delta)
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
                    _set_mask(ch, [t0], layout, delta)
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
                _set_mask(ch, run, layout, delta)
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
            _set_mask(ch, [t for _, t in (part[:1] if same else part)], layout, delta)
            chunks.append(ch)

    for ch in chunks:
        for name in ("q_idx", "k_idx"):
            t = getattr(ch, name)
            if t is not None:
                setattr(ch, name, t.to(device))
        ch.masks = [(sl, bias.to(device)) for sl, bias in ch.masks]
    max_scores = max((ch.steps * ch.nb * G * ch.R * bq * ch.C * bk for ch in chunks), default=0)
    max_q = max((ch.steps * ch.nb * ch.R * bq for ch in chunks), default=0)
    max_k = max((ch.steps * ch.nb * ch.C * bk for ch in chunks), default=0)
    by_cost = sorted(chunks, key=lambda ch: -(ch.steps * ch.nb * ch.R * ch.C))
    return _Plan(U, G, chunks, max_scores, max_q, max_k, has_empty, by_cost)


def get_plan(layout: AttentionPlan, B: int, Hq: int, Hkv: int, device: torch.device) -> _Plan:
    """The host plan for these shapes, built on first use and kept in the attention plan."""
    return layout.derived(("torch_path", B, Hq, Hkv, str(device)),
                          lambda: _build_plan(layout.to("cpu"), B, Hq, Hkv, layout.causal_offset, device))
