"""The op wiring both attention ops share (:class:`AttentionOp`): one ``torch.library`` forward op,
its backward op, their fake kernels, and one ``autograd.Function`` on the forward's ``Autograd`` key.

An op ``sparse_io_attn::<name>_fwd(q, k, v, <plan tensors>, int[] meta, int? causal_offset, float
sm_scale, str backend) -> (out, lse, stats)`` is the one path of every call, eager and compiled:

* its ``CompositeExplicitAutograd`` kernel finds the plan the op's tensors describe (the op's own
  ``plan_from_op``) and calls the chosen backend's ``forward(q, k, v, plan, sm_scale=...)``;
* its fake kernel gives ``torch.compile`` the shapes (``out`` like ``q``, ``lse`` fp32 ``[B, Hq, Nq]``,
  ``stats`` fp32 ``[2, B, Hq, Nq]``), so a compiled model sees an opaque node and no graph break;
* its ``Autograd`` kernel is ``_AttentionFn``: the op runs below autograd, the backward calls
  ``sparse_io_attn::<name>_bwd`` when traced (the backward graph holds the op) and that op's
  implementation directly on plain tensors in eager autograd (one dispatcher round trip less).

The forward op is defined with ``torch.library.Library`` and its autograd kernel registered on the
``Autograd`` key rather than through ``torch.library.custom_op`` + ``register_autograd``: the latter's
generated autograd function refills every argument from the schema on each call and wraps the
implementation in a ``torch.compiler.disable`` frame, about 20 us per forward+backward at small
shapes (the two styles timed in one process: ``benchmarks/results/eager_overhead.md``). Both are
``torch.library`` custom ops: same schema, fake kernel, ``opcheck``, ``torch.compile``.

The backends are plain functions a reader can follow: ``backends[name]()`` returns a module with
``forward(q, k, v, plan, *, sm_scale)`` and ``backward(do, q, k, v, out, stats, plan, *, sm_scale)``
(each op imports its C++ and Triton backends lazily).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

NAMESPACE = "sparse_io_attn"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def no_double_backward(where: str) -> None:
    """Backward runs with grad mode on only under ``create_graph=True`` (double backward)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{where}: double backward (torch.autograd.grad(..., create_graph=True) through sparse "
            f"attention) is not supported: the backward kernels are not differentiable. Compute the "
            f"gradient penalty without create_graph, or use dense attention for that term")


def _fake_forward(q: Tensor, k: Tensor, v: Tensor, *rest):
    B, Hq, Nq, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            q.new_empty((2, B, Hq, Nq), dtype=torch.float32))


def _fake_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class AttentionOp:
    """The custom ops of one attention op family and its backends.

    ``name``: ops ``sparse_io_attn::{name}_fwd`` / ``{name}_bwd``; ``plan_args``: the schema of the
    plan's tensors (``"Tensor index"``, ``"Tensor rows, Tensor row_counts"``); ``plan_cls``: the plan
    class, whose ``from_op(*plan_tensors, meta, causal_offset)`` finds (or rebuilds) the plan those
    tensors describe and whose ``check_heads(batch, num_heads_q, num_heads_kv)`` refuses inputs it
    cannot serve; ``backends``: backend name -> a function returning the backend's module.

    Attributes: ``fwd`` (the forward op, ``torch.ops.sparse_io_attn.{name}_fwd.default``), ``bwd`` (the
    backward op); methods :meth:`forward` / :meth:`backward` run a backend on a plan directly (what
    context parallelism calls for its parts).
    """

    def __init__(self, name: str, plan_args: str, plan_cls: type, backends: dict[str, Callable]):
        self.name = name
        self.plan_cls = plan_cls
        self.backends = backends
        self.num_plan_tensors = plan_args.count("Tensor")
        tail = f"{plan_args}, int[] meta, int? causal_offset, float sm_scale, str backend"
        fwd_name, bwd_name = f"{name}_fwd", f"{name}_bwd"
        _LIB.define(f"{fwd_name}(Tensor q, Tensor k, Tensor v, {tail}) -> (Tensor, Tensor, Tensor)")
        _LIB.define(f"{bwd_name}(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, {tail}) "
                    f"-> (Tensor, Tensor, Tensor)")
        _LIB.impl(fwd_name, self._fwd_impl, "CompositeExplicitAutograd")
        _LIB.impl(bwd_name, self._bwd_impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{fwd_name}", _fake_forward, lib=_LIB)
        torch.library.register_fake(f"{NAMESPACE}::{bwd_name}", _fake_backward, lib=_LIB)
        self.fwd = getattr(torch.ops.sparse_io_attn, fwd_name).default
        self.bwd = getattr(torch.ops.sparse_io_attn, bwd_name).default
        self._function = _autograd_function(self)
        _LIB.impl(fwd_name, self._autograd_kernel, "Autograd")

    # ---------------------------------------------------------------------------------- backends
    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan, sm_scale: float, backend: str):
        """``(out, lse, stats)`` of backend ``backend`` (inputs validated, plan on q's device)."""
        return self.backends[backend]().forward(q, k, v, plan, sm_scale=sm_scale)

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, plan,
                 sm_scale: float, backend: str):
        """``(dq, dk, dv)`` of backend ``backend``; dk/dv summed over each GQA group."""
        return self.backends[backend]().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale)

    # ------------------------------------------------------------------------------ op kernels
    def plan_from_op(self, q: Tensor, k: Tensor, *plan_tensors_meta_offset):
        """The plan the op's tensors describe, checked against the inputs' lengths and heads."""
        plan = self.plan_cls.from_op(*plan_tensors_meta_offset)
        if plan.seqlen != (q.shape[2], k.shape[2]):
            raise ValueError(f"the plan is for seqlen (q, k) = {plan.seqlen} but the inputs have "
                             f"({q.shape[2]}, {k.shape[2]})")
        plan.check_heads(q.shape[0], q.shape[1], k.shape[1])
        return plan

    def _fwd_impl(self, q, k, v, *args):
        *plan_tensors, meta, causal_offset, sm_scale, backend = args
        plan = self.plan_from_op(q, k, *plan_tensors, meta, causal_offset)
        out, lse, stats = self.forward(q, k, v, plan, sm_scale, backend)
        return out.contiguous(), lse.contiguous(), stats.contiguous()

    def _bwd_impl(self, do, q, k, v, out, stats, *args):
        *plan_tensors, meta, causal_offset, sm_scale, backend = args
        plan = self.plan_from_op(q, k, *plan_tensors, meta, causal_offset)
        dq, dk, dv = self.backward(do, q, k, v, out, stats, plan, sm_scale, backend)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    def _autograd_kernel(self, q, k, v, *args):
        return self._function.apply(q, k, v, *args)


def _autograd_function(op: AttentionOp):
    """The forward op's ``Autograd`` kernel: runs the op below autograd, saves what the backward
    needs, and differentiates through the backward op (the op itself when traced; its
    implementation directly on plain tensors)."""
    n_plan = op.num_plan_tensors
    fwd, bwd, bwd_impl = op.fwd, op.bwd, op._bwd_impl
    where = f"{NAMESPACE}::{op.name}_fwd"

    class _AttentionFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *args):
            with torch._C._AutoDispatchBelowAutograd():
                out, lse, stats = fwd(q, k, v, *args)
            ctx.save_for_backward(q, k, v, out, stats, *args[:n_plan])
            ctx.args = args[n_plan:]
            ctx.mark_non_differentiable(lse, stats)
            return out, lse, stats

        @staticmethod
        def backward(ctx, dout, _dlse, _dstats):
            no_double_backward(where)
            q, k, v, out, stats, *plan_tensors = ctx.saved_tensors
            dout = dout.contiguous()
            if all(type(t) is Tensor for t in (dout, q, k, v)):
                # plain tensors (eager autograd): the backward op's own implementation, without a second dispatch
                dq, dk, dv = bwd_impl(dout, q, k, v, out, stats, *plan_tensors, *ctx.args)
            else:   # traced (fake/functional tensors under torch.compile): the opaque op, so the graph holds it
                dq, dk, dv = bwd(dout, q, k, v, out, stats, *plan_tensors, *ctx.args)
            return (dq, dk, dv) + (None,) * (n_plan + len(ctx.args))

    _AttentionFn.__name__ = _AttentionFn.__qualname__ = f"_{op.name}_fn"
    return _AttentionFn


__all__ = ["AttentionOp", "NAMESPACE", "no_double_backward"]
