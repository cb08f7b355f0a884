"""Backend ``"torch"`` of :func:`~sparse_io_attn.selection_attention`: plain PyTorch on any device,
exact (fp32 accumulation) and deterministic (bitwise repeatable), never the dense ``Nq x Nk`` scores.

A **unit** is ``(b, a run of Gu query heads)`` sharing one selection and one KV head: ``Gu =
min(Hq // G, Hq // Hkv)`` (the heads of a selection inside one GQA group), stacked as rows of one
tile. A **row** is ``(unit, query token t)``. K and V are copied once into fp32 key blocks with one
extra all-zero block per KV head, which empty slots and padding read: a block no token selected is
never read. Two shapes of work, both over the plan's normalised lists (distinct blocks, ascending):

* **Query-major** (``block_size < KEY_MAJOR_MIN_BLOCK``: single tokens, micro-blocks): chunks of rows,
  sized to a memory budget, each row gathering the blocks of ``plan.rows`` (``[T, K * block_size,
  D]``: every row copies its keys, fine for small blocks); one softmax per row over all its keys.
* **Key-major** (larger blocks, as MoBA's and FlashMoBA's kernels): the key lists ``plan.keys()``
  cut into **tiles** of up to ``M`` query tokens that chose the same block ``c`` (a block's list
  spans ``ceil(len / M)`` tiles: at most ``pairs / M + segments`` tiles, a bound fixed by the
  shapes), each tile run against every unit of its selection: dense products of ``[M * Gu, D]``
  gathered queries by one ``[block_size, D]`` key block, read once per tile. Forward writes each
  (row, slot) pair's partial result (unnormalised output, max, sum) to its slot and merges a row's
  slots in slot order (ascending block); backward writes each pair's dQ to its slot (summed in slot
  order) and sums dK/dV per tile. The rows run in groups whose slot partials (``K`` per row) fit the
  budget: whole selections, or token ranges of one (a block's token list cut at the range ends);
  tiles in windows sized to the budget. (MoBA-shaped, block 64, K 8: 3-6x faster than query-major
  forward and backward on CPU; blocks of 8 and less run faster query-major.)

Masks per element: keys past ``seqlen_k`` in the ragged last block, causality (``s <= t + delta``)
inside blocks that straddle the diagonal, empty slots and tile padding. Scores in base 2 as every
backend forms them: ``(q . k) * sm_scale * log2(e)`` in fp32, saturated to the finite fp32 range.
``stats = (m, log2 l)`` (``+inf``/``0`` on rows without an allowed key: output 0, lse ``-inf``).

Backward recomputes ``P = exp2((S - m) - log2 l)`` from the forward's ``stats``: ``dS = P * (dO V^T -
delta)`` with ``delta = rowsum(dO * O)``; ``dQ = sm_scale dS K``; ``dK = sm_scale dS^T Q`` and ``dV =
P^T dO``, summed into fp32 ``[B * Hkv * key blocks, block_size * D]`` buffers chunk (window) after
chunk in a fixed order (GQA groups sum there). The sum inside a chunk (:func:`_sum_into`):

* CPU: ``index_add_``, which adds the entries one after the other in order (deterministic).
* other devices (CUDA's ``index_add_`` adds with atomics, in no fixed order): the entries are sorted
  by destination (a stable sort keeps their order), each destination's run is summed by
  ``torch.segment_reduce`` (one thread per output element loops over its run in order) and the sums
  are added by one ``index_add_`` whose destinations are distinct (one add per element: no order to
  vary). :data:`DETERMINISTIC_SUM` selects it on every device (the tests run it on CPU).

No host synchronisation and no NumPy: every size comes from the shapes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sparse_io_attn._attention.delta import row_delta
from sparse_io_attn._attention.sinks import finish_forward
from sparse_io_attn.selection.plan import SelectionPlan

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
FP32_MAX = torch.finfo(torch.float32).max

#: fp32 elements the work tensors of one chunk (query-major) or tile window (key-major) may hold,
#: per device type; other device types get :data:`DEFAULT_CHUNK_ELEMENTS`.
CHUNK_ELEMENTS = {"cpu": 1 << 22}
DEFAULT_CHUNK_ELEMENTS = 1 << 26
#: blocks of at least this many keys run key-major (tiles of gathered queries), smaller ones query-major
KEY_MAJOR_MIN_BLOCK = 16
#: ``"auto"``: the sort-and-segment sum of dK/dV on devices other than the CPU, ``index_add_`` on the
#: CPU; ``True``: the sort-and-segment sum everywhere.
DETERMINISTIC_SUM: bool | str = "auto"


# ------------------------------------------------------------------------------------ shared parts
class _Rows(NamedTuple):
    """How the flat rows ``(unit, token)`` read the plan and K/V."""
    heads: int                 # Gu: query heads per unit
    num_units: int             # U = B * Hq / Gu
    unit_lid: torch.Tensor     # int64 [U]: the selection of each unit
    unit_kv: torch.Tensor      # int64 [U]: the KV head (b * Hkv + j) of each unit


def _rows(plan: SelectionPlan, B: int, Hq: int, Hkv: int) -> _Rows:
    stride_lb, per_selection = plan.head_map(B, Hq, Hkv)
    group = Hq // Hkv
    Gu = min(per_selection, group)   # one divides the other: a selection spans whole groups or lies in one
    U = B * Hq // Gu
    u = torch.arange(U, device=plan.device)
    b, h0 = u // (Hq // Gu), (u % (Hq // Gu)) * Gu
    return _Rows(Gu, U, b * stride_lb + h0 // per_selection, b * Hkv + h0 // group)


def _budget(device: torch.device) -> int:
    return CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS)


def _to_units(x: torch.Tensor, Gu: int) -> torch.Tensor:
    """``[B, Hq, Nq, *tail]`` (any strides, any float dtype) -> fp32 contiguous ``[U * Nq, Gu, *tail]``."""
    B, Hq, Nq = x.shape[:3]
    tail = tuple(x.shape[3:])
    xv = x.reshape(B, Hq // Gu, Gu, Nq, *tail).transpose(2, 3)
    out = torch.empty(xv.shape, dtype=torch.float32, device=x.device)
    out.copy_(xv)
    return out.view(B * (Hq // Gu) * Nq, Gu, *tail)


def _from_units(x: torch.Tensor, B: int, Hq: int, Nq: int) -> torch.Tensor:
    """``[U * Nq, Gu, *tail]`` -> ``[B, Hq, Nq, *tail]``."""
    Gu, tail = x.shape[1], tuple(x.shape[2:])
    return x.view(B, Hq // Gu, Nq, Gu, *tail).transpose(2, 3).reshape(B, Hq, Nq, *tail)


def _key_blocks(x: torch.Tensor, plan: SelectionPlan) -> torch.Tensor:
    """``[B, Hkv, Nk, D]`` -> fp32 ``[B * Hkv * (num_kv_blocks + 1), block_size * D]``: zero past
    each block's keys and one all-zero block (index ``num_kv_blocks``) per KV head for empty slots and
    padding (2-D: ``index_select`` of whole rows runs ~2x faster than of ``[block_size, D]`` slices on
    CPU). With a block table (packed sequences) each block's keys are gathered from where it starts."""
    B, H, Nk, D = x.shape
    bs, nkb = plan.block_size, plan.num_kv_blocks
    out = torch.empty(B * H, (nkb + 1) * bs, D, dtype=torch.float32, device=x.device)
    if plan.table is None or Nk == 0:
        out[:, :Nk].copy_(x.reshape(B * H, Nk, D))
        out[:, Nk:].zero_()
        return out.view(-1, bs * D)
    blocks = torch.arange(nkb, device=x.device)
    j = torch.arange(bs, device=x.device)
    key = (plan.key_start(blocks)[:, None] + j).clamp(max=Nk - 1).reshape(-1)          # [nkb * bs]
    out[:, :nkb * bs].copy_(x.reshape(B * H, Nk, D).index_select(1, key))
    out[:, :nkb * bs].view(B * H, nkb, bs, D).mul_((j < plan.key_count(blocks)[:, None]).to(torch.float32)[..., None])
    out[:, nkb * bs:].zero_()
    return out.view(-1, bs * D)


def _allowed_keys(plan: SelectionPlan, blocks: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """bool ``[*blocks.shape, block_size]``: the keys of ``blocks`` (block numbers, any where ``keep``
    is False) that ``tokens`` (broadcast against ``blocks``) may use: inside the block's keys, not in
    the token's causal future, and ``keep``."""
    b = torch.where(keep, blocks, 0)
    j = torch.arange(plan.block_size, device=blocks.device)
    allowed = keep[..., None] & (j < plan.key_count(b)[..., None])
    if plan.causal_offset is not None:
        allowed &= plan.key_start(b)[..., None] + j <= plan.causal_limit(tokens)[..., None]
    return allowed


def _masked_scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``bmm(q, k^T)`` as base-2 scores, saturated to the finite fp32 range, ``-inf`` where ``allowed``
    is False: the scores viewed as ``[*allowed.shape[:-2], -1, allowed.shape[-1]]`` (``[T, Gu, keys]``
    query-major, ``[n, M, Gu, block_size]`` key-major), ``allowed`` broadcast over the heads. Every
    score of both paths, forward and backward, is formed here."""
    s = torch.bmm(q, k.transpose(1, 2)).view(*allowed.shape[:-2], -1, allowed.shape[-1])
    s.mul_(sm_scale * LOG2E).clamp_(-FP32_MAX, FP32_MAX)
    return s.masked_fill_(~allowed, float("-inf"))


def _sum_into(dst: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, spare: int) -> None:
    """``dst[ids[i]] += vals[i]`` for every ``i``, deterministically (see the module docstring);
    ``spare``: a row of ``dst`` that is thrown away (it may take zeros in any order)."""
    if DETERMINISTIC_SUM == "auto" and dst.device.type == "cpu":
        dst.index_add_(0, ids, vals)
        return
    n = ids.numel()
    dest, order = torch.sort(ids, stable=True)
    vals = vals.index_select(0, order)
    start = torch.ones(n, dtype=torch.bool, device=ids.device)
    start[1:] = dest[1:] != dest[:-1]
    run = torch.cumsum(start, 0) - 1                                   # the run (destination) of each entry
    end = torch.searchsorted(run, torch.arange(n, device=ids.device), right=True)   # entries in runs <= r
    begin = torch.cat([end.new_zeros(1), end[:-1]])
    lengths = end - begin                                              # runs past the last: length 0, sum 0
    sums = torch.segment_reduce(vals, "sum", lengths=lengths, unsafe=True)
    target = torch.where(lengths > 0, dest[begin.clamp(max=n - 1)], spare)     # distinct, but spare
    dst.index_add_(0, target, sums)


def _stats_rows(m: torch.Tensor, l: torch.Tensor):
    """Row maximum ``m`` and sum ``l`` (``m = -inf``, ``l = 0`` on rows without a key) ->
    ``(lse, row_max, log2_sum)``: natural-log lse (``-inf`` on empty rows) and the stats (``+inf``/``0``)."""
    empty = m == float("-inf")
    log2l = torch.log2(l)
    return (m + log2l) * LN2, m.masked_fill(empty, float("inf")), log2l.masked_fill(empty, 0.0)


# ----------------------------------------------------------------------------------- query-major
def _query_chunk_rows(plan: SelectionPlan, Gu: int, D: int, device: torch.device) -> int:
    """Rows per chunk: the budget over a backward row's work tensors (forward uses the same chunks)."""
    keys = plan.max_blocks * plan.block_size
    return max(1, _budget(device) // (2 * Gu * keys + 4 * keys * D + 4 * Gu * D))


class _Chunk(NamedTuple):
    ids: torch.Tensor       # int64 [T * K]: the block each (row, slot) reads in the padded key blocks
    allowed: torch.Tensor   # bool [T, 1, K * block_size]: the keys each row may use


def _query_chunk(plan: SelectionPlan, rows: _Rows, r0: int, r1: int) -> _Chunk:
    """What rows ``[r0, r1)`` read: their blocks (empty slots: the zero block) and allowed keys."""
    bs, nkb, (Nq, Nk), K = plan.block_size, plan.num_kv_blocks, plan.seqlen, plan.max_blocks
    f = torch.arange(r0, r1, device=plan.device)
    u, t = f // Nq, f % Nq
    blocks = plan.rows.view(-1, K).index_select(0, rows.unit_lid[u] * Nq + t).to(torch.int64)   # [T, K]
    empty = blocks < 0
    ids = (rows.unit_kv[u, None] * (nkb + 1) + torch.where(empty, nkb, blocks)).reshape(-1)
    allowed = _allowed_keys(plan, blocks, t[:, None], ~empty)                                    # [T, K, bs]
    return _Chunk(ids, allowed.view(r1 - r0, 1, K * bs))


def _forward_query_major(qu, kb, vb, plan, rows, sm_scale, out, lse, row_max, log2_sum):
    NR, Gu, D = qu.shape
    K, bs, Dv = plan.max_blocks, plan.block_size, out.shape[-1]
    step = _query_chunk_rows(plan, Gu, max(D, Dv), qu.device)
    for r0 in range(0, NR, step):
        r1 = min(r0 + step, NR)
        ch = _query_chunk(plan, rows, r0, r1)
        s = _masked_scores(qu[r0:r1], kb.index_select(0, ch.ids).view(r1 - r0, K * bs, D), ch.allowed, sm_scale)
        m = s.amax(dim=-1, keepdim=True)                                     # [T, Gu, 1]
        p = s.sub_(m.masked_fill(m == float("-inf"), 0.0)).exp2_()
        l = p.sum(dim=-1, keepdim=True)                                      # >= 1 unless the row is empty
        torch.bmm(p, vb.index_select(0, ch.ids).view(r1 - r0, K * bs, Dv), out=out[r0:r1])
        out[r0:r1].div_(l.clamp(min=1.0))
        lse[r0:r1], row_max[r0:r1], log2_sum[r0:r1] = (x.squeeze(-1) for x in _stats_rows(m, l))


def _backward_query_major(qu, dou, delta, row_max, log2_sum, kb, vb, plan, rows, sm_scale, dq, dk, dv):
    NR, Gu, D = qu.shape
    K, bs, nkb, Dv = plan.max_blocks, plan.block_size, plan.num_kv_blocks, dou.shape[-1]
    step = _query_chunk_rows(plan, Gu, max(D, Dv), qu.device)
    for r0 in range(0, NR, step):
        r1 = min(r0 + step, NR)
        T = r1 - r0
        ch = _query_chunk(plan, rows, r0, r1)
        kc = kb.index_select(0, ch.ids).view(T, K * bs, D)
        vc = vb.index_select(0, ch.ids).view(T, K * bs, Dv)
        qc, doc = qu[r0:r1], dou[r0:r1]
        p = _masked_scores(qc, kc, ch.allowed, sm_scale)
        p.sub_(row_max[r0:r1, :, None]).sub_(log2_sum[r0:r1, :, None]).exp2_()    # 0 on empty rows
        ds = torch.bmm(doc, vc.transpose(1, 2))                                     # dP
        ds.sub_(delta[r0:r1, :, None]).mul_(p)                                       # dS (natural units)
        torch.bmm(ds, kc, out=dq[r0:r1])
        _sum_into(dk, ch.ids, torch.bmm(ds.transpose(1, 2), qc).view(T * K, bs * D), spare=nkb)
        _sum_into(dv, ch.ids, torch.bmm(p.transpose(1, 2), doc).view(T * K, bs * Dv), spare=nkb)


# ------------------------------------------------------------------------------------- key-major
class _Group(NamedTuple):
    """Rows of selections ``[l0, l1)`` (every unit of each) and tokens ``[t0, t1)``: what one set of
    slot partials holds."""
    l0: int
    l1: int
    t0: int
    t1: int
    rows: torch.Tensor      # int64 [R]: the global row (unit * Nq + t) of each group row, in group order


def _groups(plan: SelectionPlan, units_of: torch.Tensor, Gu: int, D: int, device):
    """Groups of rows whose slot partials (``K`` outputs per row) fit the budget: whole selections
    when one fits, else token ranges of one selection (at least one token)."""
    L, (Nq, _), K = plan.num_layouts, plan.seqlen, plan.max_blocks
    n_ul = units_of.shape[1]
    fit = max(1, _budget(device) // (K * Gu * (D + 2)))            # (unit, token) rows per group
    lg, span = (min(L, max(1, fit // (n_ul * Nq))), Nq) if n_ul * Nq <= fit else (1, max(1, fit // n_ul))
    for l0 in range(0, L, lg):
        l1 = min(l0 + lg, L)
        for t0 in range(0, Nq, span):
            t1 = min(t0 + span, Nq)
            t = torch.arange(t0, t1, device=device)
            yield _Group(l0, l1, t0, t1, (units_of[l0:l1].reshape(-1, 1) * Nq + t).reshape(-1))


def _tile_rows(plan: SelectionPlan, tokens: int) -> int:
    """``M``: query tokens per tile, near the mean tokens per key block of ``tokens`` rows (8 .. 64)."""
    mean = tokens * plan.max_blocks / max(plan.num_kv_blocks, 1)
    return min(64, max(8, 1 << max(0, math.ceil(mean) - 1).bit_length()))


def _pair_keys(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [L * Nq * K]``: ``(l * num_kv_blocks + c) * Nq + t`` of each entry of the key lists
    (ascending: the lists are sorted by ``(l, c)``, tokens ascending), the largest key past the last."""
    keys, Nq = plan.keys(), plan.seqlen[0]
    S = plan.num_layouts * plan.num_kv_blocks
    pos = torch.arange(keys.col_query.numel(), device=plan.device)
    seg = torch.searchsorted(keys.col_ptr[:, 1:].contiguous().view(-1).to(torch.int64), pos, right=True)
    return torch.where(seg < S, seg * Nq + keys.col_query.to(torch.int64), S * Nq)


class _Tiles(NamedTuple):
    """The items of one group: a tile (up to ``M`` of the group's tokens that chose block ``c``) x a
    unit of its selection. Padding rows have token ``-1``; tiles past the last read the zero block."""
    block: torch.Tensor     # int64 [I]: the key block read, in the padded key blocks
    allowed: torch.Tensor   # bool [TB, M, 1, block_size]: the keys each tile row may use (item i: tile i // units)
    units: int              # items per tile: the units of a selection
    qrow: torch.Tensor      # int64 [I, M]: the row (unit * Nq + t) of each tile row; U * Nq for padding
    dest: torch.Tensor      # int64 [I * M]: (group row) * K + slot of each tile row; the spare slot for padding

    def item_allowed(self, a: int, b: int) -> torch.Tensor:
        """``allowed`` of items ``[a, b)``: ``[b - a, M, 1, block_size]``."""
        return self.allowed.index_select(0, torch.arange(a, b, device=self.block.device) // self.units)


def _tiles(plan: SelectionPlan, rows: _Rows, units_of: torch.Tensor, pair_keys: torch.Tensor, g: _Group,
           M: int) -> _Tiles:
    """The tiles of group ``g`` from the key lists: tensor operations sized by the shapes."""
    keys = plan.keys()
    (Nq, Nk), K, bs, nkb = plan.seqlen, plan.max_blocks, plan.block_size, plan.num_kv_blocks
    dev = plan.device
    lg, span, n_ul = g.l1 - g.l0, g.t1 - g.t0, units_of.shape[1]
    S, cap = lg * nkb, lg * span * K                                         # segments (l, c), pairs at most
    seg_ids = torch.arange(g.l0 * nkb, g.l1 * nkb, device=dev)
    first = torch.searchsorted(pair_keys, seg_ids * Nq + g.t0)              # each segment's tokens in [t0, t1)
    count = torch.searchsorted(pair_keys, seg_ids * Nq + g.t1) - first
    count_end = torch.cumsum(count, 0)
    tiles = (count + M - 1) // M
    tile_end = torch.cumsum(tiles, 0)
    TB = -(-cap // M) + S                                                     # tiles, at most
    j = torch.arange(cap, device=dev)                                         # the group's pairs, in order
    seg = torch.searchsorted(count_end, j, right=True).clamp(max=S - 1)
    rank = j - (count_end - count)[seg]                                       # place in the segment's part
    spot = torch.where(j < count_end[-1], (tile_end - tiles)[seg] * M + rank, TB * M)
    src = (first[seg] + rank).clamp(max=keys.col_query.numel() - 1)
    token = torch.full((TB * M + 1,), -1, dtype=torch.int64, device=dev)
    token = token.scatter_(0, spot, keys.col_query[src].to(torch.int64))[:-1].view(TB, 1, M)
    slot = torch.zeros(TB * M + 1, dtype=torch.int64, device=dev)
    slot = slot.scatter_(0, spot, keys.col_slot[src].to(torch.int64))[:-1].view(TB, 1, M)
    tseg = torch.searchsorted(tile_end, torch.arange(TB, device=dev), right=True)   # S past the last tile
    lid, c = (tseg // nkb).clamp(max=lg - 1), tseg % nkb
    unit = units_of[g.l0 + lid]                                               # [TB, n_ul]
    local = lid[:, None] * n_ul + torch.arange(n_ul, device=dev)              # the unit's place in the group
    block = rows.unit_kv[unit] * (nkb + 1) + torch.where(tseg < S, c, nkb)[:, None]
    pad = token < 0
    qrow = torch.where(pad, rows.num_units * Nq, unit[:, :, None] * Nq + token)              # [TB, n_ul, M]
    dest = torch.where(pad, lg * n_ul * span * K, (local[:, :, None] * span + token - g.t0) * K + slot)
    allowed = _allowed_keys(plan, c[:, None].expand(TB, M), token[:, 0].clamp(min=0), ~pad[:, 0])   # [TB, M, bs]
    I = TB * n_ul
    return _Tiles(block.reshape(I), allowed.view(TB, M, 1, bs), n_ul, qrow.reshape(I, M), dest.reshape(I * M))


def _key_major_work(plan: SelectionPlan, rows: _Rows, D: int, device, per_item: int):
    """``(group, tiles, window)`` for each group of rows: its tiles and the items per window."""
    L = plan.num_layouts
    units_of = torch.argsort(rows.unit_lid, stable=True).view(L, rows.num_units // L)   # each selection's units
    pair_keys = _pair_keys(plan)
    for g in _groups(plan, units_of, rows.heads, D, device):
        M = _tile_rows(plan, g.t1 - g.t0)
        yield g, _tiles(plan, rows, units_of, pair_keys, g, M), max(1, _budget(device) // (per_item * M))


def _forward_key_major(qu, kb, vb, plan, rows, sm_scale, out, lse, row_max, log2_sum):
    NR, Gu, D = qu.shape
    K, bs, Dv = plan.max_blocks, plan.block_size, out.shape[-1]
    dev = qu.device
    qpad = torch.cat([qu.view(NR, Gu * D), qu.new_zeros(1, Gu * D)])          # row NR: padding
    per_item = Gu * D + 2 * Gu * Dv + 3 * Gu * bs + bs * (D + Dv)               # per tile row
    for g, tiles, window in _key_major_work(plan, rows, Dv, dev, per_item):
        R = g.rows.numel()
        o_part = torch.zeros(R * K + 1, Gu * Dv, dtype=torch.float32, device=dev)         # spare slot last
        m_part = torch.full((R * K + 1, Gu), float("-inf"), dtype=torch.float32, device=dev)
        l_part = torch.zeros(R * K + 1, Gu, dtype=torch.float32, device=dev)
        M = tiles.qrow.shape[1]
        for a in range(0, tiles.block.numel(), window):
            b = min(a + window, tiles.block.numel())
            n = b - a
            qt = qpad.index_select(0, tiles.qrow[a:b].reshape(-1)).view(n, M * Gu, D)
            kt = kb.index_select(0, tiles.block[a:b]).view(n, bs, D)
            s = _masked_scores(qt, kt, tiles.item_allowed(a, b), sm_scale)      # [n, M, Gu, bs]
            m = s.amax(dim=-1, keepdim=True)                                  # [n, M, Gu, 1]
            p = s.sub_(m.masked_fill(m == float("-inf"), 0.0)).exp2_()
            o = torch.bmm(p.view(n, M * Gu, bs), vb.index_select(0, tiles.block[a:b]).view(n, bs, Dv))
            dest = tiles.dest[a * M:b * M]
            o_part.index_copy_(0, dest, o.view(n * M, Gu * Dv))
            m_part.index_copy_(0, dest, m.view(n * M, Gu))
            l_part.index_copy_(0, dest, p.sum(dim=-1).view(n * M, Gu))
        # merge each row's slots, in slot order (ascending key block)
        mp = m_part[:-1].view(R, K, Gu)
        m = mp.amax(dim=1)                                                     # [R, Gu]
        w = torch.exp2(mp - m.masked_fill(m == float("-inf"), 0.0)[:, None])   # 0 on empty slots
        l = (w * l_part[:-1].view(R, K, Gu)).sum(dim=1)                        # >= 1 unless the row is empty
        o = (w[..., None] * o_part[:-1].view(R, K, Gu, Dv)).sum(dim=1).div_(l.clamp(min=1.0)[..., None])
        out.index_copy_(0, g.rows, o)
        for dst, val in zip((lse, row_max, log2_sum), _stats_rows(m, l)):
            dst.index_copy_(0, g.rows, val)


def _backward_key_major(qu, dou, delta, row_max, log2_sum, kb, vb, plan, rows, sm_scale, dq, dk, dv):
    NR, Gu, D = qu.shape
    K, bs, nkb, Dv = plan.max_blocks, plan.block_size, plan.num_kv_blocks, dou.shape[-1]
    dev = qu.device
    pad = lambda x, fill: torch.cat([x.reshape(NR, -1), x.new_full((1, x[0].numel()), fill)])  # noqa: E731
    qpad, dopad = pad(qu, 0.0), pad(dou, 0.0)
    m_pad, l2_pad, delta_pad = pad(row_max, float("inf")), pad(log2_sum, 0.0), pad(delta, 0.0)
    per_item = 2 * Gu * (D + Dv) + 3 * Gu * bs + 2 * bs * (D + Dv)
    for g, tiles, window in _key_major_work(plan, rows, D, dev, per_item):
        R = g.rows.numel()
        dq_part = torch.zeros(R * K + 1, Gu * D, dtype=torch.float32, device=dev)
        M = tiles.qrow.shape[1]
        for a in range(0, tiles.block.numel(), window):
            b = min(a + window, tiles.block.numel())
            n = b - a
            qrow = tiles.qrow[a:b].reshape(-1)
            qt = qpad.index_select(0, qrow).view(n, M * Gu, D)
            dot = dopad.index_select(0, qrow).view(n, M * Gu, Dv)
            kt = kb.index_select(0, tiles.block[a:b]).view(n, bs, D)
            vt = vb.index_select(0, tiles.block[a:b]).view(n, bs, Dv)
            p = _masked_scores(qt, kt, tiles.item_allowed(a, b), sm_scale)      # [n, M, Gu, bs]
            row = lambda x: x.index_select(0, qrow).view(n, M, Gu, 1)  # noqa: E731
            p.sub_(row(m_pad)).sub_(row(l2_pad)).exp2_()                           # 0 on padding, empty rows
            ds = torch.bmm(dot, vt.transpose(1, 2)).view(n, M, Gu, bs)             # dP
            ds.sub_(row(delta_pad)).mul_(p)                                         # dS (natural units)
            ds, p = ds.view(n, M * Gu, bs), p.view(n, M * Gu, bs)
            dq_part.index_copy_(0, tiles.dest[a * M:b * M], torch.bmm(ds, kt).view(n * M, Gu * D))
            _sum_into(dk, tiles.block[a:b], torch.bmm(ds.transpose(1, 2), qt).view(n, bs * D), spare=nkb)
            _sum_into(dv, tiles.block[a:b], torch.bmm(p.transpose(1, 2), dot).view(n, bs * Dv), spare=nkb)
        dq.index_copy_(0, g.rows, dq_part[:-1].view(R, K, Gu, D).sum(dim=1))     # slot order


# ------------------------------------------------------------------------------------ the backend
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SelectionPlan, *, sm_scale: float,
            sinks: torch.Tensor | None = None, residual: bool = False):
    """``(out [B, Hq, Nq, D] in q's dtype, lse fp32 [B, Hq, Nq] natural log, stats fp32 [2, B, Hq, Nq])``
    (see the module docstring and :mod:`sparse_io_attn.selection.api`), and with ``residual=True`` the
    output's rounding residual (:mod:`sparse_io_attn._attention.delta`) as a fourth result. ``sinks``:
    one sink logit per query head, folded into the fp32 results (:mod:`sparse_io_attn._attention.sinks`)."""
    B, Hq, Nq, D = q.shape
    rows = _rows(plan, B, Hq, k.shape[1])
    Gu, NR, dev = rows.heads, rows.num_units * Nq, q.device
    out = torch.zeros(NR, Gu, v.shape[3], dtype=torch.float32, device=dev)
    lse = torch.full((NR, Gu), float("-inf"), dtype=torch.float32, device=dev)
    row_max = torch.full((NR, Gu), float("inf"), dtype=torch.float32, device=dev)
    log2_sum = torch.zeros(NR, Gu, dtype=torch.float32, device=dev)
    if NR and plan.max_blocks:
        run = _forward_key_major if plan.block_size >= KEY_MAJOR_MIN_BLOCK else _forward_query_major
        run(_to_units(q, Gu), _key_blocks(k, plan), _key_blocks(v, plan), plan, rows, sm_scale,
            out, lse, row_max, log2_sum)
    return finish_forward(*(_from_units(x, B, Hq, Nq) for x in (out, lse, row_max, log2_sum)), q.dtype, sinks,
                          residual)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             stats: torch.Tensor, plan: SelectionPlan, *, sm_scale: float, delta: torch.Tensor | None = None):
    """``(dq, dk, dv)`` in the inputs' dtypes, dk/dv summed over each GQA group (see the module
    docstring): ``P`` recomputed from the forward's ``stats``; deterministic on every device.
    ``delta``: fp32 ``[B, Hq, Nq]`` row deltas formed by the caller (from the forward's fp32 output:
    :mod:`sparse_io_attn._attention.delta`), else ``rowsum(do * out)``."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    rows = _rows(plan, B, Hq, Hkv)
    Gu, NR, dev = rows.heads, rows.num_units * Nq, q.device
    bs, nkb = plan.block_size, plan.num_kv_blocks
    dq = torch.zeros(NR, Gu, D, dtype=torch.float32, device=dev)
    dk = torch.zeros(B * Hkv * (nkb + 1), bs * D, dtype=torch.float32, device=dev)
    dv = torch.zeros(B * Hkv * (nkb + 1), bs * Dv, dtype=torch.float32, device=dev)
    if NR and plan.max_blocks:
        delta = _to_units(row_delta(do, out, None) if delta is None else delta, Gu)      # [NR, Gu]
        run = _backward_key_major if bs >= KEY_MAJOR_MIN_BLOCK else _backward_query_major
        run(_to_units(q, Gu), _to_units(do, Gu), delta, _to_units(stats[0], Gu), _to_units(stats[1], Gu),
            _key_blocks(k, plan), _key_blocks(v, plan), plan, rows, sm_scale, dq, dk, dv)
    dq.mul_(sm_scale)
    dk.mul_(sm_scale)
    return (_from_units(dq, B, Hq, Nq).to(q.dtype), _key_rows(dk, plan, B, Hkv, Nk).to(k.dtype),
            _key_rows(dv, plan, B, Hkv, Nk).to(v.dtype))


def _key_rows(x: torch.Tensor, plan: SelectionPlan, B: int, Hkv: int, Nk: int) -> torch.Tensor:
    """Per-block sums ``[B * Hkv * (num_kv_blocks + 1), block_size * D]`` -> ``[B, Hkv, Nk, D]`` (the
    inverse of :func:`_key_blocks`; keys of no block get 0)."""
    bs, nkb = plan.block_size, plan.num_kv_blocks
    blocks = x.view(B * Hkv, nkb + 1, bs, -1)[:, :nkb]
    if plan.table is None:
        return blocks.reshape(B, Hkv, nkb * bs, -1)[:, :, :Nk]
    g = torch.arange(nkb, device=x.device)
    j = torch.arange(bs, device=x.device)
    used = (j < plan.key_count(g)[:, None]).reshape(-1)
    key = torch.where(used, (plan.key_start(g)[:, None] + j).reshape(-1), Nk)             # spare row Nk
    out = x.new_zeros(B * Hkv, Nk + 1, x.shape[-1] // bs)
    out.index_add_(1, key, blocks.reshape(B * Hkv, nkb * bs, -1))   # distinct keys: one add each (the spare aside)
    return out[:, :Nk].view(B, Hkv, Nk, -1)


__all__ = ["backward", "forward"]
