"""Selection attention as ``torch.library`` custom ops: the one path of every call, eager and compiled.

* ``selection_attn_fwd(q, k, v, rows, row_counts, meta, causal_offset, sm_scale, backend) -> (out, lse, stats)``
* ``selection_attn_bwd(do, q, k, v, out, stats, rows, row_counts, meta, causal_offset, sm_scale, backend) -> (dq, dk, dv)``

A :class:`~sparse_io_attn.selection.plan.SelectionPlan` crosses the boundary as its normalised
``rows`` / ``row_counts`` and its integers ``meta``; :meth:`SelectionPlan.from_op` finds the plan
object (with the key-major lists it built) or rebuilds one over the tensors. Inside
``torch.compile`` the plan is built in the graph from the indices (tensor operations of fixed
shapes), so a new selection of the same shapes reuses the graph. The backends are plain functions
of ``(q, k, v, plan, sm_scale)``: ``"cpu"`` (C++), ``"triton"`` and ``"torch"``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_io_attn.block_sparse.op import no_double_backward
from sparse_io_attn.selection import torch_path
from sparse_io_attn.selection.plan import SelectionPlan


def cpu_backend():
    """Backend ``"cpu"`` (the C++ kernels, built on first use)."""
    from sparse_io_attn.selection import cpu
    return cpu


def _triton_backend():
    """Backend ``"triton"``, imported on first use (importing Triton is slow and optional)."""
    from sparse_io_attn.selection.triton import launch
    return launch


def forward(q: Tensor, k: Tensor, v: Tensor, plan: SelectionPlan, sm_scale: float, backend: str):
    """``(out, lse, stats)`` of backend ``backend`` (inputs validated, plan on q's device)."""
    if backend == "cpu":
        return cpu_backend().forward(q, k, v, plan, sm_scale=sm_scale)
    if backend == "triton":
        return _triton_backend().forward(q, k, v, plan, sm_scale=sm_scale)
    return torch_path.forward(q, k, v, plan, sm_scale=sm_scale)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, plan: SelectionPlan,
             sm_scale: float, backend: str):
    """``(dq, dk, dv)`` of backend ``backend``; dk/dv summed over each GQA group."""
    if backend == "cpu":
        return cpu_backend().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)
    if backend == "triton":
        return _triton_backend().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)
    return torch_path.backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)


def _plan(q: Tensor, k: Tensor, rows: Tensor, row_counts: Tensor, meta, causal_offset) -> SelectionPlan:
    plan = SelectionPlan.from_op(rows, row_counts, meta, causal_offset)
    if plan.seqlen != (q.shape[2], k.shape[2]):
        raise ValueError(f"the selection plan is for seqlen (q, k) = {plan.seqlen} but the inputs have "
                         f"({q.shape[2]}, {k.shape[2]})")
    plan.head_map(q.shape[0], q.shape[1], k.shape[1])
    return plan


@torch.library.custom_op("sparse_io_attn::selection_attn_fwd", mutates_args=())
def selection_attn_fwd(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, row_counts: Tensor, meta: list[int],
                       causal_offset: Optional[int], sm_scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq])``."""
    out, lse, stats = forward(q, k, v, _plan(q, k, rows, row_counts, meta, causal_offset), sm_scale, backend)
    return out.contiguous(), lse.contiguous(), stats.contiguous()


@selection_attn_fwd.register_fake
def _(q, k, v, rows, row_counts, meta, causal_offset, sm_scale, backend):
    B, Hq, Nq, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            q.new_empty((2, B, Hq, Nq), dtype=torch.float32))


def _bwd(do, q, k, v, out, stats, rows, row_counts, meta, causal_offset, sm_scale, backend):
    plan = _plan(q, k, rows, row_counts, meta, causal_offset)
    dq, dk, dv = backward(do, q, k, v, out, stats, plan, sm_scale, backend)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@torch.library.custom_op("sparse_io_attn::selection_attn_bwd", mutates_args=())
def selection_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, rows: Tensor,
                       row_counts: Tensor, meta: list[int], causal_offset: Optional[int], sm_scale: float,
                       backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` shaped like q, k, v (dk/dv summed over each GQA group)."""
    return _bwd(do, q, k, v, out, stats, rows, row_counts, meta, causal_offset, sm_scale, backend)


@selection_attn_bwd.register_fake
def _(do, q, k, v, out, stats, rows, row_counts, meta, causal_offset, sm_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, rows, row_counts, meta, causal_offset, sm_scale, backend = inputs
    out, lse, stats = output
    ctx.save_for_backward(q, k, v, out, stats, rows, row_counts)
    ctx.args = (meta, causal_offset, sm_scale, backend)
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, dout, _dlse, _dstats):
    no_double_backward("sparse_io_attn::selection_attn_fwd")
    q, k, v, out, stats, rows, row_counts = ctx.saved_tensors
    dout = dout.contiguous()
    if all(type(t) is Tensor for t in (dout, q, k, v)):    # eager: the backward op's implementation, one dispatch less
        dq, dk, dv = _bwd(dout, q, k, v, out, stats, rows, row_counts, *ctx.args)
    else:                                                  # traced: the opaque op, so the graph holds it
        dq, dk, dv = selection_attn_bwd(dout, q, k, v, out, stats, rows, row_counts, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


selection_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["backward", "cpu_backend", "forward", "selection_attn_bwd", "selection_attn_fwd"]
