"""`ContextParallelSelfAttention`: a :class:`~sparse_io_attn.nn.SparseSelfAttention` layer run with
the sequence sharded over the ranks of a process group (its parameters are the layer's own)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sparse_io_attn.distributed.attention import _run
from sparse_io_attn.distributed.plan import ContextParallelPlan
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.nn.module import SparseSelfAttention


class ContextParallelSelfAttention(nn.Module):
    """Wrap ``layer`` so that ``forward`` takes this rank's tokens ``x_local [B, n_local, E]`` (in the
    order ``plan.shard(x, rank, dim=1)`` gives them) and returns their outputs: the projections run on
    the local tokens, attention through :func:`~sparse_io_attn.distributed.context_parallel_attention`
    (each rank receives only the K/V blocks its rows read).

    Args:
        layer: a ``SparseSelfAttention`` with a fixed layout or ``seqlen -> layout`` pattern (a
            ``selector`` chooses per step, which a plan built once cannot follow).
        plan: a :class:`ContextParallelPlan` of ``layer.layout_for(plan.seqlen)`` with the layer's
            causality, shared by every layer with that layout (build it with :meth:`plan_for`).
        group: the process group of the ranks sharing the sequence (default: the default group).

    Gradients reach the layer's parameters from this rank's tokens only: sum them over the group
    (``all_reduce``) to get the gradient of the whole sequence, as data parallelism does over batches.

    Ranks agree before anything moves (see :func:`context_parallel_attention`): a wrong ``x_local``
    on one rank raises the same ``ValueError`` on every rank. Create the process group with a
    timeout (``init_process_group(..., timeout=datetime.timedelta(seconds=300))``): a rank that
    stops between forward and backward leaves its peers waiting until it expires.
    """

    def __init__(self, layer: SparseSelfAttention, plan: ContextParallelPlan, *, group=None):
        super().__init__()
        if not isinstance(layer, SparseSelfAttention):
            raise TypeError(f"layer must be a sparse_io_attn.nn.SparseSelfAttention, got {type(layer).__name__}")
        if not isinstance(plan, ContextParallelPlan):
            raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
        if layer.selector is not None:
            raise ValueError("context parallelism needs the layer's layout up front (the plan is built from it); "
                             "a layer with a selector chooses its layout per step")
        layout = layer.layout_for(plan.seqlen)
        if not layout.equal(plan.source_layout) or (causal_offset(layer.causal, 1, 1) is not None) != plan.causal:
            raise ValueError(f"the plan was built for {plan.source_layout.name!r} (causal={plan.causal}) but the layer "
                             f"attends with {layout.name!r} (causal={layer.causal!r}); build it with "
                             f"ContextParallelSelfAttention.plan_for(layer, seqlen, world_size)")
        self.layer, self.plan, self.group = layer, plan, group

    @staticmethod
    def plan_for(layer: SparseSelfAttention, seqlen: int, world_size: int, **kwargs) -> ContextParallelPlan:
        """The plan of ``layer``'s layout for ``seqlen`` tokens over ``world_size`` ranks (``kwargs``:
        ``balance``, ``tolerance``, ``split_rows`` of :class:`ContextParallelPlan`)."""
        return ContextParallelPlan(layer.layout_for(seqlen), world_size, causal=layer.causal, **kwargs)

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
        return layer.project_out(_run(q, k, v, self.plan, self.group, layer.causal, None, layer.backend, error))
