"""`ContextParallelSelfAttention`: a :class:`~sparse_io_attn.nn.SparseSelfAttention` layer run with
the sequence sharded over the ranks of a process group (its parameters are the layer's own)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sparse_io_attn.distributed.agreement import _agree, _describe, _group_rank
from sparse_io_attn.distributed.attention import _run
from sparse_io_attn.distributed.plan import ContextParallelPlan
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.nn.module import SparseSelfAttention
from sparse_io_attn.tally.counter import count_network

#: the collective that gathers a selector's inputs, as :class:`~sparse_io_attn.tally.IOCounter` counts it
SELECTOR_INPUTS = "context_parallel.selector_inputs"


class ContextParallelSelfAttention(nn.Module):
    """Wrap ``layer`` so that ``forward`` takes this rank's tokens ``x_local [B, n_local, E]`` (in the
    order ``plan.shard(x, rank, dim=1)`` gives them) and returns their outputs: the projections run on
    the local tokens, attention through :func:`~sparse_io_attn.distributed.context_parallel_attention`
    (each rank receives only the K/V blocks its rows read).

    Args:
        layer: a ``SparseSelfAttention`` with a fixed layout or ``seqlen -> layout`` pattern, or with
            a ``selector`` that chooses every step (a :class:`~sparse_io_attn.BlockSparseLayout` or a
            per-token :class:`~sparse_io_attn.layout.selection.Selection` from ``(q, k)``).
        plan: for a fixed layout, the static :class:`ContextParallelPlan` of
            ``layer.layout_for(plan.seqlen)`` with the layer's causality, shared by every layer with
            that layout; for a selector, any plan of the sequence (its ownership is used:
            :meth:`ContextParallelPlan.for_sequence`). Build either with :meth:`plan_for`.
        group: the process group of the ranks sharing the sequence (default: the default group).

    With a selector, each forward gathers the selector's inputs, the projected ``q`` and ``k`` of
    every rank (detached: the selection is not differentiable), with one ``all_gather`` (counted as
    :data:`SELECTOR_INPUTS` under :class:`~sparse_io_attn.tally.IOCounter`), runs the selector on the
    whole sequence as the layer would, and builds this step's part of the plan
    (``plan.step(selection)``); the attention then moves only the selected blocks each rank reads.

    Gradients reach the layer's parameters from this rank's tokens only: sum them over the group
    (``all_reduce``) to get the gradient of the whole sequence, as data parallelism does over batches.

    Ranks agree before anything moves (see :func:`context_parallel_attention`): a wrong ``x_local``
    on one rank, or a selector or step that fails on one rank, raises the same ``ValueError`` on every
    rank. Create the process group with a timeout (``init_process_group(...,
    timeout=datetime.timedelta(seconds=300))``): a rank that stops between forward and backward
    leaves its peers waiting until it expires.
    """

    def __init__(self, layer: SparseSelfAttention, plan: ContextParallelPlan, *, group=None):
        super().__init__()
        if not isinstance(layer, SparseSelfAttention):
            raise TypeError(f"layer must be a sparse_io_attn.nn.SparseSelfAttention, got {type(layer).__name__}")
        if not isinstance(plan, ContextParallelPlan):
            raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
        causal = causal_offset(layer.causal, 1, 1) is not None
        if layer.selector is not None:
            if causal != plan.causal:
                raise ValueError(f"the plan was built with causal={plan.causal} but the layer attends with "
                                 f"causal={layer.causal!r}; build it with ContextParallelSelfAttention.plan_for(layer, "
                                 f"seqlen, world_size)")
        elif not plan.is_static:
            raise ValueError("a layer with a fixed layout needs the static plan of that layout (its send sets fixed "
                             "once); build it with ContextParallelSelfAttention.plan_for(layer, seqlen, world_size)")
        else:
            layout = layer.layout_for(plan.seqlen)
            if not layout.equal(plan.source_layout) or causal != plan.causal:
                raise ValueError(f"the plan was built for {plan.source_layout.name!r} (causal={plan.causal}) but the "
                                 f"layer attends with {layout.name!r} (causal={layer.causal!r}); build it with "
                                 f"ContextParallelSelfAttention.plan_for(layer, seqlen, world_size)")
        self.layer, self.plan, self.group = layer, plan, group

    @staticmethod
    def plan_for(layer: SparseSelfAttention, seqlen: int, world_size: int, **kwargs) -> ContextParallelPlan:
        """The plan of ``layer`` for ``seqlen`` tokens over ``world_size`` ranks: for a fixed layout its
        static plan (``kwargs``: ``balance``, ``tolerance``, ``split_rows`` of
        :class:`ContextParallelPlan`); for a selector the plan of the sequence
        (:meth:`ContextParallelPlan.for_sequence`; ``kwargs``: ``balance``, ``row_work``, and
        ``block_size``, by default the selector's ``block_size``)."""
        if layer.selector is None:
            return ContextParallelPlan(layer.layout_for(seqlen), world_size, causal=layer.causal, **kwargs)
        block = kwargs.pop("block_size", getattr(layer.selector, "block_size", None))
        if block is None:
            raise ValueError(f"the selector {layer.selector!r} has no block_size attribute; pass plan_for(layer, "
                             f"seqlen, world_size, block_size=...) (the tokens per block each rank owns)")
        return ContextParallelPlan.for_sequence(seqlen, block, world_size, causal=layer.causal, **kwargs)

    def rank(self) -> int:
        """This process's rank in the group (0 without ``torch.distributed``)."""
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        """``x_local [B, n_local, E]`` -> ``[B, n_local, E]``. A wrong ``x_local`` on one rank raises the
        same ``ValueError`` on every rank (the check joins the attention's agreement)."""
        layer = self.layer
        q = k = v = error = None
        try:
            n = self.plan.num_tokens(self.rank())
            if not isinstance(x_local, torch.Tensor) or x_local.dim() != 3 or x_local.shape[1:] != (n, layer.embed_dim):
                got = tuple(x_local.shape) if isinstance(x_local, torch.Tensor) else type(x_local).__name__
                raise ValueError(f"expected this rank's tokens x_local of shape [batch, {n}, {layer.embed_dim}] "
                                 f"(plan.shard(x, rank, dim=1)), got {got}")
            q, k, v = layer.project(x_local)
        except Exception as exc:        # noqa: BLE001 (carried into the agreement: no rank waits alone)
            error = exc
        plan = self.plan
        if layer.selector is not None:
            plan, error = self._select(q, k, v, error)
        return layer.project_out(_run(q, k, v, plan, self.group, layer.causal, None, layer.backend, error))

    def _select(self, q, k, v, error):
        """This step's part of the plan: the ranks agree (any rank's error raised everywhere), gather
        ``q`` and ``k``, run the selector on the whole sequence and build the rank's step. Returns
        ``(step or plan, error)``: a failure here is carried into the attention's agreement."""
        world, rank = _group_rank(self.group)
        if world > 1:                              # nothing moves unless every rank can take part
            _agree(_describe(q, k, v, self.plan, None, error, world), error, self.group, world)
        elif error is not None:
            raise error
        try:
            with torch.no_grad():
                q_all, k_all = _gather(self.plan, q.detach(), k.detach(), self.group, world)
                selection = self.layer.selector(q_all, k_all)
            return self.plan.step(selection, rank=rank, num_heads_kv=self.layer.num_kv_heads), None
        except Exception as exc:        # noqa: BLE001 (carried into the attention's agreement)
            return self.plan, exc


def _gather(plan: ContextParallelPlan, q: torch.Tensor, k: torch.Tensor, group, world: int):
    """Every rank's ``q`` and ``k`` in token order (one ``all_gather`` of the shards, padded to the
    longest; counted as :data:`SELECTOR_INPUTS`)."""
    if world == 1:
        return q, k
    Hq = q.shape[1]
    qk = torch.cat([q, k], 1)
    longest = max(plan.num_tokens(r) for r in range(world))
    padded = qk.new_zeros((*qk.shape[:2], longest, qk.shape[3]))
    padded[:, :, :qk.shape[2]] = qk
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=group)
    moved = padded.numel() * padded.element_size() * (world - 1)
    count_network(SELECTOR_INPUTS, {"q": moved * Hq // qk.shape[1], "k": moved - moved * Hq // qk.shape[1]},
                  {"q": moved * Hq // qk.shape[1], "k": moved - moved * Hq // qk.shape[1]})
    whole = plan.unshard([s[:, :, :plan.num_tokens(r)] for r, s in enumerate(shards)], 2)
    return whole[:, :Hq], whole[:, Hq:]


__all__ = ["ContextParallelSelfAttention", "SELECTOR_INPUTS"]
