"""One rank's call of :func:`~sparse_io_attn.distributed.context_parallel_attention`, decided before
any collective: every check it can fail on (the plan or step against the group and the shards, the
local, received and foreign parts prepared and their backends loaded), then, over more than one
rank, the agreement (:mod:`.agreement`), which for a step also tells each rank what every other
asks of it. A failure is carried into the agreement, so every rank raises it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn.block_sparse import op
from sparse_io_attn.block_sparse.api import Call, prepare
from sparse_io_attn.distributed.agreement import _FIELDS, _MESSAGE_BYTES, _agree, _describe, _group_rank
from sparse_io_attn.distributed.exchange import Exchange
from sparse_io_attn.distributed.plan import ContextParallelPlan
from sparse_io_attn.distributed.step import ContextParallelStep
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import api as selection_api
from sparse_io_attn.selection import op as selection_op
from sparse_io_attn.selection.plan import SelectionPlan


class _Call(NamedTuple):
    """One rank's call, decided before any collective."""
    local: Call                      # the local part (its rows x its own keys), validated
    received: Call | None            # its rows x the keys it receives (None: it receives none)
    foreign: Call | None             # the spread queries it receives x its keys (None: none)
    plan: ContextParallelPlan
    rank: int
    exchange: Exchange | None            # None: no collective (a single rank, or nothing to send)
    group: object


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
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"context parallelism moves K and V as one unit of equal head dims; v has head "
                                  f"dim {v.shape[-1]} and q {q.shape[-1]}: pad v to {q.shape[-1]} or run "
                                  f"block_sparse_attention / selection_attention on one device")
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
