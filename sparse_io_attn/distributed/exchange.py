"""What one rank's call moves and how: the ``all_to_all_single`` exchanges of
:func:`~sparse_io_attn.distributed.context_parallel_attention`.

* :class:`Exchange`: a static plan's exchange for one rank, in tokens (what it sends each rank,
  where each received token lands), built from its send lists by :func:`rank_exchange` (what
  :meth:`~sparse_io_attn.distributed.plan.ContextParallelPlan.exchange` caches).
* ``_Units``: a step's K/V seen as units (one key block of one unit group), gathered, placed and
  summed whole, with no index per token.
* ``_start``: one asynchronous ``all_to_all_single`` moving several tensors in one flat buffer,
  its bytes counted under the collective's name (:mod:`.traffic`) by
  :class:`~sparse_io_attn.tally.IOCounter`; ``_rows``/``_tokens``: tensors to and from the rows it moves.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from sparse_io_attn.distributed.balance import _ranges
from sparse_io_attn.distributed.step import ContextParallelStep
from sparse_io_attn.tally.counter import count_network


class Exchange(NamedTuple):
    """What one rank's ``all_to_all_single`` moves, in tokens. ``send_index[dst]``: positions in the
    rank's shard of the tokens it sends ``dst`` (blocks ascending); ``send_splits``/``recv_splits``:
    tokens sent to / received from each rank; ``recv_order``: row of the receive buffer (grouped by
    source rank) holding each received token in ascending global order; ``recv_inverse`` its inverse.
    The ``q_`` fields describe the query tokens of spread rows the same way."""
    send_index: tuple
    send_splits: list
    recv_splits: list
    recv_order: torch.Tensor
    recv_inverse: torch.Tensor
    q_send_index: tuple
    q_send_splits: list
    q_recv_splits: list
    q_recv_order: torch.Tensor
    q_recv_inverse: torch.Tensor


def rank_exchange(plan, rank: int) -> Exchange:
    """The :class:`Exchange` of rank ``rank`` under ``plan`` (a static plan)."""
    return Exchange(*_tokens_moved(plan, rank, plan.send_blocks), *_tokens_moved(plan, rank, plan.send_queries))


def _tokens_moved(plan, rank: int, sends) -> tuple:
    W = plan.world_size
    send = tuple(plan.local_positions(sends(rank, dst)) for dst in range(W))
    incoming = [sends(src, rank) for src in range(W)]
    blocks = torch.cat(incoming)
    sizes = plan.block_sizes[blocks]
    starts = torch.cumsum(sizes, 0) - sizes                          # buffer row of each block
    order = torch.argsort(blocks)
    recv_order = _ranges(starts[order], sizes[order])
    return send, [int(t.numel()) for t in send], [plan.tokens(b) for b in incoming], recv_order, \
        torch.argsort(recv_order)


class _Part(NamedTuple):
    """One tensor of an exchange: ``rows`` ``[tokens, features]`` grouped by destination rank,
    ``send``/``recv`` the tokens to/from each rank, ``names`` the tensors sharing its bytes equally."""
    rows: torch.Tensor
    send: list
    recv: list
    names: tuple


def _start(parts: list, call, collective: str):
    """Start one ``all_to_all_single`` moving every part (one flat buffer, per-rank element splits;
    asynchronous) over the group of ``call`` (a static plan's or a step's) and count its bytes under
    ``collective``; returns ``finish()``, which waits and gives each part's received rows ``[tokens,
    features]`` grouped by source rank."""
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


def _rows(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Tokens ``index`` of ``x`` along ``dim`` as rows ``[tokens, features]``."""
    features = x.numel() // x.shape[dim]
    return x.index_select(dim, index.to(x.device)).movedim(dim, 0).reshape(index.numel(), features)


def _tokens(rows: torch.Tensor, order: torch.Tensor, shape: tuple, dim: int) -> torch.Tensor:
    """Rows back to a tensor with tokens (taken in ``order``) along ``dim``; ``shape`` per token."""
    return rows.index_select(0, order.to(rows.device)).view(-1, *shape).movedim(0, dim).contiguous()


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


__all__ = ["Exchange", "rank_exchange"]
