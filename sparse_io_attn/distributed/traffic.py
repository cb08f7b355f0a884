"""The network traffic of context parallelism: the bytes each rank sends and receives in
:func:`sparse_io_attn.distributed.context_parallel_attention`, next to what an all-gather of K/V and
a ring would move, and the floor.

The collectives' names are defined here, beside the model that predicts their bytes; the attention
(:mod:`.attention`) counts under them. The model reads the plan through its public methods only
(``world_size``, ``seqlen``, ``send_blocks(src, dst)``, ``send_queries(src, dst)``,
``tokens(blocks)``, ``num_tokens(rank)``, ``exchanges``, ``spreads``, ``owner``, ``spread``,
``block_sizes``, ``layout``) and imports nothing else of :mod:`sparse_io_attn.distributed`;
:mod:`sparse_io_attn.accounting.traffic` re-exports :func:`context_parallel` and
:func:`context_parallel_steps` next to the other models. A K/V token costs ``head_dim * element
size * 2 (k and v) * batch * num_heads_kv`` bytes; blocks count their real tokens (the last block
of the sequence may be ragged).

Steps (:func:`context_parallel_steps`, a selection chosen every step) move units: one key block of
one unit group (the batch elements and K/V heads one selection serves), ``head_dim * element size *
2 * (batch / Lb) * (num_heads_kv / Gk)`` bytes per token, read from every rank's step (duck-typed:
``plan``, ``rank``, ``recv_units``, ``recv_tokens``, ``batch_groups``, ``kv_groups``,
``floor_units()``, ``unit_tokens()``, ``num_key_blocks``), plus the requested unit ids (8 bytes each).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn.tally.report import TrafficReport

#: the collectives' names, as :func:`sparse_io_attn.distributed.context_parallel_attention` counts them
FORWARD, BACKWARD = "context_parallel.forward", "context_parallel.backward"
PARTIALS, BACKWARD_INPUTS = "context_parallel.partials", "context_parallel.backward_inputs"
REQUESTS = "context_parallel.requests"
#: bytes of one requested unit id (int64)
REQUEST_BYTES = 8


@dataclass(frozen=True)
class ContextParallelTraffic:
    """Bytes per rank (tuples indexed by rank) of one context-parallel attention call.

    * ``send``, ``recv``: K and V together, forward (backward moves the same sizes the other way:
      the dK/dV of received blocks go back to their owners).
    * ``q_send``, ``q_recv``: the queries of spread rows, forward (their dQ comes back in backward:
      the same sizes the other way). Per query token sent, the computing rank sends back the
      partial output and row statistics in fp32 (``o_token_bytes``, ``stats_token_bytes``:
      ``batch * num_heads_q`` rows of ``head_dim`` and of 2 values) and, in backward, receives
      ``do``, ``out`` and the statistics in fp32.
    * ``floor``: the K/V bytes of the blocks a rank's rows (those not spread) read and it does not
      own, computed from the layout's kept blocks independently of the send sets; ``recv`` equals it.
    * ``all_gather``: what an all-gather of K/V delivers (every token the rank does not own).
    * ``ring``: ring attention's ``W - 1`` steps of one shard each, shards padded to the largest
      (the fixed-size send/receive of a ring), forward only.
    * ``req_send``, ``req_recv`` (steps only, else ``None``): the requested unit ids a rank sends
      (its own requests) and receives (what others ask of it), before the K/V exchange.
    """
    world_size: int
    token_bytes: int
    q_token_bytes: int
    o_token_bytes: int
    stats_token_bytes: int
    send: tuple
    recv: tuple
    q_send: tuple
    q_recv: tuple
    floor: tuple
    all_gather: tuple
    ring: tuple
    exchanges: bool
    spreads: bool
    req_send: tuple | None = None
    req_recv: tuple | None = None

    def report(self, rank: int, *, backward: bool = True) -> TrafficReport:
        """The network :class:`TrafficReport` (``source="predicted"``) of ``rank``: per collective,
        bytes received as read and sent as written, per tensor; equal to ``IOCounter().network``
        after a forward (and backward) on that rank. Empty when the plan sends nothing."""
        rep = TrafficReport(source="predicted")
        if self.world_size == 1 or not self.exchanges:
            return rep
        kv = lambda b, pre="": {pre + "k": b // 2, pre + "v": b // 2}  # noqa: E731
        send, recv = self.send[rank], self.recv[rank]
        q_send, q_recv = self.q_send[rank], self.q_recv[rank]
        # query tokens: of its own spread rows sent out (q_out), of other ranks' received (q_in)
        q_out, q_in = q_send // self.q_token_bytes, q_recv // self.q_token_bytes
        o, st = self.o_token_bytes, self.stats_token_bytes
        if self.req_send is not None:                                 # a step: requests, then K/V units
            rep.add(REQUESTS, {"requests": self.req_recv[rank]}, {"requests": self.req_send[rank]})
            rep.add(FORWARD, kv(recv), kv(send))
            if backward:
                rep.add(BACKWARD, kv(send, "d"), kv(recv, "d"))
            return rep
        rep.add(FORWARD, {**kv(recv), "q": q_recv}, {**kv(send), "q": q_send})
        if self.spreads:
            rep.add(PARTIALS, {"o": q_out * o, "stats": q_out * st}, {"o": q_in * o, "stats": q_in * st})
        if backward:
            if self.spreads:
                rep.add(BACKWARD_INPUTS, {"do": q_in * o, "o": q_in * o, "stats": q_in * st},
                        {"do": q_out * o, "o": q_out * o, "stats": q_out * st})
            rep.add(BACKWARD, {**kv(send, "d"), "dq": q_send}, {**kv(recv, "d"), "dq": q_recv})
        return rep


def context_parallel(plan, *, batch: int, num_heads_kv: int, head_dim: int,
                     dtype: torch.dtype = torch.bfloat16, num_heads_q: int | None = None) -> ContextParallelTraffic:
    """The network traffic (:class:`ContextParallelTraffic`) of ``plan`` (a
    :class:`~sparse_io_attn.distributed.ContextParallelPlan`) for K/V of ``[batch, num_heads_kv,
    seqlen, head_dim]`` and queries with ``num_heads_q`` heads (default ``num_heads_kv``) in
    ``dtype``; O(kept blocks + world_size ** 2)."""
    num_heads_q = num_heads_kv if num_heads_q is None else num_heads_q
    for name, value in (("batch", batch), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim),
                        ("num_heads_q", num_heads_q)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    W = plan.world_size
    elem = torch.empty((), dtype=dtype).element_size()
    token = head_dim * elem * 2 * batch * num_heads_kv
    q_token = head_dim * elem * batch * num_heads_q

    def per_rank(sends, unit):
        moved = [[plan.tokens(sends(s, d)) for d in range(W)] for s in range(W)]
        return (tuple(unit * sum(row) for row in moved),
                tuple(unit * sum(moved[s][d] for s in range(W)) for d in range(W)))

    send, recv = per_rank(plan.send_blocks, token)
    q_send, q_recv = per_rank(plan.send_queries, q_token)
    shard = [plan.num_tokens(r) for r in range(W)]
    _, rows, cols = plan.layout.entries()
    owner, R = plan.owner, plan.owner.numel()
    dst = owner[rows]
    other = (dst != owner[cols]) & ~plan.spread[rows]
    read = torch.zeros(W * R, dtype=torch.bool)                         # (reader, block), once each
    read[(dst * R + cols)[other]] = True
    floor = (read.view(W, R).to(torch.int64) * plan.block_sizes).sum(1)
    return ContextParallelTraffic(
        world_size=W, token_bytes=token, q_token_bytes=q_token, o_token_bytes=head_dim * 4 * batch * num_heads_q,
        stats_token_bytes=2 * 4 * batch * num_heads_q, send=send, recv=recv, q_send=q_send, q_recv=q_recv,
        floor=tuple(token * int(f) for f in floor), all_gather=tuple(token * (plan.seqlen - n) for n in shard),
        ring=tuple(token * (W - 1) * max(shard) for _ in range(W)), exchanges=bool(plan.exchanges),
        spreads=bool(plan.spreads))


def context_parallel_steps(steps, *, batch: int, num_heads_kv: int, head_dim: int,
                           dtype: torch.dtype = torch.bfloat16) -> ContextParallelTraffic:
    """The network traffic (:class:`ContextParallelTraffic`) of one step on every rank: ``steps[r]``
    is rank ``r``'s :class:`~sparse_io_attn.distributed.step.ContextParallelStep` (built alike), for
    K/V of ``[batch, num_heads_kv, seqlen, head_dim]`` in ``dtype``. ``recv`` is what each rank
    asked for, ``send`` what the others asked of it; ``floor`` is recomputed from each rank's rows of
    the selection (:meth:`floor_units`: the units read and not owned), independently of the
    requests; ``all_gather`` and ``ring`` move every K/V head of every token. O(units + world_size ** 2)."""
    for name, value in (("batch", batch), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    steps = list(steps)
    plan = steps[0].plan
    W = plan.world_size
    if [s.rank for s in steps] != list(range(W)) or any(s.plan is not plan and s.plan.digest != plan.digest
                                                       for s in steps):
        raise ValueError(f"context_parallel_steps needs the {W} steps of one plan, rank 0 to {W - 1} in order")
    first = steps[0]
    if any((s.batch_groups, s.kv_groups) != (first.batch_groups, first.kv_groups) for s in steps):
        raise ValueError("the steps' unit groups differ: build every rank's step alike")
    Lb, Gk = first.batch_groups, first.kv_groups
    if batch % Lb or num_heads_kv % Gk:
        raise ValueError(f"the steps' units hold {Lb} batch groups and {Gk} K/V head groups, which must divide "
                         f"batch {batch} and num_heads_kv {num_heads_kv}")
    elem = torch.empty((), dtype=dtype).element_size()
    unit = head_dim * elem * 2 * (batch // Lb) * (num_heads_kv // Gk)      # bytes per token of a unit
    token = head_dim * elem * 2 * batch * num_heads_kv
    recv = tuple(unit * sum(s.recv_tokens) for s in steps)
    send = tuple(unit * sum(s.recv_tokens[src] for s in steps) for src in range(W))
    floor = []
    for s in steps:
        ids = s.floor_units()
        floor.append(unit * int(s.unit_tokens().cpu()[ids % s.num_key_blocks].sum()))
    shard = [plan.num_tokens(r) for r in range(W)]
    zeros = (0,) * W
    return ContextParallelTraffic(
        world_size=W, token_bytes=token, q_token_bytes=1, o_token_bytes=0, stats_token_bytes=0, send=send,
        recv=recv, q_send=zeros, q_recv=zeros, floor=tuple(floor),
        all_gather=tuple(token * (plan.seqlen - n) for n in shard),
        ring=tuple(token * (W - 1) * max(shard) for _ in range(W)), exchanges=any(recv), spreads=False,
        req_send=tuple(REQUEST_BYTES * sum(s.recv_units) for s in steps),
        req_recv=tuple(REQUEST_BYTES * sum(s.recv_units[src] for s in steps) for src in range(W)))


__all__ = ["BACKWARD", "BACKWARD_INPUTS", "ContextParallelTraffic", "FORWARD", "PARTIALS", "REQUESTS", "REQUEST_BYTES",
           "context_parallel", "context_parallel_steps"]
