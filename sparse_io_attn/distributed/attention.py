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

import torch

from sparse_io_attn.block_sparse import op
from sparse_io_attn.block_sparse.api import Call
from sparse_io_attn.distributed.agreement import agreement_bytes
from sparse_io_attn.distributed.call import _Call, _prepare, _StepCall
from sparse_io_attn.distributed.exchange import _Part, _rows, _start, _tokens, _Units
from sparse_io_attn.distributed.plan import ContextParallelPlan
from sparse_io_attn.distributed.step import ContextParallelStep
from sparse_io_attn.distributed.traffic import BACKWARD, BACKWARD_INPUTS, FORWARD, PARTIALS, REQUESTS

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


def _forward(q, k, v, part: Call):
    return op.forward(q, k, v, part.plan, part.sm_scale, part.backend)


def _backward(do, q, k, v, out, stats, part: Call):
    return op.backward(do, q, k, v, out, stats, part.plan, part.sm_scale, part.backend)


def _save(ctx, call, *tensors) -> None:
    """What backward needs: the tensors and the call."""
    ctx.save_for_backward(*tensors)
    ctx.call = call


def _saved(ctx) -> tuple:
    """``(tensors, call)`` a forward saved; double backward is refused (the kernels are not differentiable)."""
    if torch.is_grad_enabled():
        raise NotImplementedError("context_parallel_attention: double backward (create_graph=True) is "
                                  "not supported: the backward kernels are not differentiable")
    return ctx.saved_tensors, ctx.call


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
        _save(ctx, call, q, k, v, k_r, v_r, out, stats, send_rows, send_groups)
        return out

    @staticmethod
    def backward(ctx, do):
        (q, k, v, k_r, v_r, out, stats, send_rows, send_groups), call = _saved(ctx)
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
            _save(ctx, call, q, k, v, k_r, v_r, q_f, out, stats)
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
        _save(ctx, call, q, k, v, k_r, v_r, q_f, out, stats)
        return out

    @staticmethod
    def backward(ctx, do):
        (q, k, v, k_r, v_r, q_f, out, stats), call = _saved(ctx)
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
