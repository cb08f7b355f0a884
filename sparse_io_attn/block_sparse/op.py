"""Block-sparse attention as ``torch.library`` custom ops: the one path of every call, eager and compiled.

:func:`sparse_io_attn.block_sparse_attention` plans the layout (:mod:`.plan`) and calls
``torch.ops.sparse_io_attn.block_sparse_attn_fwd``; its ``Autograd`` kernel wires the backward to
``block_sparse_attn_bwd``; ``register_fake`` gives ``torch.compile`` the shapes, so a compiled model
sees two opaque nodes and no graph break:

* ``block_sparse_attn_fwd(q, k, v, index, meta, causal_offset, sm_scale, backend) -> (out, lse, stats)``
* ``block_sparse_attn_bwd(do, q, k, v, out, stats, index, meta, causal_offset, sm_scale, backend) -> (dq, dk, dv)``

An :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan` crosses the op boundary as its packed
int32 ``index`` tensor and its integers ``meta`` (few arguments: the dispatcher's cost grows with
their number); inside, :meth:`AttentionPlan.from_op` finds the plan that packed that tensor (or
rebuilds and validates one, for a direct call). ``causal_offset`` is ``None`` or the ``delta`` of
``j <= i + delta``. ``out`` has q's shape and dtype (contiguous), ``lse`` is float32 ``[B, Hq, Nq]``
in natural-log units (``-inf`` on empty rows, not differentiable), ``stats`` float32 ``[2, B, Hq,
Nq]`` (each row's base-2 score maximum and log2 of its sum) is what backward recomputes the
probabilities from.

The backends are plain functions of ``(q, k, v, plan, sm_scale)`` (:func:`forward`,
:func:`backward`): ``"cpu"`` (the fused C++ kernel), ``"triton"`` (CUDA, or Triton's interpreter on
CPU) and ``"torch"`` (plain PyTorch, any device).

The autograd formula calls ``block_sparse_attn_bwd`` when it is traced (fake or functional tensors
under ``torch.compile``: the backward graph holds the op) and the op's implementation directly on
plain tensors in eager autograd, which saves a second dispatcher round trip (about 20 us per step).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_io_attn.block_sparse import torch_path
from sparse_io_attn.block_sparse.plan import AttentionPlan


def cpu_backend():
    """Backend ``"cpu"``, imported on first use: its build module marks ``available_for_auto`` as a
    constant for ``torch.compile``, which imports ``torch._dynamo`` (and with it Triton)."""
    from sparse_io_attn.block_sparse import cpu
    return cpu


def _triton_backend():
    """Backend ``"triton"``, imported on first use (importing Triton is slow and optional)."""
    from sparse_io_attn.block_sparse.triton import launch
    return launch


def forward(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, sm_scale: float, backend: str):
    """``(out, lse, stats)`` of backend ``backend`` (inputs validated, plan on q's device)."""
    if backend == "cpu":
        return cpu_backend().forward(q, k, v, plan, sm_scale=sm_scale)
    if backend == "triton":
        return _triton_backend().forward(q, k, v, plan, sm_scale=sm_scale)
    return torch_path.forward(q, k, v, plan, sm_scale=sm_scale)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, plan: AttentionPlan,
             sm_scale: float, backend: str):
    """``(dq, dk, dv)`` of backend ``backend``; dk/dv summed over each GQA group."""
    if backend == "cpu":
        return cpu_backend().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)
    if backend == "triton":
        return _triton_backend().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)
    return torch_path.backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)


def _plan(q: Tensor, k: Tensor, index: Tensor, meta, causal_offset) -> AttentionPlan:
    plan = AttentionPlan.from_op(index, meta, causal_offset)
    if plan.seqlen != (q.shape[2], k.shape[2]):
        raise ValueError(f"the plan is for seqlen (q, k) = {plan.seqlen} but the inputs have "
                         f"({q.shape[2]}, {k.shape[2]})")
    return plan


# The forward op is defined through ``torch.library.Library`` with its autograd kernel registered on the
# ``Autograd`` key (``_AttentionFn`` below), not through ``torch.library.custom_op`` +
# ``register_autograd``: the latter's generated autograd function refills every argument from the
# schema on each call and wraps the implementation in a ``torch.compiler.disable`` frame, about 20 us
# per forward+backward at small shapes (issue 35's eager-overhead budget; the two styles timed in one
# process). Both are torch.library custom ops: same schema, fake kernel, opcheck, torch.compile.
_LIB = torch.library.Library("sparse_io_attn", "FRAGMENT")
_LIB.define("block_sparse_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor index, int[] meta, int? causal_offset, "
            "float sm_scale, str backend) -> (Tensor, Tensor, Tensor)")


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, index: Tensor, meta: list[int], causal_offset: Optional[int],
              sm_scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq])``."""
    out, lse, stats = forward(q, k, v, _plan(q, k, index, meta, causal_offset), sm_scale, backend)
    return out.contiguous(), lse.contiguous(), stats.contiguous()


_LIB.impl("block_sparse_attn_fwd", _fwd_impl, "CompositeExplicitAutograd")
#: the forward op (``torch.ops.sparse_io_attn.block_sparse_attn_fwd.default``)
block_sparse_attn_fwd = torch.ops.sparse_io_attn.block_sparse_attn_fwd.default


@torch.library.register_fake("sparse_io_attn::block_sparse_attn_fwd")
def _(q, k, v, index, meta, causal_offset, sm_scale, backend):
    B, Hq, Nq, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            q.new_empty((2, B, Hq, Nq), dtype=torch.float32))


def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, index: Tensor, meta,
         causal_offset: Optional[int], sm_scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = backward(do, q, k, v, out, stats, _plan(q, k, index, meta, causal_offset), sm_scale, backend)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@torch.library.custom_op("sparse_io_attn::block_sparse_attn_bwd", mutates_args=())
def block_sparse_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, index: Tensor,
                          meta: list[int], causal_offset: Optional[int], sm_scale: float,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` shaped like q, k, v (dk/dv summed over each GQA group)."""
    return _bwd(do, q, k, v, out, stats, index, meta, causal_offset, sm_scale, backend)


@block_sparse_attn_bwd.register_fake
def _(do, q, k, v, out, stats, index, meta, causal_offset, sm_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def no_double_backward(where: str) -> None:
    """Backward runs with grad mode on only under ``create_graph=True`` (double backward)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{where}: double backward (torch.autograd.grad(..., create_graph=True) through block-sparse "
            f"attention) is not supported: the backward kernels are not differentiable. Compute the "
            f"gradient penalty without create_graph, or use dense attention for that term")


class _AttentionFn(torch.autograd.Function):
    """The forward op's ``Autograd`` kernel: runs the op below autograd, saves what the backward needs,
    and differentiates through ``block_sparse_attn_bwd`` (the op itself when traced; its
    implementation directly on plain tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, index, meta, causal_offset, sm_scale, backend):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse, stats = block_sparse_attn_fwd(q, k, v, index, meta, causal_offset, sm_scale, backend)
        ctx.save_for_backward(q, k, v, out, stats, index)
        ctx.args = (meta, causal_offset, sm_scale, backend)
        ctx.mark_non_differentiable(lse, stats)
        return out, lse, stats

    @staticmethod
    def backward(ctx, dout, _dlse, _dstats):
        no_double_backward("sparse_io_attn::block_sparse_attn_fwd")
        q, k, v, out, stats, index = ctx.saved_tensors
        dout = dout.contiguous()
        if all(type(t) is Tensor for t in (dout, q, k, v)):
            # plain tensors (eager autograd): the backward op's own implementation, without a second dispatch
            dq, dk, dv = _bwd(dout, q, k, v, out, stats, index, *ctx.args)
        else:   # traced (fake/functional tensors under torch.compile): the opaque op, so the graph holds it
            dq, dk, dv = block_sparse_attn_bwd(dout, q, k, v, out, stats, index, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _autograd_kernel(q, k, v, index, meta, causal_offset, sm_scale, backend):
    return _AttentionFn.apply(q, k, v, index, meta, causal_offset, sm_scale, backend)


_LIB.impl("block_sparse_attn_fwd", _autograd_kernel, "Autograd")


__all__ = ["backward", "cpu_backend", "block_sparse_attn_bwd", "block_sparse_attn_fwd", "forward", "no_double_backward"]
