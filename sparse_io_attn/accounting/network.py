"""The network traffic of context parallelism: the bytes each rank sends and receives in
:func:`sparse_io_attn.distributed.context_parallel_attention`, next to what an all-gather of K/V and
a ring would move, and the floor.

The model reads the plan through its public methods only (duck-typed: ``world_size``, ``seqlen``,
``send_blocks(src, dst)``, ``tokens(blocks)``, ``num_tokens(rank)``, ``exchanges``, ``owner``,
``block_sizes``, ``layout``), so this floor-3 module needs nothing from :mod:`sparse_io_attn.distributed`
(floor 4). A K/V token costs ``head_dim * element size * 2 (k and v) * batch * num_heads_kv`` bytes;
blocks count their real tokens (the last block of the sequence may be ragged).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn.tally.report import TrafficReport

#: the collectives' names, as :func:`sparse_io_attn.distributed.context_parallel_attention` counts them
FORWARD, BACKWARD = "context_parallel.forward", "context_parallel.backward"


@dataclass(frozen=True)
class ContextParallelTraffic:
    """Bytes per rank (tuples indexed by rank) of one context-parallel attention call.

    * ``send``, ``recv``: K and V together, forward (backward moves the same sizes the other way:
      the dK/dV of received blocks go back to their owners).
    * ``floor``: the K/V bytes of the blocks a rank's rows read and it does not own, computed from
      the layout's kept blocks independently of the send sets; ``recv`` equals it.
    * ``all_gather``: what an all-gather of K/V delivers (every token the rank does not own).
    * ``ring``: ring attention's ``W - 1`` steps of one shard each, shards padded to the largest
      (the fixed-size send/receive of a ring), forward only.
    """
    world_size: int
    token_bytes: int
    send: tuple
    recv: tuple
    floor: tuple
    all_gather: tuple
    ring: tuple
    exchanges: bool

    def report(self, rank: int, *, backward: bool = True) -> TrafficReport:
        """The network :class:`TrafficReport` (``source="predicted"``) of ``rank``: per collective,
        bytes received as read and sent as written, per tensor; equal to ``IOCounter().network``
        after a forward (and backward) on that rank. Empty when the plan sends nothing."""
        rep = TrafficReport(source="predicted")
        if self.world_size > 1 and self.exchanges:
            half = lambda b: {"k": b // 2, "v": b // 2}  # noqa: E731
            rep.add(FORWARD, half(self.recv[rank]), half(self.send[rank]))
            if backward:
                rep.add(BACKWARD, {"dk": self.send[rank] // 2, "dv": self.send[rank] // 2},
                        {"dk": self.recv[rank] // 2, "dv": self.recv[rank] // 2})
        return rep


def context_parallel(plan, *, batch: int, num_heads_kv: int, head_dim: int,
                     dtype: torch.dtype = torch.bfloat16) -> ContextParallelTraffic:
    """The network traffic (:class:`ContextParallelTraffic`) of ``plan`` (a
    :class:`~sparse_io_attn.distributed.ContextParallelPlan`) for K/V of ``[batch, num_heads_kv,
    seqlen, head_dim]`` in ``dtype``; O(kept blocks + world_size ** 2)."""
    for name, value in (("batch", batch), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    W = plan.world_size
    token = head_dim * torch.empty((), dtype=dtype).element_size() * 2 * batch * num_heads_kv
    sent = [[plan.tokens(plan.send_blocks(s, d)) for d in range(W)] for s in range(W)]
    send = tuple(token * sum(row) for row in sent)
    recv = tuple(token * sum(sent[s][d] for s in range(W)) for d in range(W))
    shard = [plan.num_tokens(r) for r in range(W)]
    _, rows, cols = plan.layout.entries()
    owner, R = plan.owner, plan.owner.numel()
    dst = owner[rows]
    other = dst != owner[cols]
    read = torch.unique(dst[other] * R + cols[other])                   # (reader, block), once each
    floor = torch.zeros(W, dtype=torch.int64).index_add_(0, read // R, plan.block_sizes[read % R])
    return ContextParallelTraffic(
        world_size=W, token_bytes=token, send=send, recv=recv, floor=tuple(token * int(f) for f in floor),
        all_gather=tuple(token * (plan.seqlen - n) for n in shard),
        ring=tuple(token * (W - 1) * max(shard) for _ in range(W)), exchanges=bool(plan.exchanges))


__all__ = ["BACKWARD", "ContextParallelTraffic", "FORWARD", "context_parallel"]
