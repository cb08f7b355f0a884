"""The op wiring both attention ops share (:class:`AttentionOp`): one ``torch.library`` forward op,
its backward op, their fake kernels, and one ``autograd.Function`` on the forward's ``Autograd`` key.

An op ``sparse_io_attn::<name>_fwd(q, k, v, <plan tensors>, int[] meta, int? causal_offset, float
sm_scale, str backend, Tensor? sinks=None, bool residual=False) -> (out, lse, stats, residual)`` is the
one path of every call, eager and compiled:

* its ``CompositeExplicitAutograd`` kernel finds the plan the op's tensors describe (the op's own
  ``plan_from_op``) and calls the chosen backend's ``forward(q, k, v, plan, sm_scale=...)``;
* its fake kernel gives ``torch.compile`` the shapes (``out [B, Hq, Nq, Dv]`` in q's dtype, ``lse`` fp32
  ``[B, Hq, Nq]``, ``stats`` fp32 ``[2, B, Hq, Nq]``, the residual ``out``'s shape or empty), so a
  compiled model sees an opaque node and no graph break;
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
(each op imports its C++ and Triton backends lazily), plus the keywords of the :data:`EXTENSIONS` the
op's ``features`` table gives the backend: ``forward(..., sinks=, residual=True) -> (out, lse, stats,
residual)``, ``backward(..., delta=)``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from sparse_io_attn._attention.delta import residual_made, row_delta
from sparse_io_attn._attention.sinks import sink_grad

NAMESPACE = "sparse_io_attn"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

#: what a backend may take beyond ``(q, k, v, plan, sm_scale)`` (each op's ``features`` table says which
#: backend takes which): ``"sinks"`` (``forward(..., sinks=)``), ``"value_dim"`` (v's head dim other than
#: q/k's), ``"residual"`` (``forward(..., residual=True)`` also returns the output's rounding residual),
#: ``"delta"`` (``backward(..., delta=)`` takes the row deltas formed by the caller), ``"cu_seqlens"``
#: (plans of packed sequences: a selection plan's block table)
EXTENSIONS = frozenset({"sinks", "value_dim", "residual", "delta", "cu_seqlens"})
#: the defaults of the forward op's trailing arguments (sinks, residual) and of the backward's (delta)
FWD_DEFAULTS = (None, False)
BWD_DEFAULTS = (None,)


def no_double_backward(where: str) -> None:
    """Backward runs with grad mode on only under ``create_graph=True`` (double backward)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{where}: double backward (torch.autograd.grad(..., create_graph=True) through sparse "
            f"attention) is not supported: the backward kernels are not differentiable. Compute the "
            f"gradient penalty without create_graph, or use dense attention for that term")


def _residual_shape(q: Tensor, v: Tensor, backend: str, residual: bool, features) -> tuple:
    """The forward op's fourth output: ``out``'s shape when the residual is made, else ``(0,)``."""
    made = residual_made(q.dtype, residual) and "residual" in features.get(backend, ())
    return (*q.shape[:3], v.shape[3]) if made else (0,)


def _fake_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class AttentionOp:
    """The custom ops of one attention op family and its backends.

    ``name``: ops ``sparse_io_attn::{name}_fwd`` / ``{name}_bwd``; ``plan_args``: the schema of the
    plan's tensors (``"Tensor index"``, ``"Tensor rows, Tensor row_counts"``); ``plan_cls``: the plan
    class, whose ``from_op(*plan_tensors, meta, causal_offset)`` finds (or rebuilds) the plan those
    tensors describe and whose ``check_heads(batch, num_heads_q, num_heads_kv)`` refuses inputs it
    cannot serve; ``backends``: backend name -> a function returning the backend's module;
    ``features``: backend name -> the :data:`EXTENSIONS` it takes (a call needing one its backend
    lacks raises ``NotImplementedError`` naming the backends that have it).

    Schemas (``<plan>`` the plan's tensors, ``<call>`` = ``int[] meta, int? causal_offset, float
    sm_scale, str backend``):

    * ``{name}_fwd(Tensor q, Tensor k, Tensor v, <plan>, <call>, Tensor? sinks=None, bool residual=False)
      -> (out, lse, stats, residual)``: ``residual`` the output's rounding residual in q's dtype when
      asked for, the dtype is not fp32 and the backend makes one (:mod:`.delta`), else an empty tensor;
    * ``{name}_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, <plan>, <call>,
      Tensor? delta=None) -> (dq, dk, dv)``: ``delta`` fp32 ``[B, Hq, Nq]`` the row deltas when the
      caller formed them (the autograd kernel: from ``out`` and its residual).

    The sink's gradient is formed by the autograd kernel from the row deltas and the forward's stats
    (:func:`~.sinks.sink_grad`), the same for every backend.

    Attributes: ``fwd`` (the forward op, ``torch.ops.sparse_io_attn.{name}_fwd.default``), ``bwd`` (the
    backward op); methods :meth:`forward` / :meth:`backward` run a backend on a plan directly (what
    context parallelism calls for its parts).
    """

    def __init__(self, name: str, plan_args: str, plan_cls: type, backends: dict[str, Callable],
                 features: dict[str, frozenset]):
        self.name = name
        self.plan_cls = plan_cls
        self.backends = backends
        self.features = features
        self.num_plan_tensors = plan_args.count("Tensor")
        tail = f"{plan_args}, int[] meta, int? causal_offset, float sm_scale, str backend"
        fwd_name, bwd_name = f"{name}_fwd", f"{name}_bwd"
        _LIB.define(f"{fwd_name}(Tensor q, Tensor k, Tensor v, {tail}, Tensor? sinks=None, bool residual=False) "
                    f"-> (Tensor, Tensor, Tensor, Tensor)")
        _LIB.define(f"{bwd_name}(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, {tail}, "
                    f"Tensor? delta=None) -> (Tensor, Tensor, Tensor)")
        _LIB.impl(fwd_name, self._fwd_impl, "CompositeExplicitAutograd")
        _LIB.impl(bwd_name, self._bwd_impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{fwd_name}", self._fake_forward, lib=_LIB)
        torch.library.register_fake(f"{NAMESPACE}::{bwd_name}", _fake_backward, lib=_LIB)
        self.fwd = getattr(torch.ops.sparse_io_attn, fwd_name).default
        self.bwd = getattr(torch.ops.sparse_io_attn, bwd_name).default
        self._function = _autograd_function(self)
        _LIB.impl(fwd_name, self._autograd_kernel, "Autograd")

    def _full(self, args: tuple, defaults: tuple) -> tuple:
        """The op's arguments after ``q, k, v`` (after ``do, ..., stats`` for the backward) with the
        trailing defaults the dispatcher leaves out filled in."""
        missing = self.num_plan_tensors + 4 + len(defaults) - len(args)
        return tuple(args) + defaults[len(defaults) - missing:] if missing > 0 else tuple(args)

    def _fake_forward(self, q: Tensor, k: Tensor, v: Tensor, *rest):
        *_, backend, _sinks, residual = self._full(rest, FWD_DEFAULTS)
        B, Hq, Nq, _ = q.shape
        return (q.new_empty((B, Hq, Nq, v.shape[3])), q.new_empty((B, Hq, Nq), dtype=torch.float32),
                q.new_empty((2, B, Hq, Nq), dtype=torch.float32),
                q.new_empty(_residual_shape(q, v, backend, residual, self.features)))

    # ---------------------------------------------------------------------------------- backends
    def require(self, backend: str, **used: bool) -> None:
        """Refuse a call that uses an extension (``sinks=True``, ``value_dim=True``, ...) its backend
        lacks: ``NotImplementedError`` naming the argument and the backends that take it."""
        have = self.features.get(backend, frozenset())
        for what, on in used.items():
            if on and what not in have:
                takers = [b for b, f in self.features.items() if what in f]
                arg = {"sinks": "sinks=", "value_dim": "a V head dim other than Q/K's",
                       "cu_seqlens": "cu_seqlens="}.get(what, what)
                raise NotImplementedError(f"{self.name} backend {backend!r} does not support {arg} yet; use "
                                          f"backend=" + " or ".join(repr(b) for b in takers))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan, sm_scale: float, backend: str, *,
                sinks: Tensor | None = None):
        """``(out, lse, stats)`` of backend ``backend`` (inputs validated, plan on q's device)."""
        return self._forward(q, k, v, plan, sm_scale, backend, sinks, False)[:3]

    def _forward(self, q, k, v, plan, sm_scale, backend, sinks, residual):
        """``(out, lse, stats, residual or None)``."""
        self.require(backend, sinks=sinks is not None, value_dim=v.shape[3] != q.shape[3],
                     cu_seqlens=getattr(plan, "varlen", False))
        extra = {}
        if sinks is not None:
            extra["sinks"] = sinks
        if residual_made(q.dtype, residual) and "residual" in self.features.get(backend, ()):
            extra["residual"] = True
        result = self.backends[backend]().forward(q, k, v, plan, sm_scale=sm_scale, **extra)
        return tuple(result) if len(result) == 4 else (*result, None)

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, plan,
                 sm_scale: float, backend: str, *, delta: Tensor | None = None):
        """``(dq, dk, dv)`` of backend ``backend``; dk/dv summed over each GQA group. ``delta``: the
        row deltas when the caller formed them (backends with ``"delta"``)."""
        self.require(backend, value_dim=v.shape[3] != q.shape[3], cu_seqlens=getattr(plan, "varlen", False))
        extra = {"delta": delta} if delta is not None and "delta" in self.features.get(backend, ()) else {}
        return self.backends[backend]().backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale, **extra)

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
        *plan_tensors, meta, causal_offset, sm_scale, backend, sinks, residual = self._full(args, FWD_DEFAULTS)
        plan = self.plan_from_op(q, k, *plan_tensors, meta, causal_offset)
        out, lse, stats, res = self._forward(q, k, v, plan, sm_scale, backend, sinks, residual)
        # (zeros where a backend made none: the deltas of the rounded output, never uninitialised memory)
        res = q.new_zeros(_residual_shape(q, v, backend, residual, self.features)) if res is None else res
        return out.contiguous(), lse.contiguous(), stats.contiguous(), res.contiguous()

    def _bwd_impl(self, do, q, k, v, out, stats, *args):
        *plan_tensors, meta, causal_offset, sm_scale, backend, delta = self._full(args, BWD_DEFAULTS)
        plan = self.plan_from_op(q, k, *plan_tensors, meta, causal_offset)
        dq, dk, dv = self.backward(do, q, k, v, out, stats, plan, sm_scale, backend, delta=delta)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    def _autograd_kernel(self, q, k, v, *args):
        return self._function.apply(q, k, v, *self._full(args, FWD_DEFAULTS))


def _autograd_function(op: AttentionOp):
    """The forward op's ``Autograd`` kernel: runs the op below autograd, saves what the backward
    needs, and differentiates through the backward op (the op itself when traced; its
    implementation directly on plain tensors). The row deltas are formed here (from ``out`` and
    the forward's rounding residual) when the forward made a residual or the sinks need a gradient,
    and handed to backends that take them; the sinks' gradient is formed from them."""
    n_plan = op.num_plan_tensors
    fwd, bwd, bwd_impl = op.fwd, op.bwd, op._bwd_impl
    where = f"{NAMESPACE}::{op.name}_fwd"

    class _AttentionFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *args):
            with torch._C._AutoDispatchBelowAutograd():
                out, lse, stats, res = fwd(q, k, v, *args)
            sinks = args[-2]
            ctx.save_for_backward(q, k, v, out, stats, res, sinks, *args[:n_plan])
            ctx.args = args[n_plan:-2]
            ctx.mark_non_differentiable(lse, stats, res)
            return out, lse, stats, res

        @staticmethod
        def backward(ctx, dout, _dlse, _dstats, _dres):
            no_double_backward(where)
            q, k, v, out, stats, res, sinks, *plan_tensors = ctx.saved_tensors
            backend = ctx.args[-1]
            dout = dout.contiguous()
            sink_grad_needed = sinks is not None and ctx.needs_input_grad[3 + n_plan + 4]
            delta = None
            if res.numel() or sink_grad_needed:    # (a backend's own row_delta: its preprocess kernel)
                delta = getattr(op.backends[backend](), "row_delta", row_delta)(dout, out, res)
            if "delta" not in op.features.get(backend, ()):
                passed = None
            else:
                passed = delta
            if all(type(t) is Tensor for t in (dout, q, k, v)):
                # plain tensors (eager autograd): the backward op's own implementation, without a second dispatch
                dq, dk, dv = bwd_impl(dout, q, k, v, out, stats, *plan_tensors, *ctx.args, passed)
            else:   # traced (fake/functional tensors under torch.compile): the opaque op, so the graph holds it
                dq, dk, dv = bwd(dout, q, k, v, out, stats, *plan_tensors, *ctx.args, passed)
            dsinks = sink_grad(sinks, stats, delta) if sink_grad_needed else None
            return (dq, dk, dv) + (None,) * (n_plan + len(ctx.args)) + (dsinks, None)

    _AttentionFn.__name__ = _AttentionFn.__qualname__ = f"_{op.name}_fn"
    return _AttentionFn


__all__ = ["AttentionOp", "EXTENSIONS", "NAMESPACE", "no_double_backward"]
