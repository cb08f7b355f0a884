"""Backend ``"torch"`` of :func:`~sparse_io_attn.selection_attention`: plain PyTorch on any device,
exact (fp32 accumulation) and deterministic (bitwise repeatable).

Query-major, in chunks of query rows sized to a memory budget; never the dense ``Nq x Nk`` scores:

* A **unit** is ``(b, a run of Gu query heads)`` sharing one selection and one KV head:
  ``Gu = min(Hq // G, Hq // Hkv)`` (the heads of a selection inside one GQA group), stacked as the
  rows of one tile. A **row** is ``(unit, query token t)``; rows are flat, unit-major, and a chunk
  is a contiguous range of them (it may span units).
* Each row gathers the key blocks of its normalised selection (``plan.rows``: distinct, ascending,
  ``-1`` after) from a zero-padded copy of K/V cut into blocks, with one extra all-zero block per KV
  head that empty slots read: a block the row did not select is never read. Scores ``[T, Gu,
  K * block_size]`` by one batched matmul, masked per element: empty slots, keys past ``seqlen_k``
  in the ragged last block, and causality (``s <= t + delta``) inside blocks that straddle the
  diagonal.
* Scores in base 2 as every backend forms them: ``(q . k) * sm_scale * log2(e)`` in fp32, saturated
  to the finite fp32 range; each row's softmax is exact in one step (its keys are all in the tile).
  ``stats = (m, log2 l)``, ``+inf``/``0`` on rows without an allowed key (output 0, lse ``-inf``).

Backward recomputes ``P = exp2((S - m) - log2 l)`` from the forward's ``stats`` on the same chunks:
``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``; ``dQ = sm_scale dS K`` per row (each
row in one chunk: no reduction across chunks); ``dK = sm_scale dS^T Q`` and ``dV = P^T dO`` per
(row, slot) pair, summed into fp32 ``[B * Hkv, key blocks, block_size, D]`` buffers chunk after
chunk, in the chunks' fixed order (GQA groups sum there). The sum inside a chunk:

* CPU: ``index_add_``, which adds the pairs one after the other in pair order (deterministic).
* other devices (CUDA ``index_add_`` adds with atomics, in no fixed order): the pairs are sorted by
  destination block (a stable sort, so each destination keeps the pairs' order), each destination's
  run is summed by ``torch.segment_reduce`` (one thread per output element loops over its run in
  order), and the per-destination sums are added with one ``index_add_`` whose destinations are
  distinct (one add per element: no order to vary). :data:`DETERMINISTIC_SUM` selects it
  everywhere (what the tests use to run this path on CPU).

No host synchronisation, no NumPy: every size comes from the shapes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sparse_io_attn.selection.plan import SelectionPlan

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
FP32_MAX = torch.finfo(torch.float32).max

#: fp32 elements the work tensors of one chunk may hold, per device type (a row costs about
#: ``2 * Gu * K * block_size`` scores and ``4 * K * block_size * D`` gathered keys, values and
#: their gradients); other device types get :data:`DEFAULT_CHUNK_ELEMENTS`.
CHUNK_ELEMENTS = {"cpu": 1 << 22}
DEFAULT_CHUNK_ELEMENTS = 1 << 26
#: ``"auto"``: the sort-and-segment sum of dK/dV on devices other than the CPU, ``index_add_`` on the
#: CPU; ``True``: the sort-and-segment sum everywhere.
DETERMINISTIC_SUM: bool | str = "auto"


class _Rows(NamedTuple):
    """How the flat rows ``(unit, token)`` read the plan and K/V."""
    heads: int                 # Gu: query heads per unit
    num_units: int             # U = B * Hq / Gu
    row_index: torch.Tensor    # int64 [U * Nq]: the row of plan.rows.view(L * Nq, K) serving each row
    kv_base: torch.Tensor      # int64 [U * Nq]: first block of the row's KV head in the padded key blocks
    token: torch.Tensor        # int64 [U * Nq]: the query token t


def _rows(plan: SelectionPlan, B: int, Hq: int, Hkv: int) -> _Rows:
    stride_lb, per_selection = plan.head_map(B, Hq, Hkv)
    group = Hq // Hkv
    Gu = min(per_selection, group)   # one divides the other: a selection spans whole groups or lies in one
    U = B * Hq // Gu
    Nq = plan.seqlen[0]
    dev = plan.device
    u = torch.arange(U, device=dev)
    b, h0 = u // (Hq // Gu), (u % (Hq // Gu)) * Gu
    lid = b * stride_lb + h0 // per_selection
    kv = b * Hkv + h0 // group
    t = torch.arange(Nq, device=dev)
    return _Rows(Gu, U, (lid[:, None] * Nq + t).reshape(-1),
                 (kv * (plan.num_kv_blocks + 1))[:, None].expand(U, Nq).reshape(-1),
                 t.repeat(U))


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
    """``[B, Hkv, Nk, D]`` -> fp32 ``[B * Hkv * (num_kv_blocks + 1), block_size, D]``: zero past
    ``Nk`` and one all-zero block (index ``num_kv_blocks``) per KV head for the empty slots."""
    B, H, Nk, D = x.shape
    bs, nkb = plan.block_size, plan.num_kv_blocks
    out = torch.empty(B * H, (nkb + 1) * bs, D, dtype=torch.float32, device=x.device)
    out[:, :Nk].copy_(x.reshape(B * H, Nk, D))
    out[:, Nk:].zero_()
    return out.view(-1, bs, D)


def _chunk_rows(plan: SelectionPlan, Gu: int, D: int, device: torch.device) -> int:
    """Rows per chunk: the budget over a backward row's work tensors (forward uses the same chunks)."""
    keys = plan.max_blocks * plan.block_size
    per_row = 2 * Gu * keys + 4 * keys * D + 4 * Gu * D
    budget = CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS)
    return max(1, budget // max(per_row, 1))


class _Chunk(NamedTuple):
    ids: torch.Tensor       # int64 [T * K]: the block each (row, slot) reads in the padded key blocks
    allowed: torch.Tensor   # bool [T, 1, K * block_size]: the keys each row may use


def _chunk(plan: SelectionPlan, rows: _Rows, r0: int, r1: int) -> _Chunk:
    bs, nkb, Nk = plan.block_size, plan.num_kv_blocks, plan.seqlen[1]
    K = plan.max_blocks
    blocks = plan.rows.view(-1, K).index_select(0, rows.row_index[r0:r1]).to(torch.int64)   # [T, K]
    empty = blocks < 0
    ids = (rows.kv_base[r0:r1, None] + torch.where(empty, nkb, blocks)).reshape(-1)
    key = blocks[:, :, None] * bs + torch.arange(bs, device=blocks.device)                # [T, K, bs]
    allowed = ~empty[:, :, None] & (key < Nk)
    if plan.causal_offset is not None:
        allowed &= key <= rows.token[r0:r1, None, None] + plan.causal_offset
    return _Chunk(ids, allowed.view(r1 - r0, 1, K * bs))


def _scores(qc: torch.Tensor, kc: torch.Tensor, ch: _Chunk, sm_scale: float) -> torch.Tensor:
    """``[T, Gu, K * block_size]`` base-2 scores, saturated to the finite fp32 range; ``-inf`` where
    a key is not allowed. Forward and backward both form their scores here."""
    s = torch.bmm(qc, kc.transpose(1, 2))
    s.mul_(sm_scale * LOG2E).clamp_(-FP32_MAX, FP32_MAX)
    return s.masked_fill_(~ch.allowed, float("-inf"))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SelectionPlan, *, sm_scale: float):
    """``(out [B, Hq, Nq, D] in q's dtype, lse fp32 [B, Hq, Nq] natural log, stats fp32 [2, B, Hq, Nq])``
    (see the module docstring and :mod:`sparse_io_attn.selection.api`)."""
    B, Hq, Nq, D = q.shape
    rows = _rows(plan, B, Hq, k.shape[1])
    Gu, NR, dev = rows.heads, rows.num_units * Nq, q.device
    out = torch.zeros(NR, Gu, D, dtype=torch.float32, device=dev)
    lse = torch.full((NR, Gu), float("-inf"), dtype=torch.float32, device=dev)
    row_max = torch.full((NR, Gu), float("inf"), dtype=torch.float32, device=dev)
    log2_sum = torch.zeros(NR, Gu, dtype=torch.float32, device=dev)
    K, bs = plan.max_blocks, plan.block_size
    if NR and K:
        qu = _to_units(q, Gu)
        kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
        step = _chunk_rows(plan, Gu, D, dev)
        for r0 in range(0, NR, step):
            r1 = min(r0 + step, NR)
            ch = _chunk(plan, rows, r0, r1)
            kc = kb.index_select(0, ch.ids).view(r1 - r0, K * bs, D)
            s = _scores(qu[r0:r1], kc, ch, sm_scale)
            m = s.amax(dim=-1, keepdim=True)                                     # [T, Gu, 1]
            empty = m == float("-inf")                                           # no allowed key
            p = s.sub_(m.masked_fill(empty, 0.0)).exp2_()
            l = p.sum(dim=-1, keepdim=True)                                      # >= 1 unless empty
            vc = vb.index_select(0, ch.ids).view(r1 - r0, K * bs, D)
            torch.bmm(p, vc, out=out[r0:r1])
            out[r0:r1].div_(l.clamp(min=1.0))
            log2l = torch.log2(l)
            lse[r0:r1] = ((m + log2l) * LN2).squeeze(-1)                         # -inf on empty rows
            row_max[r0:r1] = m.masked_fill(empty, float("inf")).squeeze(-1)
            log2_sum[r0:r1] = log2l.masked_fill(empty, 0.0).squeeze(-1)
    stats = torch.stack([_from_units(row_max, B, Hq, Nq), _from_units(log2_sum, B, Hq, Nq)])
    return _from_units(out, B, Hq, Nq).to(q.dtype), _from_units(lse, B, Hq, Nq), stats


def _sum_into(dst: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, spare: int) -> None:
    """``dst[ids[i]] += vals[i]`` for every ``i``, deterministically (see the module docstring);
    ``spare``: a row of ``dst`` that is thrown away (it may take zeros in any order)."""
    if DETERMINISTIC_SUM == "auto" and dst.device.type == "cpu":
        dst.index_add_(0, ids, vals)
        return
    n = ids.numel()
    dest, order = torch.sort(ids, stable=True)
    vals = vals.index_select(0, order).reshape(n, -1)
    start = torch.ones(n, dtype=torch.bool, device=ids.device)
    start[1:] = dest[1:] != dest[:-1]
    run = torch.cumsum(start, 0) - 1                                   # the run (destination) of each pair
    end = torch.searchsorted(run, torch.arange(n, device=ids.device), right=True)   # pairs in runs <= r
    begin = torch.cat([end.new_zeros(1), end[:-1]])
    lengths = end - begin                                              # runs past the last: length 0, sum 0
    sums = torch.segment_reduce(vals, "sum", lengths=lengths, unsafe=True)
    target = torch.where(lengths > 0, dest[begin.clamp(max=n - 1)], spare)     # distinct, but spare
    dst.index_add_(0, target, sums.view(n, *dst.shape[1:]))


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             stats: torch.Tensor, plan: SelectionPlan, *, sm_scale: float):
    """``(dq, dk, dv)`` in the inputs' dtypes, dk/dv summed over each GQA group (see the module
    docstring): ``P`` recomputed from the forward's ``stats``; deterministic on every device."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    rows = _rows(plan, B, Hq, Hkv)
    Gu, NR, dev = rows.heads, rows.num_units * Nq, q.device
    K, bs, nkb = plan.max_blocks, plan.block_size, plan.num_kv_blocks
    dq = torch.zeros(NR, Gu, D, dtype=torch.float32, device=dev)
    dk = torch.zeros(B * Hkv * (nkb + 1), bs, D, dtype=torch.float32, device=dev)
    dv = torch.zeros_like(dk)
    if NR and K:
        qu, dou = _to_units(q, Gu), _to_units(do, Gu)
        delta = _to_units((do.float() * out.float()).sum(-1), Gu)            # [NR, Gu]
        row_max, log2_sum = _to_units(stats[0], Gu), _to_units(stats[1], Gu)
        kb, vb = _key_blocks(k, plan), _key_blocks(v, plan)
        step = _chunk_rows(plan, Gu, D, dev)
        for r0 in range(0, NR, step):
            r1 = min(r0 + step, NR)
            T = r1 - r0
            ch = _chunk(plan, rows, r0, r1)
            kc = kb.index_select(0, ch.ids).view(T, K * bs, D)
            vc = vb.index_select(0, ch.ids).view(T, K * bs, D)
            qc, doc = qu[r0:r1], dou[r0:r1]
            p = _scores(qc, kc, ch, sm_scale)
            p.sub_(row_max[r0:r1, :, None]).sub_(log2_sum[r0:r1, :, None]).exp2_()   # 0 on empty rows
            ds = torch.bmm(doc, vc.transpose(1, 2))                                 # dP
            ds.sub_(delta[r0:r1, :, None]).mul_(p)                                   # dS (natural units)
            torch.bmm(ds, kc, out=dq[r0:r1])
            _sum_into(dk, ch.ids, torch.bmm(ds.transpose(1, 2), qc).view(T * K, bs, D), spare=nkb)
            _sum_into(dv, ch.ids, torch.bmm(p.transpose(1, 2), doc).view(T * K, bs, D), spare=nkb)
    dq.mul_(sm_scale)
    dk.mul_(sm_scale)
    key_rows = lambda x: x.view(B * Hkv, nkb + 1, bs, D)[:, :nkb].reshape(B, Hkv, nkb * bs, D)[:, :, :Nk]  # noqa: E731
    return (_from_units(dq, B, Hq, Nq).to(q.dtype), key_rows(dk).to(k.dtype), key_rows(dv).to(v.dtype))


__all__ = ["backward", "forward"]
