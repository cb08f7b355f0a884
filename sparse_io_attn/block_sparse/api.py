"""`block_sparse_attention`: the public entry point. It validates the call, plans the layout once
(:func:`sparse_io_attn.block_sparse.plan.plan`: cached on the layout) and calls the custom op
(:mod:`sparse_io_attn.block_sparse.op`), the one path of eager, compiled, ``nn`` and Hugging Face
calls alike.

:func:`prepare` is the call's prologue (input checks, the plan for the inputs' heads and device, the
softmax scale, the backend), shared with context parallelism. The checks and the backend choice
are the attention kit's (:mod:`sparse_io_attn._attention.checks`), the same for every op.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn._attention.checks import BACKENDS, check_sinks, check_tensors, resolve_backend, resolve_sm_scale
from sparse_io_attn._attention.delta import wants_residual
from sparse_io_attn.block_sparse.op import OP, block_sparse_attn_fwd
from sparse_io_attn.block_sparse.plan import AttentionPlan, plan
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout

class Call(NamedTuple):
    """One call, decided before any kernel runs (:func:`prepare`)."""
    plan: AttentionPlan      # for the inputs' query heads, on their device
    sm_scale: float
    backend: str             # "torch", "triton" or "cpu"


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, *, causal, sm_scale,
            backend: str, sinks=None) -> Call:
    """Validate a call and plan it: ``layout`` is a :class:`BlockSparseLayout` (planned under
    ``causal``, the plan cached on the layout) or an :class:`AttentionPlan` (whose causal offset must
    be the call's, and whose layout must not have been edited since it was built)."""
    check_tensors(q, k, v)
    check_sinks(sinks, q)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if isinstance(layout, AttentionPlan):
        p = layout
        if p.seqlen != (Nq, Nk):
            raise ValueError(f"the plan was built for seqlen (q, k) = {p.seqlen} but the inputs have ({Nq}, {Nk}); "
                             f"plan a layout with seqlen=({Nq}, {Nk})")
        delta = causal_offset(causal, Nq, Nk)
        if delta != p.causal_offset:
            raise ValueError(f"the plan was built with causal={p.causal!r} but the call has causal={causal!r}; "
                             f"pass causal={p.causal!r}, or plan the layout with causal={causal!r}")
        if p.is_stale():
            raise ValueError("the plan's layout was edited in place after the plan was built; build it again "
                             "with sparse_io_attn.plan(layout, causal=...) (or pass the layout)")
    elif isinstance(layout, BlockSparseLayout):
        if (Nq, Nk) != layout.seqlen:
            raise ValueError(f"layout was built for seqlen (q, k) = {layout.seqlen} but the inputs have "
                             f"({Nq}, {Nk}); build the layout with seqlen=({Nq}, {Nk})")
        p = plan(layout, causal=causal, num_heads_q=Hq, num_heads_kv=Hkv)   # one plan, cached on the layout
    else:
        raise TypeError(f"layout must be a BlockSparseLayout (see sparse_io_attn.layout.patterns) or an "
                        f"AttentionPlan (sparse_io_attn.plan), got {type(layout).__name__}")
    p = p.for_heads(Hq, Hkv).to(q.device)   # a per-KV-head selection serves the query heads of its group
    p.layout_strides(B, Hq)                  # the masks broadcast over [batch, heads]
    backend = resolve_backend(backend, q.device)
    OP.require(backend, sinks=sinks is not None, value_dim=v.shape[3] != D)
    return Call(p, resolve_sm_scale(sm_scale, D), backend)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                           *, causal=False, sm_scale: float | None = None, sinks: torch.Tensor | None = None,
                           return_lse: bool = False, backend: str = "auto"):
    """Block-sparse scaled dot-product attention.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query
            head ``h`` reads kv head ``h // (Hq // Hkv)``). float32, float16 or bfloat16.
        layout: a :class:`BlockSparseLayout` with ``seqlen == (Nq, Nk)``; its masks are shared or
            per batch, and shared, per query head or per KV head (``layout_heads == Hkv``: one mask
            for the query heads of each GQA group). The layout is the mask: full blocks and element-masked
            partial blocks, exactly the elements it allows are attended. Or an
            :class:`~sparse_io_attn.AttentionPlan` of such a layout (:func:`sparse_io_attn.plan`),
            built with the same ``causal``.
        causal: intersect the layout with a causal mask: ``True`` or ``"top_left"`` (key ``j``
            allowed for query ``i`` iff ``j <= i``, like ``scaled_dot_product_attention(
            is_causal=True)``), ``"bottom_right"`` (iff ``j <= i + Nk - Nq``: KV-cache decoding,
            chunked prefill), ``False`` (default; a layout built with ``causal=True`` carries its
            causality already).
        sm_scale: softmax scale, default ``D ** -0.5``: a finite real scalar (Python or NumPy
            number, 0-d real tensor).
        sinks: optional floating ``[Hq]``: one sink logit per query head (gpt-oss's ``sinks``,
            FlashMLA's ``attn_sink``), in the units of the scaled scores ``sm_scale * q . k``: it joins
            every row's softmax denominator and adds no value (``-inf``: none for that head).
            Differentiable. Backends ``cpu`` and ``torch``.
        return_lse: also return the row log-sum-exp ``[B, Hq, Nq]`` (float32, natural log, the sink
            included; not differentiable).
        backend: ``"auto"`` (triton on CUDA; cpu on CPU, or torch with one warning if the C++
            kernel cannot be built), ``"cpu"``, ``"torch"`` or ``"triton"``.

    Softmax runs over the allowed keys of each query row (and the head's sink). A row with no allowed
    key gets output 0, lse ``-inf`` (the sink with sinks) and zero gradients. One path for eager and ``torch.compile`` alike: the custom op
    ``torch.ops.sparse_io_attn.block_sparse_attn_fwd`` (:mod:`sparse_io_attn.block_sparse.op`).
    """
    call = prepare(q, k, v, layout, causal=causal, sm_scale=sm_scale, backend=backend, sinks=sinks)
    p = call.plan
    out, lse, _, _ = block_sparse_attn_fwd(q, k, v, p.index, list(p.meta), p.causal_offset, call.sm_scale,
                                           call.backend, sinks, wants_residual(q.dtype, q, k, v, sinks))
    return (out, lse) if return_lse else out


__all__ = ["BACKENDS", "Call", "block_sparse_attention", "check_tensors", "prepare", "resolve_backend"]
