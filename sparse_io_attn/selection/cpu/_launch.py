"""Host side of backend ``"cpu"`` for :func:`~sparse_io_attn.selection_attention`: the plan's tensors
in, the C++ ops (:mod:`sparse_io_attn._cpu.build`) called."""
from __future__ import annotations

import os

import torch

from sparse_io_attn._attention.cpu import check_cpu
from sparse_io_attn._attention.sinks import sinks_base2
from sparse_io_attn._attention.tiles import DECODE_MAX_QUERIES
from sparse_io_attn._cpu.build import load
from sparse_io_attn.selection.plan import SelectionPlan

#: which kernel family runs: ``"key"`` (key-major: gathered queries per key block, dense tiles) or
#: ``"query"`` (query-major: each token's gathered keys); unset or ``"auto"``: by the block size
FAMILY_ENV = "SPARSE_IO_ATTN_SELECTION_FAMILY"
FAMILIES = {"auto": 0, "key": 1, "query": 2}
#: ``"auto"``: key-major from this block size on (problem.h's KEY_MAJOR_MIN_BLOCK) ...
KEY_MAJOR_MIN_BLOCK = 16
#: ... while its per-pair partial results ([B, Hq, Nq, K] x (D + 2) fp32) fit this (MAX_PARTIAL_BYTES)
MAX_PARTIAL_BYTES = 2 << 30


def family(plan: SelectionPlan, name: str | None = None, q: torch.Tensor | None = None) -> str:
    """The family a call runs: ``name``, else ``$SPARSE_IO_ATTN_SELECTION_FAMILY``, else key-major for
    blocks of 16 keys and more (when ``q`` is given: and pair partials within 2 GiB), query-major otherwise."""
    name = name if name is not None else os.environ.get(FAMILY_ENV, "auto") or "auto"
    if name not in FAMILIES:
        raise ValueError(f"selection kernel family must be one of {tuple(FAMILIES)}, got {name!r} "
                         f"(argument family_name= or ${FAMILY_ENV})")
    if name != "auto":
        return name
    if plan.block_size < KEY_MAJOR_MIN_BLOCK:
        return "query"
    if q is not None:
        B, Hq, Nq, D = q.shape
        if B * Hq * Nq * plan.max_blocks * (D + 2) * 4 > MAX_PARTIAL_BYTES:
            return "query"
    return "key"


def _plan_args(plan: SelectionPlan, q: torch.Tensor, k: torch.Tensor, lists: bool) -> tuple:
    head_map = plan.head_map(q.shape[0], q.shape[1], k.shape[1])
    keys = plan.keys() if lists else (None, None, None)
    return (plan.rows, plan.row_counts, *keys), (plan.block_size, head_map.stride_lb, head_map.heads_per_selection,
                                                 plan.causal_offset)


def forward(q, k, v, plan: SelectionPlan, *, sm_scale: float, sinks=None, residual: bool = False,
            family_name: str | None = None, decode: bool | None = None):
    """``(out [B, Hq, Nq, D] in q's dtype, lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq])``, and with
    ``residual=True`` the output's rounding residual (None for fp32) as a fourth result.

    ``sinks``: one sink logit per query head (:mod:`sparse_io_attn._attention.sinks`), folded in the
    kernels' row store. ``decode``: run the decode kernel (split-K over each token's selected keys,
    K/V read in place, no key lists, nothing proportional to Nk), with the scores formed as the
    family's backward forms them; ``None`` (default): when ``Nq <= 16``."""
    check_cpu(q, k, v, plan_device=plan.device)
    ops = load()
    fam = family(plan, family_name, q)
    if decode is None:
        decode = q.shape[2] <= DECODE_MAX_QUERIES
    tail = (float(sm_scale), FAMILIES[fam], None if sinks is None else sinks_base2(sinks), residual)
    if decode:
        _, ints = _plan_args(plan, q, k, lists=False)
        out, lse, stats, res = ops.selection_decode_fwd(q, k, v, plan.rows, plan.row_counts, *ints, *tail,
                                                        table=plan.table)
    else:
        tensors, ints = _plan_args(plan, q, k, lists=fam == "key")
        out, lse, stats, res = ops.selection_fwd(q, k, v, *tensors, *ints, *tail, table=plan.table)
    return (out, lse, stats, res if res.numel() else None) if residual else (out, lse, stats)


def backward(do, q, k, v, out, stats, plan: SelectionPlan, *, sm_scale: float, delta=None,
             family_name: str | None = None):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv summed over each GQA group. ``delta``: fp32 ``[B,
    Hq, Nq]`` row deltas formed by the caller (:mod:`sparse_io_attn._attention.delta`), else
    ``rowsum(do * out)``."""
    check_cpu(do, q, k, v, out, stats, plan_device=plan.device)
    ops = load()
    fam = family(plan, family_name, q)
    tensors, ints = _plan_args(plan, q, k, lists=True)
    return ops.selection_bwd(do.to(q.dtype), q, k, v, out.to(q.dtype), stats.to(torch.float32), *tensors, *ints,
                             float(sm_scale), FAMILIES[fam], None if delta is None else delta.float().contiguous(),
                             table=plan.table)
