"""`context_parallel_attention`: block-sparse attention over a sequence sharded across ranks by a
:class:`~sparse_io_attn.distributed.plan.ContextParallelPlan`.

Each rank receives exactly the K/V blocks its query rows read and it does not own, with one
``torch.distributed.all_to_all_single`` (never an all-gather), and computes its rows through the
block-sparse backends (:func:`sparse_io_attn.block_sparse.api.prepare` plans each part, and
:func:`sparse_io_attn.block_sparse.op.forward`/``backward`` run it, the path of
:func:`~sparse_io_attn.block_sparse_attention`). Rows the plan
spreads (far heavier than the mean, e.g. global query rows) move the other way: their queries ride
in the same exchange to the ranks owning their keys (the ``foreign`` layout there), whose partial
outputs and row statistics come back in a second ``all_to_all_single``.

Overlap: the exchange starts with ``async_op=True``; while it runs the rank computes its rows
against its own keys (the plan's ``local`` layout); then against the received keys (``received``
layout) and the received queries; partial results merge through their row statistics
(:func:`merge_partials`; spread rows' parts in rank order). The partials' return is not overlapped.
Backward: spread rows' ``do``/``out``/statistics leave first (asynchronously, overlapping the
received part's backward); the received keys' dK/dV and the foreign queries' dQ go back to their
owners in one reverse ``all_to_all_single`` started before the local part's backward, which runs
while it is in flight; the owner adds what comes back in rank order (deterministic). Every part's
backward uses the merged statistics and output, so every gradient is the one of the whole softmax.

A step (:class:`~sparse_io_attn.distributed.step.ContextParallelStep`, a selection chosen this step)
runs the same shape: the agreement's descriptors carry each rank's receive counts, the requested
unit ids go to their owners (one small ``all_to_all_single``), the K/V units come back
asynchronously while the local part computes, the received part runs on the received key space
(its slots), through the block-sparse op for a layout or the selection op
(:func:`sparse_io_attn.selection.op.forward`/``backward``) for a per-token selection, and merges
through the row statistics; dK/dV of the received units go back in rank order.
"""
from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist

from sparse_io_attn.block_sparse import op
from sparse_io_attn.block_sparse.api import Call, prepare
from sparse_io_attn.distributed.plan import ContextParallelPlan, Exchange
from sparse_io_attn.distributed.step import ContextParallelStep
from sparse_io_attn.distributed.traffic import BACKWARD, BACKWARD_INPUTS, FORWARD, PARTIALS, REQUESTS
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import api as selection_api
from sparse_io_attn.selection import op as selection_op
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.tally.counter import count_network

LN2 = math.log(2.0)


def merge_partials(out1: torch.Tensor, stats1: torch.Tensor, out2: torch.Tensor, stats2: torch.Tensor):
    """Two attention results over disjoint key sets -> the result over their union.

    ``stats`` are the backends' fp32 ``[2, B, H, N]`` row statistics (base-2 maximum ``m``, ``log2``
    of the row sum; ``+inf``/``0`` on a row without keys). Returns ``(out, lse, stats)``: ``out =
    (out1 l1 2^(m1 - m) + out2 l2 2^(m2 - m)) / l`` with ``m = max(m1, m2)`` and ``l`` the merged sum
    (computed in fp32, returned in ``out1``'s dtype), ``lse`` natural log (``-inf`` on rows empty in
    both), ``stats`` the merged statistics backward recomputes the probabilities from."""
    inf = torch.tensor(float("inf"), device=out1.device)
    e1, e2 = stats1[0] == inf, stats2[0] == inf                          # rows without keys
    m1, m2 = torch.where(e1, -inf, stats1[0]), torch.where(e2, -inf, stats2[0])
    both = e1 & e2
    m = torch.where(both, 0.0, torch.maximum(m1, m2))
    a1 = torch.where(e1, 0.0, torch.exp2(m1 - m + stats1[1]))           # l1 * 2^(m1 - m)
    a2 = torch.where(e2, 0.0, torch.exp2(m2 - m + stats2[1]))
    total = a1 + a2
    inv = torch.where(both, 0.0, 1.0 / torch.where(both, 1.0, total))
    out = (out1.float() * (a1 * inv)[..., None] + out2.float() * (a2 * inv)[..., None]).to(out1.dtype)
    log2_sum = torch.where(both, 0.0, torch.log2(torch.where(both, 1.0, total)))
    lse = torch.where(both, -inf, (m + log2_sum) * LN2)
    return out, lse, torch.stack([torch.where(both, inf, m), log2_sum])


class _Call(NamedTuple):
    """One rank's call, decided before any collective."""
    local: Call                      # the local part (its rows x its own keys), validated
    received: Call | None            # its rows x the keys it receives (None: it receives none)
    foreign: Call | None             # the spread queries it receives x its keys (None: none)
    plan: ContextParallelPlan
    rank: int
    exchange: Exchange | None            # None: no collective (a single rank, or nothing to send)
    group: object


class _Part(NamedTuple):
    """One tensor of an exchange: ``rows`` ``[tokens, features]`` grouped by destination rank,
    ``send``/``recv`` the tokens to/from each rank, ``names`` the tensors sharing its bytes equally."""
    rows: torch.Tensor
    send: list
    recv: list
    names: tuple


def _start(parts: list, call: _Call, collective: str):
    """Start one ``all_to_all_single`` moving every part (one flat buffer, per-rank element splits;
    asynchronous) and count its bytes; returns ``finish()``, which waits and gives each part's
    received rows ``[tokens, features]`` grouped by source rank."""
    W = call.plan.world_size
    assert len({p.rows.dtype for p in parts}) == 1, "one exchange moves one dtype"
    feats = [p.rows.shape[1] for p in parts]
    chunks, offsets = [], [0] * len(parts)
    send_splits = [sum(p.send[dst] * f for p, f in zip(parts, feats)) for dst in range(W)]
    recv_splits = [sum(p.recv[src] * f for p, f in zip(parts, feats)) for src in range(W)]
    for dst in range(W):
        for i, p in enumerate(parts):
            chunks.append(p.rows[offsets[i]:offsets[i] + p.send[dst]].reshape(-1))
            offsets[i] += p.send[dst]
    buf = torch.cat(chunks)
    out = buf.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(out, buf, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                  group=call.group, async_op=True)
    size = buf.element_size()
    sent, received = {}, {}
    for p, f in zip(parts, feats):
        for name in p.names:
            sent[name] = sent.get(name, 0) + sum(p.send) * f * size // len(p.names)
            received[name] = received.get(name, 0) + sum(p.recv) * f * size // len(p.names)
    count_network(collective, sent, received)

    def finish() -> list:
        work.wait()
        got, pos = [[] for _ in parts], 0
        for src in range(W):
            for i, (p, f) in enumerate(zip(parts, feats)):
                got[i].append(out[pos:pos + p.recv[src] * f])
                pos += p.recv[src] * f
        return [torch.cat(g).view(-1, f) for g, f in zip(got, feats)]
    return finish


def _forward(q, k, v, part: Call):
    return op.forward(q, k, v, part.plan, part.sm_scale, part.backend)


def _backward(do, q, k, v, out, stats, part: Call):
    return op.backward(do, q, k, v, out, stats, part.plan, part.sm_scale, part.backend)


def _rows(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Tokens ``index`` of ``x`` along ``dim`` as rows ``[tokens, features]``."""
    features = x.numel() // x.shape[dim]
    return x.index_select(dim, index.to(x.device)).movedim(dim, 0).reshape(index.numel(), features)


def _tokens(rows: torch.Tensor, order: torch.Tensor, shape: tuple, dim: int) -> torch.Tensor:
    """Rows back to a tensor with tokens (taken in ``order``) along ``dim``; ``shape`` per token."""
    return rows.index_select(0, order.to(rows.device)).view(-1, *shape).movedim(0, dim).contiguous()


class _Kernel(NamedTuple):
    """One part of a step's call: the op's plain ``forward``/``backward`` (block-sparse or
    selection) with the part's plan, scale and backend, validated before any collective."""
    forward_fn: object
    backward_fn: object
    plan: object
    sm_scale: float
    backend: str

    def forward(self, q, k, v):
        return self.forward_fn(q, k, v, self.plan, self.sm_scale, self.backend)

    def backward(self, do, q, k, v, out, stats):
        return self.backward_fn(do, q, k, v, out, stats, self.plan, self.sm_scale, self.backend)


class _StepCall(NamedTuple):
    """One rank's call on a :class:`ContextParallelStep`, decided before any collective; the send
    counts come from the agreement (every rank's receive counts)."""
    local: _Kernel
    received: _Kernel | None
    step: ContextParallelStep
    plan: ContextParallelPlan
    rank: int
    group: object
    send_units: list                 # units each rank asks of this one
    send_full: list                  # of which full blocks
    send_ragged: list                # and ragged last blocks
    recv_full: list                  # units this rank asks of each rank: full blocks
    recv_ragged: list                # and ragged last blocks
    received_full: int               # full blocks per unit group in the received key space
    exchanges: bool                  # whether any rank receives anything (else no collective)


class _Units(NamedTuple):
    """K/V ``[2, B, Hkv, n, D]`` seen as units: the first ``full`` blocks of ``bs`` tokens as ``[Lb, Gk,
    full]`` rows of ``2 * (B / Lb) * (Hkv / Gk) * bs * D`` elements (the batch elements and K/V heads
    one unit group holds), and the tail, the sequence's ragged last key block of ``last`` tokens when
    ``n`` holds it, as ``[Lb, Gk]`` rows. Units are gathered and placed whole: no index per token.
    Exchanges move one part of full blocks and, when the sequence has a ragged last key block
    (``last > 0``, the same on every rank), one part of tails (empty on the ranks without one)."""
    Lb: int
    Gk: int
    b: int
    h: int
    D: int
    bs: int
    last: int

    @classmethod
    def of(cls, step: ContextParallelStep, B: int, Hkv: int, D: int) -> "_Units":
        Lb, Gk = step.batch_groups, step.kv_groups
        last = step.last_tokens if step.last_tokens < step.block_size else 0
        return cls(Lb, Gk, B // Lb, Hkv // Gk, D, step.block_size, last)

    def _split(self, kv: torch.Tensor, full: int):
        """Views of ``kv [2, B, Hkv, n, D]``: ``[Lb, Gk, full, 2, b, h, bs, D]`` and ``[Lb, Gk, 2, b, h,
        n - full * bs, D]``."""
        v = kv.view(2, self.Lb, self.b, self.Gk, self.h, kv.shape[3], self.D)
        blocks = v[:, :, :, :, :, :full * self.bs].unflatten(5, (full, self.bs)).permute(1, 3, 5, 0, 2, 4, 6, 7)
        return blocks, v[:, :, :, :, :, full * self.bs:].permute(1, 3, 0, 2, 4, 5, 6)

    def _index(self, rows: torch.Tensor, full: int):
        u, i = rows // max(full, 1), rows % max(full, 1)
        return u // self.Gk, u % self.Gk, i

    def take(self, kv: torch.Tensor, full: int, rows: torch.Tensor, groups: torch.Tensor) -> list:
        """The full blocks at ``rows`` (``u * full + block``) and the tails of unit groups ``groups``,
        as rows ``[units, elements]`` (gathered: nothing else is copied)."""
        blocks, tail = self._split(kv, full)
        out = [blocks[self._index(rows, full)].reshape(rows.numel(), 2 * self.b * self.h * self.bs * self.D)]
        if self.last:
            elements = 2 * self.b * self.h * self.last * self.D
            out.append(tail[groups // self.Gk, groups % self.Gk].reshape(groups.numel(), elements)
                       if tail.shape[5] else kv.new_empty((0, elements)))
        return out

    def place(self, got: list, n: int, full: int, rows: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Rows from :meth:`take` written into zero K/V ``[2, B, Hkv, n, D]``."""
        kv = got[0].new_zeros((2, self.Lb * self.b, self.Gk * self.h, n, self.D))
        blocks, tail = self._split(kv, full)
        blocks[self._index(rows, full)] = got[0].view(rows.numel(), *blocks.shape[3:])
        if tail.shape[5]:
            tail[groups // self.Gk, groups % self.Gk] = got[1].view(groups.numel(), *tail.shape[2:])
        return kv

    def accumulate(self, got: list, n: int, full: int, rows: torch.Tensor, groups: torch.Tensor,
                   splits: tuple) -> torch.Tensor:
        """fp32 ``[2, B, Hkv, n, D]``: the rows of :meth:`take` added at their units, the chunks of each
        rank in rank order (``splits``: full blocks and tails per rank; inside a chunk the units are
        distinct): a deterministic sum."""
        kv = torch.zeros((2, self.Lb * self.b, self.Gk * self.h, n, self.D), dtype=torch.float32,
                         device=got[0].device)
        blocks, tail = self._split(kv, full)
        acc = [torch.zeros((self.Lb * self.Gk * full, got[0].shape[1]), dtype=torch.float32, device=kv.device),
               torch.zeros((self.Lb * self.Gk, got[1].shape[1] if self.last else 0), dtype=torch.float32,
                           device=kv.device)]
        pos = [0, 0]
        for counts in zip(*splits):                                        # rank order
            for i, dest in enumerate((rows, groups)[:len(got)]):
                if counts[i]:
                    acc[i].index_add_(0, dest[pos[i]:pos[i] + counts[i]], got[i][pos[i]:pos[i] + counts[i]].float())
                pos[i] += counts[i]
        blocks.copy_(acc[0].view(blocks.shape))
        if tail.shape[5]:
            tail.copy_(acc[1].view(tail.shape))
        return kv


class _ContextParallelStepAttention(torch.autograd.Function):
    """The attention of one step: the rank's rows against its own keys (local part) and against the
    units it asked for (received part), merged through the row statistics."""

    @staticmethod
    def forward(ctx, q, k, v, call: _StepCall):
        step = call.step
        B, _, n, D = q.shape
        units = _Units.of(step, B, k.shape[1], D)
        k_r = v_r = send_rows = send_groups = None
        if call.exchanges:
            asked, = _start([_Part(step.requests.view(-1, 1), step.recv_units, call.send_units, ("requests",))],
                            call, REQUESTS)()
            send_rows, send_groups = step.split_asked(asked.view(-1), sum(call.send_ragged))
            rows = units.take(torch.stack([k, v]), n // step.block_size, send_rows, send_groups)
            finish = _start([_Part(r, sends, recvs, ("k", "v")) for r, sends, recvs in zip(
                rows, (call.send_full, call.send_ragged), (call.recv_full, call.recv_ragged))], call, FORWARD)
        out, _, stats = call.local.forward(q, k, v)
        if call.exchanges:
            got = finish()
            if call.received is not None:
                kv = units.place(got, step.received_seqlen, call.received_full, step.recv_regular, step.recv_ragged)
                k_r, v_r = kv[0], kv[1]
                out2, _, stats2 = call.received.forward(q, k_r, v_r)
                out, _, stats = merge_partials(out, stats, out2, stats2)
        ctx.save_for_backward(q, k, v, k_r, v_r, out, stats, send_rows, send_groups)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled():
            raise NotImplementedError("context_parallel_attention: double backward (create_graph=True) is "
                                      "not supported: the backward kernels are not differentiable")
        q, k, v, k_r, v_r, out, stats, send_rows, send_groups = ctx.saved_tensors
        call = ctx.call
        step = call.step
        B, _, n, D = q.shape
        units = _Units.of(step, B, k.shape[1], D)
        do = do.contiguous()
        dq_r = None
        if call.exchanges:
            if k_r is not None:
                dq_r, dk_r, dv_r = call.received.backward(do, q, k_r, v_r, out, stats)
                dkv_r = torch.stack([dk_r, dv_r]).to(k.dtype)
            else:                                                           # nothing received: empty rows
                dkv_r = k.new_zeros((2, B, k.shape[1], 0, D))
            rows = units.take(dkv_r, call.received_full, step.recv_regular, step.recv_ragged)
            finish = _start([_Part(r, sends, recvs, ("dk", "dv")) for r, sends, recvs in zip(
                rows, (call.recv_full, call.recv_ragged), (call.send_full, call.send_ragged))], call, BACKWARD)
        dq, dk, dv = call.local.backward(do, q, k, v, out, stats)
        dq32, dkv = dq.float(), torch.stack([dk, dv]).float()
        if dq_r is not None:
            dq32 += dq_r.float()
        if call.exchanges:
            dkv += units.accumulate(finish(), n, n // step.block_size, send_rows, send_groups,
                                    (call.send_full, call.send_ragged))
        return dq32.to(dq.dtype), dkv[0].to(dk.dtype), dkv[1].to(dv.dtype), None


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        ex = call.exchange
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        k_r = v_r = q_f = None
        if ex is not None:
            finish = _start([_Part(_rows(torch.stack([k, v]), 3, torch.cat(ex.send_index)), ex.send_splits,
                                   ex.recv_splits, ("k", "v")),
                             _Part(_rows(q, 2, torch.cat(ex.q_send_index)), ex.q_send_splits, ex.q_recv_splits,
                                   ("q",))], call, FORWARD)
        out, _, stats = _forward(q, k, v, call.local)
        if ex is None:
            ctx.save_for_backward(q, k, v, k_r, v_r, q_f, out, stats)
            ctx.call = call
            return out
        kv_got, q_got = finish()
        if kv_got.shape[0]:
            kv = _tokens(kv_got, ex.recv_order, (2, B, Hkv, D), 3)        # [2, B, Hkv, n_received, D]
            k_r, v_r = kv[0], kv[1]
            part = call.received
            out2, _, stats2 = _forward(q, k_r, v_r, part)
            out, _, stats = merge_partials(out, stats, out2, stats2)
        if call.plan.spreads:                                             # partial results of spread rows
            n_f = q_got.shape[0]
            o_rows, s_rows = q.new_empty((0, B * Hq * D), dtype=torch.float32), stats.new_empty((0, 2 * B * Hq))
            if n_f:
                q_f = _tokens(q_got, ex.q_recv_order, (B, Hq, D), 2)
                part = call.foreign
                o_f, _, s_f = _forward(q_f, k, v, part)
                o_rows, s_rows = _rows(o_f.float(), 2, ex.q_recv_inverse), _rows(s_f, 3, ex.q_recv_inverse)
            o_got, s_got = _start([_Part(o_rows, ex.q_recv_splits, ex.q_send_splits, ("o",)),
                                   _Part(s_rows, ex.q_recv_splits, ex.q_send_splits, ("stats",))],
                                  call, PARTIALS)()
            pos = 0
            for index, n in zip(ex.q_send_index, ex.q_send_splits):       # rank order: deterministic
                if n:
                    index = index.to(q.device)
                    o_j = o_got[pos:pos + n].view(n, B, Hq, D).movedim(0, 2)
                    s_j = s_got[pos:pos + n].view(n, 2, B, Hq).movedim(0, 3)
                    o_m, _, s_m = merge_partials(out.index_select(2, index), stats.index_select(3, index), o_j, s_j)
                    out, stats = out.index_copy(2, index, o_m), stats.index_copy(3, index, s_m)
                pos += n
        ctx.save_for_backward(q, k, v, k_r, v_r, q_f, out, stats)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled():
            raise NotImplementedError("context_parallel_attention: double backward (create_graph=True) is "
                                      "not supported: the backward kernels are not differentiable")
        q, k, v, k_r, v_r, q_f, out, stats = ctx.saved_tensors
        call = ctx.call
        ex = call.exchange
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        do = do.contiguous()
        if ex is not None and call.plan.spreads:                          # spread rows' do, out, stats out
            rows = torch.cat(ex.q_send_index)
            finish_in = _start([_Part(_rows(t.float(), 2, rows), ex.q_send_splits, ex.q_recv_splits, (name,))
                                for t, name in ((do, "do"), (out, "o"))]
                               + [_Part(_rows(stats, 3, rows), ex.q_send_splits, ex.q_recv_splits, ("stats",))],
                               call, BACKWARD_INPUTS)
        dq_r = dkv_r = dq_f = dkv_f = None
        if k_r is not None:
            part = call.received
            dq_r, dk_r, dv_r = _backward(do, q, k_r, v_r, out, stats, part)
            dkv_r = torch.stack([dk_r, dv_r])
        if ex is not None and call.plan.spreads:
            do_got, o_got, s_got = finish_in()
            if q_f is not None:
                do_f = _tokens(do_got, ex.q_recv_order, (B, Hq, D), 2).to(q.dtype)
                out_f = _tokens(o_got, ex.q_recv_order, (B, Hq, D), 2).to(q.dtype)
                s_f = _tokens(s_got, ex.q_recv_order, (2, B, Hq), 3)
                part = call.foreign
                dq_f, dk_f, dv_f = _backward(do_f, q_f, k, v, out_f, s_f, part)
                dkv_f = torch.stack([dk_f, dv_f])
        if ex is not None:
            kv_rows = (_rows(dkv_r.to(k.dtype), 3, ex.recv_inverse) if dkv_r is not None
                       else k.new_empty((0, 2 * B * Hkv * D)))
            q_rows = (_rows(dq_f.to(k.dtype), 2, ex.q_recv_inverse) if dq_f is not None
                      else k.new_empty((0, B * Hq * D)))
            finish_grads = _start([_Part(kv_rows, ex.recv_splits, ex.send_splits, ("dk", "dv")),
                                   _Part(q_rows, ex.q_recv_splits, ex.q_send_splits, ("dq",))], call, BACKWARD)
        dq, dk, dv = _backward(do, q, k, v, out, stats, call.local)
        dq32, dkv = dq.float(), torch.stack([dk, dv]).float()
        if dq_r is not None:
            dq32 += dq_r.float()
        if dkv_f is not None:
            dkv += dkv_f.float()
        if ex is not None:
            kv_got, q_got = finish_grads()
            for got, dest, dim, index, splits, shape in (
                    (kv_got, dkv, 3, ex.send_index, ex.send_splits, (2, B, Hkv, D)),
                    (q_got, dq32, 2, ex.q_send_index, ex.q_send_splits, (B, Hq, D))):
                pos = 0
                for idx, n in zip(index, splits):                         # rank order: deterministic sums
                    if n:
                        chunk = got[pos:pos + n].view(n, *shape).movedim(0, dim).float()
                        dest.index_add_(dim, idx.to(dest.device), chunk)
                    pos += n
        return dq32.to(dq.dtype), dkv[0].to(dk.dtype), dkv[1].to(dv.dtype), None


def _group_rank(group) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group for ``None``; one process without
    ``torch.distributed`` initialised counts as a group of one)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_shards(q, k, v, plan: ContextParallelPlan, world: int, rank: int, causal) -> None:
    """The checks a static plan and a step share: the group's size, the shard lengths, causality."""
    if world != plan.world_size:
        raise ValueError(f"the process group has {world} ranks but the plan was built for {plan.world_size}; "
                         f"build the plan for {world} ranks (or pass the matching group)")
    n = plan.num_tokens(rank)
    for name, t in (("q_local", q), ("k_local", k), ("v_local", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, n_local, head_dim], got {tuple(t.shape)}")
        if t.shape[2] != n:
            raise ValueError(f"{name} has {t.shape[2]} tokens but the plan gives rank {rank} {n} "
                             f"(of {plan.seqlen}); pass plan.shard(x, {rank}, dim=2) of the whole sequence")
    if (causal_offset(causal, plan.seqlen, plan.seqlen) is not None) != plan.causal:
        raise ValueError(f"causal={causal!r} but the plan was built with causal={plan.causal}: the plan "
                         f"decides which blocks are sent; build it with the same causal")


def _kernel(q, k, v, part, causal, sm_scale, backend) -> _Kernel:
    """The validated kernel of one part of a step (a layout or a selection plan), its backend loaded
    now (a build failure is this rank's refusal, not a failure mid-exchange)."""
    if isinstance(part, SelectionPlan):
        plan, scale, name = selection_api.prepare(q, k, v, part, causal=causal, sm_scale=sm_scale, backend=backend)
        if name == "cpu":
            load = getattr(selection_op.cpu_backend(), "load", None)
            if load is not None:
                load()
        return _Kernel(selection_op.forward, selection_op.backward, plan, scale, name)
    call = prepare(q, k, v, part, causal=causal, sm_scale=sm_scale, backend=backend)
    if call.backend == "cpu":
        op.cpu_backend().load()
    return _Kernel(op.forward, op.backward, call.plan, call.sm_scale, call.backend)


def _check_step(q, k, v, step: ContextParallelStep, world: int, rank: int, causal, sm_scale,
                backend) -> tuple[_Kernel, _Kernel | None]:
    """Everything this rank's call on a step can fail on, before any collective: the step's rank and
    world, the shard lengths, the heads against the step's unit groups, the local and received
    parts' kernels. Returns ``(local, received)``."""
    plan = step.plan
    if step.rank != rank:
        raise ValueError(f"the step was built for rank {step.rank} but this process is rank {rank} of the group; "
                         f"build it on each rank with plan.step(selection) (or rank={rank})")
    _check_shards(q, k, v, plan, world, rank, causal)
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    step.check_heads(B, Hq, Hkv)
    local = _kernel(q, k, v, step.local, plan.causal, sm_scale, backend)
    if step.received is None:
        return local, None
    stand_in = lambda h, m: q.new_empty(()).expand(B, h, m, D)    # noqa: E731 (shapes only, no memory)
    m = step.received_seqlen
    return local, _kernel(stand_in(Hq, n), stand_in(Hkv, m), stand_in(Hkv, m), step.received, False,
                          local.sm_scale, local.backend)


def _check_local(q, k, v, plan: ContextParallelPlan, world: int, rank: int, causal, sm_scale,
                 backend) -> tuple[Call, Call | None, Call | None, Exchange | None]:
    """Everything this rank's call can fail on, before any collective: the plan (type, world size,
    an in-place edit of its layout), the shard lengths, :func:`prepare` of the local part and of the
    parts on received keys / queries. Returns ``(local, received, foreign, exchange)``."""
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan or a ContextParallelStep (plan.step(selection)), "
                        f"got {type(plan).__name__}")
    if not plan.is_static:
        raise ValueError("this ContextParallelPlan of a sequence length fixes the ownership only; pass this "
                         "step's part: context_parallel_attention(q, k, v, plan.step(layout_or_selection))")
    plan.check_source()
    _check_shards(q, k, v, plan, world, rank, causal)
    n = plan.num_tokens(rank)
    lay = plan.rank_layouts(rank)
    local = prepare(q, k, v, lay.local, causal=False, sm_scale=sm_scale, backend=backend)
    if local.backend == "cpu":
        op.cpu_backend().load()             # the C++ kernel built now (or its failure carried), not mid-exchange
    if world == 1 or not plan.exchanges:
        return local, None, None, None
    exchange = plan.exchange(rank)
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]

    def part(layout, n_q, n_k):           # the plan of a part, on stand-ins of its shapes (no memory)
        if layout is None:
            return None
        stand_in = lambda h, n: q.new_empty(()).expand(B, h, n, D)    # noqa: E731
        return prepare(stand_in(Hq, n_q), stand_in(Hkv, n_k), stand_in(Hkv, n_k), layout, causal=False,
                       sm_scale=local.sm_scale, backend=local.backend)
    received = part(lay.received, n, sum(exchange.recv_splits))
    foreign = part(lay.foreign, sum(exchange.q_recv_splits), n)
    return local, received, foreign, exchange


#: what every rank describes before any exchange (one int64 each), in the order ranks compare them
_FIELDS = ("error", "plan world size", "plan sequence length", "plan block size", "plan causality",
           "plan layout digest", "plan assignment digest", "step digest", "q dtype", "k dtype", "v dtype",
           "batch", "query heads", "KV heads", "head dim", "backward", "backend", "sm_scale")
_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64)
_BACKENDS = (None, "torch", "triton", "cpu")
_MESSAGE_BYTES = 512                       # the refused rank's error text travels with its descriptor
_UNKNOWN = -1


def agreement_bytes(world_size: int) -> int:
    """Bytes of one rank's agreement descriptor in a group of ``world_size`` ranks (each rank receives
    ``world_size`` of them): the fields, the refused rank's error text and, for a step, the units and
    tokens the rank receives from each rank (what tells every rank what it sends)."""
    return 8 * (len(_FIELDS) + 2 * world_size) + _MESSAGE_BYTES

_FIXES = {
    "plan": "every rank must build ContextParallelPlan(layout, world_size, causal=..., balance=..., "
            "tolerance=..., split_rows=...) from the same layout with the same arguments",
    "dtype": "every rank must pass q, k, v of the same dtypes",
    "shape": "every rank must pass shards of the same batch, heads and head dim (plan.shard of the same "
             "tensors)",
    "backward": "every rank must build the backward alike (backward exchanges dK/dV between all ranks): "
                "q/k/v requiring grad and torch.is_grad_enabled() the same on every rank",
    "step": "every rank must pass its step of the same plan, built alike (plan.step of a layout or of a "
            "Selection with the same key block, batch and head groups, and num_heads_kv)",
    "backend": "pass the same backend on every rank",
    "sm_scale": "pass the same sm_scale on every rank",
}


def _dtype_code(t) -> int:
    dtype = t.dtype if isinstance(t, torch.Tensor) else None
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _backward_bits(q, k, v) -> int:
    """``8 * grad mode + 4 * q + 2 * k + v`` (``requires_grad`` of each)."""
    bits = 8 * torch.is_grad_enabled()
    for shift, t in ((2, q), (1, k), (0, v)):
        bits |= (isinstance(t, torch.Tensor) and t.requires_grad) << shift
    return bits


def _runs_backward(bits: int) -> bool:
    return bool(bits & 8) and bool(bits & 7)


def _describe(q, k, v, plan, local: Call | _Kernel | None, error: Exception | None, world: int) -> torch.Tensor:
    """This rank's descriptor: int64 ``[len(_FIELDS) + _MESSAGE_BYTES // 8 + 2 * world]`` (unknown
    fields -1; the counts 0 unless this rank's step is built and its checks passed)."""
    step = plan if isinstance(plan, ContextParallelStep) else None
    plan = step.plan if step is not None else plan
    is_plan = isinstance(plan, ContextParallelPlan)
    pick = (lambda f: f(plan)) if is_plan else (lambda f: _UNKNOWN)           # noqa: E731
    shape = lambda t, i: t.shape[i] if isinstance(t, torch.Tensor) and t.dim() == 4 else _UNKNOWN  # noqa: E731
    scale = _UNKNOWN if local is None else struct.unpack("<q", struct.pack("<d", local.sm_scale))[0]
    fields = [int(error is not None), pick(lambda p: p.world_size), pick(lambda p: p.seqlen),
              pick(lambda p: p.block_size), pick(lambda p: int(p.causal)), pick(lambda p: p.layout_digest),
              pick(lambda p: p.assignment_digest), step.digest if step is not None else 0,
              _dtype_code(q), _dtype_code(k), _dtype_code(v),
              shape(q, 0), shape(q, 1), shape(k, 1), shape(q, 3), _backward_bits(q, k, v),
              _UNKNOWN if local is None else _BACKENDS.index(local.backend), scale]
    text = b"" if error is None else str(error).encode("utf-8", "replace")
    if len(text) > _MESSAGE_BYTES:
        text = text[:_MESSAGE_BYTES - 3] + b"..."
    message = torch.frombuffer(bytearray(text.ljust(_MESSAGE_BYTES, b"\0")), dtype=torch.int64)
    counts = [0] * (2 * world)
    if step is not None and error is None and len(step.recv_units) == world:
        counts = step.recv_units + step.recv_tokens
    return torch.cat([torch.tensor(fields, dtype=torch.int64), message, torch.tensor(counts, dtype=torch.int64)])


def _show(field: str, value: int) -> str:
    if value == _UNKNOWN:                   # (digests are >= 0; -1 is no finite sm_scale's bits)
        return "none (its call failed before)"
    if field.endswith("dtype"):
        return str(_DTYPES[value]) if value < len(_DTYPES) else "an unsupported dtype"
    if field == "backend":
        return repr(_BACKENDS[value])
    if field == "plan causality":
        return str(bool(value))
    if field.endswith("digest"):
        return f"{value & (2 ** 64 - 1):#018x}"
    if field == "sm_scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "backward":
        grads = "/".join(str(bool(value >> s & 1)) for s in (2, 1, 0))
        return (f"{'a' if _runs_backward(value) else 'no'} backward to run (q/k/v requires_grad {grads}, "
                f"grad mode {'on' if value & 8 else 'off'})")
    return str(value)


def _fix(field: str) -> str:
    if field.startswith("plan"):
        return _FIXES["plan"]
    if field.startswith("step"):
        return _FIXES["step"]
    if field.endswith("dtype"):
        return _FIXES["dtype"]
    if field in ("batch", "query heads", "KV heads", "head dim"):
        return _FIXES["shape"]
    return _FIXES[field]


def _disagreement(table: torch.Tensor) -> str | None:
    """The error every rank raises for the gathered descriptors ``table [world, ...]`` (``None``: the
    ranks agree): the refused ranks' errors first, then the first field in which some rank differs
    from rank 0 (the backward as whether it runs)."""
    nf = len(_FIELDS)
    refused = [r for r in range(table.shape[0]) if table[r, 0]]
    if refused:
        r = refused[0]
        words = table[r, nf:nf + _MESSAGE_BYTES // 8].contiguous()
        text = words.view(torch.uint8).numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
        who = (f"rank {r} refused its inputs" if len(refused) == 1 else
               f"ranks {', '.join(map(str, refused))} refused their inputs; rank {r}")
        return f"context_parallel_attention: {who}: {text} (no rank started the exchange)"
    for i, field in enumerate(_FIELDS[1:], 1):
        values = table[:, i].tolist()
        if field == "backward":
            differs = [r for r, x in enumerate(values) if _runs_backward(x) != _runs_backward(values[0])]
        else:
            differs = [r for r, x in enumerate(values) if x != values[0]]
        if differs:
            r = differs[0]
            if field == "backward":
                return (f"context_parallel_attention: ranks disagree: rank {r} has {_show(field, values[r])}, "
                        f"rank 0 {_show(field, values[0])}; {_fix(field)} (no rank started the exchange)")
            return (f"context_parallel_attention: ranks disagree: rank {r} has {field} {_show(field, values[r])}, "
                    f"rank 0 {_show(field, values[0])}; {_fix(field)} (no rank started the exchange)")
    return None


def _agreement_device(group) -> torch.device:
    """Where the agreement's tensors live: the current CUDA device for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _agree(descriptor: torch.Tensor, error: Exception | None, group, world: int) -> torch.Tensor:
    """One ``all_gather`` of every rank's fixed-size descriptor; every rank compares all of them and
    raises the same ``ValueError`` if any rank refused its inputs or the ranks differ in what must
    match (so no rank starts an exchange its peers do not, and none waits alone). Returns the
    gathered descriptors ``[world, ...]`` on the CPU (one read: the agreement's and the counts')."""
    device = _agreement_device(group)
    gathered = [torch.empty_like(descriptor, device=device) for _ in range(world)]
    dist.all_gather(gathered, descriptor.to(device), group=group)
    table = torch.stack(gathered).cpu()
    message = _disagreement(table)
    if message is not None:
        raise ValueError(message) from error
    return table


def _prepare(q, k, v, plan, group, causal, sm_scale, backend, error: Exception | None = None) -> _Call | _StepCall:
    """This rank's call: every check, then (over more than one rank) the agreement, which for a step
    also tells each rank what every other asks of it. ``error``: a failure the caller met before
    (carried into the agreement like the checks' own)."""
    world, rank = _group_rank(group)
    is_step = isinstance(plan, ContextParallelStep)
    local = received = foreign = exchange = None
    if error is None:
        try:
            if is_step:
                local, received = _check_step(q, k, v, plan, world, rank, causal, sm_scale, backend)
            else:
                local, received, foreign, exchange = _check_local(q, k, v, plan, world, rank, causal, sm_scale,
                                                                  backend)
        except Exception as exc:        # noqa: BLE001 (any failure is carried: no rank may wait alone)
            error = exc
    table = None
    if world > 1:
        table = _agree(_describe(q, k, v, plan, local, error, world), error, group, world)
    elif error is not None:
        raise error
    if not is_step:
        return _Call(local, received, foreign, plan, rank, exchange, group)
    if table is None:
        return _StepCall(local, received, plan, plan.plan, rank, group, [0], [0], [0], [0], [0], 0, False)
    counts = table[:, len(_FIELDS) + _MESSAGE_BYTES // 8:]               # [world, 2 * world]: receive counts
    send_units, send_tokens = counts[:, rank].tolist(), counts[:, world + rank].tolist()
    send_ragged = plan.ragged_units(send_units, send_tokens)
    recv_ragged = plan.ragged_units(plan.recv_units, plan.recv_tokens)
    return _StepCall(local, received, plan, plan.plan, rank, group, send_units,
                     [u - r for u, r in zip(send_units, send_ragged)], send_ragged,
                     [u - r for u, r in zip(plan.recv_units, recv_ragged)], recv_ragged,
                     plan.full_slots, bool(counts.any()))


def context_parallel_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                               plan: ContextParallelPlan | ContextParallelStep, *, group=None, causal=False,
                               sm_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Block-sparse (or per-token selection) attention with the sequence sharded over the ranks of
    ``group``.

    Args:
        q_local, k_local, v_local: this rank's shards ``[B, H, n_local, D]`` as
            ``plan.shard(x, rank, dim=2)`` gives them (``Hq % Hkv == 0``: GQA/MQA).
        plan: a static :class:`~sparse_io_attn.distributed.plan.ContextParallelPlan` (built from a
            layout known in advance, the same on every rank), or this rank's
            :class:`~sparse_io_attn.distributed.step.ContextParallelStep` of a selection chosen this
            step (``ContextParallelPlan.for_sequence(...).step(layout_or_selection)``, built on every
            rank from the same plan). ``world_size`` = the group's size.
        group: the process group (default: the default group). Without ``torch.distributed``
            initialised, a one-rank plan runs locally.
        causal: must equal the plan's ``causal`` (``True``, ``"top_left"`` and ``"bottom_right"``
            coincide for self-attention); the plan already applies it.
        sm_scale, backend: as for :func:`~sparse_io_attn.block_sparse_attention` (a step of a
            per-token selection runs :func:`~sparse_io_attn.selection_attention`'s backends).

    Returns this rank's output ``[B, Hq, n_local, D]`` in shard order (``plan.unshard`` puts the
    ranks' outputs back in token order). Output and q/k/v gradients equal
    ``block_sparse_attention`` of the unsharded tensors on ``plan.layout`` (for a step:
    ``block_sparse_attention`` or ``selection_attention`` on the step's selection) to fp32 rounding;
    dK/dV of this rank's keys include the contributions of every rank that read them.

    Ranks agree before anything moves: every check this call can fail (the plan's world size and an
    in-place edit of its layout, the step's rank and head groups, shard lengths, shapes, dtypes,
    devices, ``causal``, ``sm_scale``, ``backend``) runs first, then one ``all_gather`` of a
    fixed-size int64 descriptor per rank (:func:`agreement_bytes` each) compares across ranks what
    must match: the plan (world size, sequence length, block size, causality, the digest of its
    layout's contents and of its assignment), the step's digest (its plan, kind, key block, batch
    and head groups), the q/k/v dtypes, batch, query and KV heads, head dim, whether a backward will
    run (q/k/v ``requires_grad`` and ``torch.is_grad_enabled()``), the backend and ``sm_scale``; for
    a step it also carries the units and tokens each rank receives from each other, so every rank
    learns what it sends. A rank whose checks failed, or any difference, raises the same
    ``ValueError`` on every rank, naming the rank and what differs (``"rank 1 has q dtype
    torch.bfloat16, rank 0 torch.float32"``); no rank has started an exchange, so the group stays
    usable. What the agreement cannot see, a rank that stops between this forward and its backward
    (an exception in the caller's own code), leaves its peers waiting in the backward's exchange
    until the process group's timeout: create the group with one, ``init_process_group(...,
    timeout=datetime.timedelta(seconds=300))`` (a few times the longest step; PyTorch's default is
    10 minutes for NCCL and 30 for gloo).

    Collectives after the agreement, static plan: one ``all_to_all_single`` of the K/V blocks (and
    spread rows' queries) in forward and one of their dK/dV (and dQ) in backward, skipped when the
    plan sends nothing; with spread rows, one more each way (partial results in forward,
    ``do``/``out``/statistics in backward). Step: one ``all_to_all_single`` of the requested unit
    ids, one of the K/V units in forward and one of their dK/dV in backward, skipped when no rank
    receives anything. Their bytes (not the agreement's) are counted under
    :class:`~sparse_io_attn.tally.IOCounter` (``io.network``) and predicted by
    :func:`sparse_io_attn.accounting.traffic.context_parallel` (static) and
    :func:`sparse_io_attn.accounting.traffic.context_parallel_steps` (steps).
    """
    return _run(q_local, k_local, v_local, plan, group, causal, sm_scale, backend)


def _run(q_local, k_local, v_local, plan, group, causal, sm_scale, backend, error: Exception | None = None):
    """:func:`context_parallel_attention`; ``error``: a failure the caller met before on this rank
    (e.g. :class:`~sparse_io_attn.distributed.ContextParallelSelfAttention`'s input check), raised on
    every rank through the agreement."""
    call = _prepare(q_local, k_local, v_local, plan, group, causal, sm_scale, backend, error)
    q, k, v = (t.contiguous() for t in (q_local, k_local, v_local))
    if isinstance(call, _StepCall):
        return _ContextParallelStepAttention.apply(q, k, v, call)
    return _ContextParallelAttention.apply(q, k, v, call)


__all__ = ["agreement_bytes", "context_parallel_attention", "merge_partials"]
