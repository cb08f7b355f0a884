"""Execution of the PyTorch backend: unit-major tensors, chunk views and matmuls, forward and backward."""
from __future__ import annotations

import math

import torch

from sparse_io_attn._attention.delta import row_delta
from sparse_io_attn._attention.sinks import finish_forward
from sparse_io_attn.block_sparse.torch_path.plan import _Chunk, _Plan, get_plan
from sparse_io_attn.block_sparse.torch_path.workers import for_each_chunk
from sparse_io_attn.block_sparse.plan import AttentionPlan

LOG2E = 1.0 / math.log(2.0)
FP32_MAX = torch.finfo(torch.float32).max
LN2 = math.log(2.0)


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

    def __init__(self, plan: _Plan, bq: int, bk: int, D: int, Dv: int, device, *, backward: bool = False):
        self.plan, self.bq, self.bk, self.G = plan, bq, bk, plan.heads_per_unit
        f32 = dict(dtype=torch.float32, device=device)
        self.buf_s = torch.empty(plan.max_scores, **f32)
        self.buf_q = torch.empty(plan.max_q_rows * self.G * D, **f32)
        self.buf_k = torch.empty(plan.max_k_rows * D, **f32)
        self.buf_v = torch.empty(plan.max_k_rows * Dv, **f32)
        if backward:
            self.buf_do = torch.empty(plan.max_q_rows * self.G * Dv, **f32)
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

    # k side: x is [Ukv, Nkp, D] contiguous (D: k's or v's head dim); returns per-step [nb, C*bk, D]
    def k_steps(self, x: torch.Tensor, ch: _Chunk, buf: torch.Tensor | None) -> list:
        bk, D = self.bk, x.shape[-1]
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
        """``S = Q K^T`` (base-2 scale already in Q) saturated to the finite fp32 range (as the other
        backends do: a row's largest scores then share its probability instead of giving
        ``inf - inf``), dropped elements ``-inf``: ``[steps * nb, R*bq*G, C*bk]`` in the score buffer.
        Forward and backward both form their scores here."""
        M, N = ch.R * self.bq * self.G, ch.C * self.bk
        s = self.buf_s[:ch.steps * ch.nb * M * N].view(ch.steps, ch.nb, M, N)
        for i, (a, b) in enumerate(zip(qs, ks)):
            torch.bmm(a, b.transpose(1, 2), out=s[i])
        s.clamp_(-FP32_MAX, FP32_MAX)
        for cols, bias in ch.masks:
            s.view(ch.steps, ch.nb, ch.R * self.bq, self.G, N)[..., cols].add_(bias)
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
        dst.view(-1, self.bk, dst.shape[-1]).index_add_(0, ch.k_idx, val.reshape(-1, self.bk, dst.shape[-1]))


def forward(q, k, v, attn_plan: AttentionPlan, *, sm_scale: float, sinks: torch.Tensor | None = None,
            residual: bool = False):
    """``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32 natural log, stats)``; ``stats``
    float32 ``[2, B, Hq, Nq]`` holds each row's base-2 score maximum ``m`` and ``log2`` of its sum
    ``l`` (``+inf``/``0`` on rows without keys), what backward needs to recompute ``P`` exactly as
    the forward did (``lse`` alone, rounded at the magnitude of ``m``, loses the digits of ``log2 l``
    when logits are large). The host plan maps each unit to its layout mask (kept in the attention
    plan per shape). ``sinks``: one sink logit per query head, folded into the fp32 results
    (:mod:`sparse_io_attn._attention.sinks`); ``residual=True``: the output's rounding residual
    (:mod:`sparse_io_attn._attention.delta`) as a fourth result."""
    B, Hq, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    bq, bk = attn_plan.block_size
    Nqp, Nkp = attn_plan.num_q_blocks * bq, attn_plan.num_kv_blocks * bk
    plan = get_plan(attn_plan, B, Hq, Hkv, q.device)
    dev = q.device

    qu = _q_units(q, plan.heads_per_unit, Nqp, scale=sm_scale * LOG2E)   # [U, Nqp, G, D], base-2 scores
    ku, vu = _kv_units(k, Nkp), _kv_units(v, Nkp)
    out = torch.empty(*qu.shape[:3], Dv, dtype=torch.float32, device=dev)
    lse = torch.empty(qu.shape[:3], dtype=torch.float32, device=dev)
    row_max, log2_sum = torch.empty_like(lse), torch.empty_like(lse)
    if plan.has_empty_rows:                             # rows without keys: out 0, lse -inf
        out.zero_()
        lse.fill_(float("-inf"))
        row_max.fill_(float("inf"))
        log2_sum.zero_()

    def chunk_fwd(ch: _Chunk, ex: _Exec):
        s = ex.scores(ex.q_steps(qu, ch, ex.buf_q), ex.k_steps(ku, ch, ex.buf_k), ch)
        m = s.amax(dim=-1, keepdim=True)                # [n, M, 1]
        if ch.masks:                                    # rows whose keys are all dropped
            m.masked_fill_(m == float("-inf"), 0.0)
        s.sub_(m).exp2_()                               # unnormalised p
        l = s.sum(dim=-1, keepdim=True)
        vs = ex.k_steps(vu, ch, ex.buf_v)
        o = torch.empty(ch.steps, ch.nb, s.shape[1], Dv, dtype=torch.float32, device=dev)
        for i, (p_i, v_i) in enumerate(zip(s.view(ch.steps, ch.nb, *s.shape[1:]), vs)):
            torch.bmm(p_i, v_i, out=o[i])
        o = o.view(-1, s.shape[1], Dv).div_(l.clamp(min=1e-30))   # l == 0 only where o == 0
        ex.write_q(out, o, ch)
        log2l = torch.log2(l)
        ex.write_q(lse, (log2l + m).mul_(LN2).squeeze(-1), ch)
        empty = l == 0                                  # rows whose every key is dropped
        ex.write_q(row_max, m.masked_fill_(empty, float("inf")).squeeze(-1), ch)
        ex.write_q(log2_sum, log2l.masked_fill_(empty, 0.0).squeeze(-1), ch)

    # every output row comes from one chunk, so the queue order does not change the result
    for_each_chunk(plan, dev, lambda: _Exec(plan, bq, bk, D, Dv, dev), chunk_fwd, deterministic=False)
    return finish_forward(*(_from_q_units(x, B, Hq, Nq) for x in (out, lse, row_max, log2_sum)), q.dtype, sinks,
                          residual)


def backward(do, q, k, v, out, stats, attn_plan: AttentionPlan, *, sm_scale: float, delta=None):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv summed over each GQA group. ``P = exp2((S - m)
    - log2 l)`` from the forward's ``stats``, the same scores and the same row maximum. ``delta``: fp32
    ``[B, Hq, Nq]`` row deltas formed by the caller (from the forward's fp32 output:
    :mod:`sparse_io_attn._attention.delta`), else ``rowsum(do * out)``."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = attn_plan.block_size
    Nqp, Nkp = attn_plan.num_q_blocks * bq, attn_plan.num_kv_blocks * bk
    plan = get_plan(attn_plan, B, Hq, Hkv, q.device)
    G = plan.heads_per_unit
    dev = q.device

    qu = _q_units(q, G, Nqp, scale=sm_scale * LOG2E)
    dou = _q_units(do, G, Nqp)
    delta = _q_units(row_delta(do, out, None) if delta is None else delta, G, Nqp)     # [U, Nqp, G]
    # rows with no key and padded rows: m = +inf, so that p = 0
    row_max = _q_units(stats[0], G, Nqp, fill=float("inf"))
    log2_sum = _q_units(stats[1], G, Nqp)
    ku, vu = _kv_units(k, Nkp), _kv_units(v, Nkp)
    dq = torch.zeros_like(qu) if plan.has_empty_rows else torch.empty_like(qu)

    def make_state():  # work buffers + this worker's dK/dV sums
        dk_ = torch.zeros(ku.shape[0], Nkp, D, dtype=torch.float32, device=dev)
        dv_ = torch.zeros(ku.shape[0], Nkp, Dv, dtype=torch.float32, device=dev)
        return _Exec(plan, bq, bk, D, Dv, dev, backward=True), dk_, dv_

    def chunk_bwd(ch: _Chunk, state):
        ex, dk, dv = state
        qs, dos = ex.q_steps(qu, ch, ex.buf_q), ex.q_steps(dou, ch, ex.buf_do)
        ks, vs = ex.k_steps(ku, ch, ex.buf_k), ex.k_steps(vu, ch, ex.buf_v)
        p = ex.scores(qs, ks, ch)
        n, M, N = p.shape
        p.sub_(ex.q_rows(row_max, ch)).sub_(ex.q_rows(log2_sum, ch)).exp2_()
        d_s = ex.buf_dp[:n * M * N].view(ch.steps, ch.nb, M, N)
        dvs = torch.empty(ch.steps, ch.nb, N, Dv, dtype=torch.float32, device=dev)
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
        ex.add_k(dv, dvs.view(n, N, Dv), ch)

    states = for_each_chunk(plan, dev, make_state, chunk_bwd, deterministic=True)
    _, dk, dv = states[0]
    for _, dk_i, dv_i in states[1:]:
        dk.add_(dk_i)
        dv.add_(dv_i)
    dq.mul_(sm_scale)
    dk.mul_(LN2)                     # Q carried sm_scale * log2(e); dK needs sm_scale only
    dq = _from_q_units(dq, B, Hq, Nq).to(q.dtype)
    dk = dk[:, :Nk].reshape(B, Hkv, Nk, D).to(k.dtype)
    dv = dv[:, :Nk].reshape(B, Hkv, Nk, Dv).to(v.dtype)
    return dq, dk, dv
