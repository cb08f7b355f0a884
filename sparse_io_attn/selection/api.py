"""`selection_attention`: attention where each query token attends the key blocks it selected.

The call validates its inputs, plans the selection (:class:`~.plan.SelectionPlan`: normalised rows,
key-major lists on demand) and calls the custom op of :mod:`.op`, the one path of eager and
compiled code. Backends share one interface (inputs validated, the plan on the inputs' device):

* ``forward(q, k, v, plan, *, sm_scale) -> (out, lse, stats)``
* ``backward(do, q, k, v, out, stats, plan, *, sm_scale) -> (dq, dk, dv)``

``plan`` is a :class:`~sparse_io_attn.selection.plan.SelectionPlan` (normalised rows, key-major lists
on demand, the causal offset, how ``[B, Hq]`` index it: :meth:`~.plan.SelectionPlan.head_map`).
``lse`` is fp32 ``[B, Hq, Nq]`` in natural-log units (``-inf`` on rows without an allowed key, whose
output is 0); ``stats`` fp32 ``[2, B, Hq, Nq]`` is each row's base-2 score maximum and log2 of its
sum (``+inf``/``0`` on empty rows), what backward recomputes the probabilities from. The checks and
the backend choice are the attention kit's (:mod:`sparse_io_attn._attention.checks`), the same as
:func:`~sparse_io_attn.block_sparse_attention`'s.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.checks import BACKENDS, check_tensors, resolve_backend, resolve_sm_scale
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.op import cpu_backend, selection_attn_fwd
from sparse_io_attn.selection.plan import SelectionPlan

def as_selection(indices, block_size, counts) -> Selection:
    """``indices`` (a :class:`Selection`, or an index tensor with ``block_size`` and ``counts``) as a
    :class:`Selection`."""
    if isinstance(indices, Selection):
        if block_size is not None and block_size != indices.block_size:
            raise ValueError(f"the Selection has block_size {indices.block_size} but block_size={block_size} was "
                             f"passed; leave block_size out when passing a Selection")
        if counts is not None:
            raise ValueError("the Selection carries its counts; leave counts out when passing a Selection")
        return indices
    if block_size is None:
        raise TypeError("selection_attention needs block_size= with an index tensor (keys per selected block; "
                        "1 = single tokens), or a Selection in place of the indices")
    return Selection(indices, block_size, counts)


def prepare(q, k, v, indices, *, block_size=None, counts=None, causal=False, sm_scale=None,
            backend: str = "auto", check: bool = True):
    """Validate a call and plan it: ``(plan, sm_scale, backend)``. ``indices`` may be a
    :class:`~.plan.SelectionPlan` already built for these lengths and causality."""
    check_tensors(q, k, v)
    backend = resolve_backend(backend, q.device)
    if backend == "cpu":
        cpu_backend().load()   # the plan's normalisations run in C++ once the extension is loaded
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    delta = causal_offset(causal, Nq, Nk)
    if isinstance(indices, SelectionPlan):
        plan = indices.register()
        if block_size is not None or counts is not None:
            raise ValueError("a SelectionPlan carries its block_size and counts; leave block_size= and counts= "
                             "out when passing a plan")
        if plan.seqlen != (Nq, Nk) or plan.causal_offset != delta:
            raise ValueError(f"the plan was built for seqlen {plan.seqlen} with causal offset {plan.causal_offset} "
                             f"but the call has ({Nq}, {Nk}) and causal={causal!r} (offset {delta}); build it for "
                             f"this call or pass the Selection")
    else:
        selection = as_selection(indices, block_size, counts)
        if selection.seqlen_q != Nq:
            raise ValueError(f"indices have {selection.seqlen_q} query rows but q has {Nq} tokens; pass one row "
                             f"per query token ([B, G, Nq, K])")
        if selection.device != q.device:
            raise ValueError(f"indices are on {selection.device} but q on {q.device}; move them to q's device")
        if check and not torch.compiler.is_compiling():
            selection.check(Nk)
        plan = SelectionPlan(selection, Nk, delta).register()
    if plan.device != q.device:
        raise ValueError(f"the plan is on {plan.device} but q on {q.device}")
    plan.head_map(B, Hq, k.shape[1])
    return plan, resolve_sm_scale(sm_scale, D), backend


def selection_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices, *, block_size: int | None = None,
                        counts: torch.Tensor | None = None, causal=False, sm_scale: float | None = None,
                        return_lse: bool = False, backend: str = "auto", check: bool = True):
    """Attention where each query token attends the union of the key blocks it selected.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA).
            float32, float16 or bfloat16 (fp32 accumulation).
        indices: int ``[B, G, Nq, K]`` or ``[G, Nq, K]`` (shared by the batch) with ``G`` in
            ``{1, Hkv, Hq}`` (query head ``h`` uses selection ``h // (Hq // G)``): each entry names a
            key block of ``block_size`` keys (the last block may be ragged); negative entries are empty
            slots; a block listed twice counts once. Or a :class:`~sparse_io_attn.layout.selection.Selection`
            (then ``block_size`` and ``counts`` come from it), or a
            :class:`~sparse_io_attn.selection.plan.SelectionPlan` built for this call's lengths and causality.
        block_size: keys per block (1 = single tokens).
        counts: int ``[B, G, Nq]`` / ``[G, Nq]``: only the first ``counts`` entries of a row count.
        causal: ``False``, ``True``/``"top_left"`` (key ``s`` allowed for query ``t`` iff ``s <= t``) or
            ``"bottom_right"`` (iff ``s <= t + Nk - Nq``).
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the row log-sum-exp ``[B, Hq, Nq]`` (fp32, natural log).
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"triton"``.
        check: raise ``ValueError`` for an entry ``>= ceil(Nk / block_size)`` or a count outside
            ``[0, K]`` (reads the indices: one host synchronisation on CUDA). ``check=False`` trusts the
            indices and skips every synchronisation; such entries then count as empty slots. No kernel
            reads outside its tensors either way.

    Each query row attends the union of its selected blocks intersected with causality, softmax over
    those keys. A row with no allowed key gets output 0, lse ``-inf`` and zero gradients. Gradients
    flow to q, k and v (not to the indices).
    """
    plan, scale, backend = prepare(q, k, v, indices, block_size=block_size, counts=counts, causal=causal,
                                   sm_scale=sm_scale, backend=backend, check=check)
    out, lse, _ = selection_attn_fwd(q, k, v, plan.rows, plan.row_counts, list(plan.meta), plan.causal_offset, scale,
                                     backend)
    return (out, lse) if return_lse else out


__all__ = ["BACKENDS", "prepare", "resolve_backend", "selection_attention"]
