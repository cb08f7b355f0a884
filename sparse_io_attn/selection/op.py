"""Selection attention as ``torch.library`` custom ops: the one path of every call, eager and compiled.

* ``selection_attn_fwd(q, k, v, rows, row_counts, table, meta, causal_offset, sm_scale, backend, sinks=None,
  residual=False) -> (out, lse, stats, residual)``
* ``selection_attn_bwd(do, q, k, v, out, stats, rows, row_counts, table, meta, causal_offset, sm_scale, backend,
  delta=None) -> (dq, dk, dv)``

The wiring is the attention kit's :class:`~sparse_io_attn._attention.op.AttentionOp`, the same as
:mod:`sparse_io_attn.block_sparse.op`'s (a ``torch.library`` forward op whose ``Autograd`` kernel is
one ``autograd.Function``). A :class:`~sparse_io_attn.selection.plan.SelectionPlan` crosses the
boundary as its normalised ``rows`` / ``row_counts``, its block table (``None`` but for packed
sequences) and its integers ``meta``;
:meth:`SelectionPlan.from_op` finds the plan object (with the key-major lists it built) or rebuilds
one over the tensors. Inside ``torch.compile`` the plan is built in the graph from the indices
(tensor operations of fixed shapes), so a new selection of the same shapes reuses the graph. The
backends are plain functions of ``(q, k, v, plan, sm_scale)``: ``"cpu"`` (C++), ``"triton"`` and
``"torch"``.
"""
from __future__ import annotations

from sparse_io_attn._attention.op import EXTENSIONS, AttentionOp
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


#: the extensions each backend takes (:data:`sparse_io_attn._attention.op.EXTENSIONS`); a call needing one
#: its backend lacks raises ``NotImplementedError`` naming the backends that have it
FEATURES = {"cpu": frozenset(EXTENSIONS), "torch": frozenset(EXTENSIONS), "triton": frozenset(EXTENSIONS)}
OP = AttentionOp("selection_attn", "Tensor rows, Tensor row_counts, Tensor? table", SelectionPlan,
                 {"cpu": cpu_backend, "triton": _triton_backend, "torch": lambda: torch_path},
                 FEATURES)
#: the forward op (``torch.ops.sparse_io_attn.selection_attn_fwd.default``) and the backward op
selection_attn_fwd = OP.fwd
selection_attn_bwd = OP.bwd
#: a backend run directly on a plan (what context parallelism calls for its parts)
forward = OP.forward
backward = OP.backward


__all__ = ["backward", "cpu_backend", "forward", "selection_attn_bwd", "selection_attn_fwd"]
