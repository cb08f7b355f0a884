"""Block-sparse attention as ``torch.library`` custom ops: the one path of every call, eager and compiled.

:func:`sparse_io_attn.block_sparse_attention` plans the layout (:mod:`.plan`) and calls
``torch.ops.sparse_io_attn.block_sparse_attn_fwd``; its ``Autograd`` kernel wires the backward to
``block_sparse_attn_bwd``; fake kernels give ``torch.compile`` the shapes, so a compiled model sees
two opaque nodes and no graph break (the wiring is the attention kit's
:class:`~sparse_io_attn._attention.op.AttentionOp`, shared with :mod:`sparse_io_attn.selection.op`):

* ``block_sparse_attn_fwd(q, k, v, index, meta, causal_offset, sm_scale, backend, sinks=None, residual=False)
  -> (out, lse, stats, residual)``
* ``block_sparse_attn_bwd(do, q, k, v, out, stats, index, meta, causal_offset, sm_scale, backend, delta=None)
  -> (dq, dk, dv)``

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
"""
from __future__ import annotations

from sparse_io_attn._attention.op import EXTENSIONS, AttentionOp
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


#: the extensions each backend takes (:data:`sparse_io_attn._attention.op.EXTENSIONS`; no backend of this
#: op takes ``cu_seqlens``: pack with ``patterns.document``); a call needing one its backend lacks raises
#: ``NotImplementedError`` naming the backends that have it
FEATURES = {"cpu": EXTENSIONS - {"cu_seqlens"}, "torch": EXTENSIONS - {"cu_seqlens"},
            "triton": frozenset({"sinks", "value_dim", "residual", "delta"})}
OP = AttentionOp("block_sparse_attn", "Tensor index", AttentionPlan,
                 {"cpu": cpu_backend, "triton": _triton_backend, "torch": lambda: torch_path},
                 FEATURES)
#: the forward op (``torch.ops.sparse_io_attn.block_sparse_attn_fwd.default``) and the backward op
block_sparse_attn_fwd = OP.fwd
block_sparse_attn_bwd = OP.bwd
#: ``forward(q, k, v, plan, sm_scale, backend) -> (out, lse, stats)`` and
#: ``backward(do, q, k, v, out, stats, plan, sm_scale, backend) -> (dq, dk, dv)``: a backend run directly
forward = OP.forward
backward = OP.backward


__all__ = ["backward", "cpu_backend", "block_sparse_attn_bwd", "block_sparse_attn_fwd", "forward"]
