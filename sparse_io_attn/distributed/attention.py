"""`context_parallel_attention`: block-sparse attention over a sequence sharded across ranks by a
:class:`~sparse_io_attn.distributed.plan.ContextParallelPlan`.

Each rank receives exactly the K/V blocks its query rows read and it does not own, with one
``torch.distributed.all_to_all_single`` (never an all-gather), and computes its rows through the
block-sparse backends (:func:`sparse_io_attn.block_sparse.api.prologue` and the backends'
``forward``/``backward``, the path of :func:`~sparse_io_attn.block_sparse_attention`).

Overlap: the exchange starts with ``async_op=True``; while it runs the rank computes its rows
against its own keys (the plan's ``local`` layout); then against the received keys (``received``
layout); the two partial results merge through their row statistics (:func:`merge_partials`).
Backward mirrors it: the received keys' dK/dV are computed first and sent back to their owners
(the reverse ``all_to_all_single``, started asynchronously) while the local part's gradients are
computed; the owner adds what comes back in rank order (deterministic). Both parts' backward use the
merged statistics, so every gradient is the one of the whole softmax.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from sparse_io_attn.accounting.network import BACKWARD, FORWARD
from sparse_io_attn.block_sparse.api import Prologue, backend_module, prologue
from sparse_io_attn.block_sparse.causal import causal_offset
from sparse_io_attn.distributed.plan import ContextParallelPlan, Exchange
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
    local: Prologue                      # the local part (its rows x its own keys), validated
    plan: ContextParallelPlan
    rank: int
    exchange: Exchange | None            # None: no collective (a single rank, or nothing to send)
    group: object
    causal: bool


def _start(buf: torch.Tensor, out_rows: int, splits_out: list, splits_in: list, call: _Call, collective: str,
           names: tuple[str, str]):
    """Start ``all_to_all_single`` of ``buf`` (``[tokens, 2, B, H, D]``) asynchronously; count its bytes."""
    recv = buf.new_empty((out_rows,) + tuple(buf.shape[1:]))
    work = dist.all_to_all_single(recv, buf, output_split_sizes=splits_out, input_split_sizes=splits_in,
                                  group=call.group, async_op=True)
    per_tensor = lambda t: t.numel() // 2 * t.element_size()  # noqa: E731  (the pair is stacked on dim 1)
    count_network(collective, {n: per_tensor(buf) for n in names}, {n: per_tensor(recv) for n in names})
    return recv, work


def _received_call(q, k_r, v_r, call: _Call) -> Prologue:
    received = call.plan.rank_layouts(call.rank).received
    return prologue(q, k_r, v_r, received, causal=False, sm_scale=call.local.sm_scale, backend=call.local.backend)


def _kwargs(p: Prologue) -> dict:
    return dict(causal_offset=p.causal_offset, sm_scale=p.sm_scale, layout_strides=p.layout_strides)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        mod = backend_module(call.local.backend)
        ex = call.exchange
        k_r = v_r = None
        if ex is not None:
            send = torch.stack([k, v]).index_select(3, torch.cat(ex.send_index).to(k.device))
            recv, work = _start(send.movedim(3, 0).contiguous(), sum(ex.recv_splits), ex.recv_splits,
                                ex.send_splits, call, FORWARD, ("k", "v"))
        out, lse, stats = mod.forward(q, k, v, call.local.layout, **_kwargs(call.local))
        if ex is not None:
            work.wait()
            if recv.shape[0]:
                kv = recv.index_select(0, ex.recv_order.to(recv.device)).movedim(0, 3)   # [2, B, Hkv, n_recv, D]
                k_r, v_r = kv[0].contiguous(), kv[1].contiguous()
                part = _received_call(q, k_r, v_r, call)
                out2, _, stats2 = mod.forward(q, k_r, v_r, part.layout, **_kwargs(part))
                out, lse, stats = merge_partials(out, stats, out2, stats2)
        ctx.save_for_backward(q, k, v, k_r, v_r, out, stats)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():
            raise NotImplementedError("context_parallel_attention: double backward (create_graph=True) is "
                                      "not supported: the backward kernels are not differentiable")
        q, k, v, k_r, v_r, out, stats = ctx.saved_tensors
        call = ctx.call
        ex = call.exchange
        mod = backend_module(call.local.backend)
        do = do.contiguous()
        dq_r = None
        if ex is not None:
            if k_r is not None:
                part = _received_call(q, k_r, v_r, call)
                dq_r, dk_r, dv_r = mod.backward(do, q, k_r, v_r, out, stats, part.layout, **_kwargs(part))
                back = torch.stack([dk_r, dv_r]).movedim(3, 0).index_select(0, ex.recv_inverse.to(q.device))
            else:
                back = k.new_empty((0, 2) + (k.shape[0], k.shape[1], k.shape[3]))
            grads, work = _start(back.contiguous(), sum(ex.send_splits), ex.send_splits, ex.recv_splits, call,
                                 BACKWARD, ("dk", "dv"))
        dq, dk, dv = mod.backward(do, q, k, v, out, stats, call.local.layout, **_kwargs(call.local))
        if dq_r is not None:
            dq = (dq.float() + dq_r.float()).to(dq.dtype)
        if ex is not None:
            work.wait()
            dkv = torch.stack([dk, dv]).float()
            start = 0
            for index, rows in zip(ex.send_index, ex.send_splits):      # rank order: deterministic sums
                if rows:
                    dkv.index_add_(3, index.to(dkv.device), grads[start:start + rows].movedim(0, 3).float())
                start += rows
            dk, dv = dkv[0].to(dk.dtype), dkv[1].to(dv.dtype)
        return dq, dk, dv, None


def _group_rank(group, plan: ContextParallelPlan) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group for ``None``; one process without
    ``torch.distributed`` initialised counts as a group of one)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        world, rank = 1, 0
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.world_size:
        raise ValueError(f"the process group has {world} ranks but the plan was built for {plan.world_size}; "
                         f"build ContextParallelPlan(layout, {world}) (or pass the matching group)")
    return world, rank


def _check_local(q, k, v, plan: ContextParallelPlan, rank: int, causal, sm_scale, backend) -> Prologue:
    """This rank's inputs against the plan (shard lengths, then :func:`prologue` on the local part)."""
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
    local = plan.rank_layouts(rank).local
    return prologue(q, k, v, local, causal=False, sm_scale=sm_scale, backend=backend)


def _agree(error: Exception | None, group, world: int, rank: int) -> None:
    """Every rank raises when any rank's inputs were refused (one small all-reduce before the
    exchange, so no rank waits in a collective its peers never start)."""
    if world > 1:
        flag = torch.tensor([0 if error is None else rank + 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if error is None and int(flag):
            raise ValueError(f"context_parallel_attention: rank {int(flag) - 1}'s inputs were refused "
                             f"(its error names the fix); no rank started the exchange")
    if error is not None:
        raise error


def context_parallel_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                               plan: ContextParallelPlan, *, group=None, causal=False,
                               sm_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Block-sparse attention with the sequence sharded over the ranks of ``group``.

    Args:
        q_local, k_local, v_local: this rank's shards ``[B, H, n_local, D]`` as
            ``plan.shard(x, rank, dim=2)`` gives them (``Hq % Hkv == 0``: GQA/MQA).
        plan: a :class:`~sparse_io_attn.distributed.plan.ContextParallelPlan` built with
            ``world_size`` = the group's size, the same on every rank.
        group: the process group (default: the default group). Without ``torch.distributed``
            initialised, a one-rank plan runs locally.
        causal: must equal the plan's ``causal`` (``True``, ``"top_left"`` and ``"bottom_right"``
            coincide for self-attention); the plan already applies it.
        sm_scale, backend: as for :func:`~sparse_io_attn.block_sparse_attention`.

    Returns this rank's output ``[B, Hq, n_local, D]`` in shard order (``plan.unshard`` puts the
    ranks' outputs back in token order). Output and q/k/v gradients equal
    ``block_sparse_attention`` of the unsharded tensors on ``plan.layout`` to fp32 rounding; dK/dV of
    this rank's keys include the contributions of every rank that read them.

    Collectives: one ``all_reduce`` of one int64 (every rank agrees its inputs were accepted, so bad
    input raises on every rank instead of hanging one), then one ``all_to_all_single`` of the K/V
    blocks in forward and one of their dK/dV in backward, skipped when the plan sends nothing.
    Their bytes are counted under :class:`~sparse_io_attn.tally.IOCounter` (``io.network``) and
    predicted by :func:`sparse_io_attn.accounting.network.context_parallel`.
    """
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    world, rank = _group_rank(group, plan)
    error, local = None, None
    try:
        local = _check_local(q_local, k_local, v_local, plan, rank, causal, sm_scale, backend)
    except (TypeError, ValueError) as exc:
        error = exc
    _agree(error, group, world, rank)
    exchange = plan.exchange(rank) if world > 1 and plan.exchanges else None
    call = _Call(local, plan, rank, exchange, group, plan.causal)
    q, k, v = (t.contiguous() for t in (q_local, k_local, v_local))
    out, _ = _ContextParallelAttention.apply(q, k, v, call)
    return out


__all__ = ["BACKWARD", "FORWARD", "context_parallel_attention", "merge_partials"]
