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

from sparse_io_attn._attention.checks import BACKENDS, check_sinks, check_tensors, resolve_backend, resolve_sm_scale
from sparse_io_attn._attention.delta import wants_residual
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.op import OP, cpu_backend, selection_attn_fwd
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.varlen import capacity, check_local, varlen_of

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
            backend: str = "auto", check: bool = True, sinks=None, cu_seqlens=None, max_seqlen=None):
    """Validate a call and plan it: ``(plan, sm_scale, backend)``. ``indices`` may be a
    :class:`~.plan.SelectionPlan` already built for these lengths and causality (and packed
    sequences: a plan built with ``varlen=`` carries its ``cu_seqlens``)."""
    check_tensors(q, k, v)
    check_sinks(sinks, q)
    backend = resolve_backend(backend, q.device)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    packed = cu_seqlens is not None or (isinstance(indices, SelectionPlan) and indices.varlen)
    OP.require(backend, sinks=sinks is not None, value_dim=v.shape[3] != D, cu_seqlens=packed)
    if backend == "cpu":
        cpu_backend().load()   # the plan's normalisations run in C++ once the extension is loaded
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along the tokens: q [1, Hq, total, D] (or "
                         f"[total, Hq, D]), got batch {B}")
    varlen = None if cu_seqlens is None else varlen_of(cu_seqlens, Nq, Nk, causal, q.device, max_seqlen=max_seqlen,
                                                       check=check)
    delta = causal_offset(causal, Nq, Nk)
    if isinstance(indices, SelectionPlan):
        plan = indices.register()
        if block_size is not None or counts is not None or varlen is not None:
            raise ValueError("a SelectionPlan carries its block_size, counts and cu_seqlens; leave block_size=, "
                             "counts= and cu_seqlens= out when passing a plan")
        want = delta if not plan.varlen else (None if delta is None else 0)
        mode = None if delta is None else ("bottom_right" if causal == "bottom_right" else "top_left")
        if plan.seqlen != (Nq, Nk) or plan.causal_offset != want or (plan.varlen and plan.varlen_causal != mode):
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
            if varlen is None:
                selection.check(Nk)
            else:    # counts, entries below the table's slots, then each below its sequence's blocks
                selection.check(selection.block_size * capacity(Nk, selection.block_size, varlen.num_sequences))
                check_local(selection.indices, varlen, selection.block_size, Nk)
        plan = SelectionPlan(selection, Nk, delta, varlen).register()
    if plan.device != q.device:
        raise ValueError(f"the plan is on {plan.device} but q on {q.device}")
    plan.head_map(B, Hq, k.shape[1])
    return plan, resolve_sm_scale(sm_scale, D), backend


def selection_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices, *, block_size: int | None = None,
                        counts: torch.Tensor | None = None, causal=False, sm_scale: float | None = None,
                        sinks: torch.Tensor | None = None, cu_seqlens=None, max_seqlen=None,
                        return_lse: bool = False, backend: str = "auto", check: bool = True):
    """Attention where each query token attends the union of the key blocks it selected.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]`` with ``Hq % Hkv == 0``
            (GQA/MQA) and V's head dim free (MLA: 576/512). float32, float16 or bfloat16 (fp32
            accumulation). With ``cu_seqlens``, ``B = 1`` (the sequences packed along the tokens) or
            flash-attention's ``[total, H, D]`` (the output is then ``[total, Hq, Dv]`` and the lse
            ``[Hq, total]``).
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
        sinks: optional floating ``[Hq]``: one sink logit per query head (FlashMLA's ``attn_sink``,
            gpt-oss's ``sinks``), in the units of the scaled scores ``sm_scale * q . k``: it joins every
            row's softmax denominator and adds no value (``-inf``: none for that head). Differentiable.
            Backends ``cpu`` and ``torch``.
        cu_seqlens: packed variable-length sequences (flash-attention's varlen offsets, int32/int64
            ``[S + 1]``: ``0, len_0, len_0 + len_1, ...``), or a pair ``(cu_seqlens_q, cu_seqlens_k)``.
            Blocks restart at each sequence's start (as MoBA's and fla's varlen code): the indices
            name **local** blocks, block ``c`` of sequence ``s`` being its keys ``c * block_size ..``
            (the sequence's last block may be ragged), and causality (either alignment) is per
            sequence; no query sees another sequence's keys. Backends ``cpu`` and ``torch``
            (:mod:`sparse_io_attn.selection.varlen`).
        max_seqlen: the longest sequence (flash-attention's argument; an int or a pair): checked
            against ``cu_seqlens`` when ``check``; the kernels do not need it.
        return_lse: also return the row log-sum-exp ``[B, Hq, Nq]`` (fp32, natural log; the sink
            included).
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"triton"``.
        check: raise ``ValueError`` for an entry ``>= ceil(Nk / block_size)`` (with ``cu_seqlens``: past
            its token's sequence) or a count outside ``[0, K]``, and for ``cu_seqlens`` that do not start
            at 0, decrease or miss the packed length (reads them: host synchronisations on CUDA).
            ``check=False`` trusts the indices and offsets and skips every synchronisation; such entries
            then count as empty slots. No kernel reads outside its tensors either way.

    Each query row attends the union of its selected blocks intersected with causality, softmax over
    those keys (and the head's sink). A row with no allowed key gets output 0, lse ``-inf`` (the sink
    with sinks) and zero gradients. Gradients flow to q, k, v and sinks (not to the indices).
    """
    flat = cu_seqlens is not None and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v))
    if flat:                                      # flash-attention's [total, H, D] -> [1, H, total, D] views
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    plan, scale, backend = prepare(q, k, v, indices, block_size=block_size, counts=counts, causal=causal,
                                   sm_scale=sm_scale, backend=backend, check=check, sinks=sinks,
                                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    out, lse, _, _ = selection_attn_fwd(q, k, v, plan.rows, plan.row_counts, plan.table, list(plan.meta),
                                        plan.causal_offset, scale, backend, sinks,
                                        wants_residual(q.dtype, q, k, v, sinks))
    if flat:
        out, lse = out[0].transpose(0, 1), lse[0]
    return (out, lse) if return_lse else out


__all__ = ["BACKENDS", "prepare", "resolve_backend", "selection_attention"]
