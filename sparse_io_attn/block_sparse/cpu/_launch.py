"""Host side of backend ``"cpu"``: the plan's lists in, the C++ ops (:mod:`sparse_io_attn._cpu.build`) called."""
from __future__ import annotations

import torch

from sparse_io_attn._attention.cpu import check_cpu
from sparse_io_attn._attention.sinks import sinks_base2
# query tokens up to which the forward runs the decode kernel: one constant for every backend (the C++
# decode ops take any Nq; MAX_QUERIES in _cpu/split_k.h names the same threshold)
from sparse_io_attn._attention.tiles import DECODE_MAX_QUERIES
from sparse_io_attn._cpu.build import load
from sparse_io_attn.block_sparse.plan import AttentionPlan


def forward(q, k, v, plan: AttentionPlan, *, sm_scale: float, sinks=None, residual: bool = False,
            decode: bool | None = None):
    """``(out [B, Hq, Nq, D] in q's dtype, lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq])``, and with
    ``residual=True`` the output's rounding residual (None for fp32) as a fourth result.

    ``sinks``: one sink logit per query head (:mod:`sparse_io_attn._attention.sinks`), folded in the
    kernels' row store. ``decode``: run the decode kernel (split-K over each row's kept blocks, K/V
    read in place, nothing packed or converted outside the kept blocks); ``None`` (default): when
    ``Nq <= 16``."""
    check_cpu(q, k, v)
    stride_lb, stride_lh = plan.layout_strides(q.shape[0], q.shape[1])
    ops = load()
    if decode is None:
        decode = q.shape[2] <= DECODE_MAX_QUERIES
    fwd = ops.fwd_decode if decode else ops.fwd
    out, lse, stats, res = fwd(q, k, v, *plan.rows.tensors(), plan.masks, plan.BLOCK_SIZE_Q, plan.BLOCK_SIZE_KV,
                               stride_lb, stride_lh, plan.causal_offset, float(sm_scale),
                               None if sinks is None else sinks_base2(sinks), residual)
    return (out, lse, stats, res if res.numel() else None) if residual else (out, lse, stats)


def backward(do, q, k, v, out, stats, plan: AttentionPlan, *, sm_scale: float, delta=None):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv summed over each GQA group. ``delta``: fp32 ``[B,
    Hq, Nq]`` row deltas formed by the caller (:mod:`sparse_io_attn._attention.delta`), else
    ``rowsum(do * out)``."""
    check_cpu(do, q, k, v, out, stats)
    stride_lb, stride_lh = plan.layout_strides(q.shape[0], q.shape[1])
    return load().bwd(do.to(q.dtype), q, k, v, out.to(q.dtype), stats.to(torch.float32), *plan.cols.tensors(),
                      plan.masks, plan.masks_t, plan.BLOCK_SIZE_Q, plan.BLOCK_SIZE_KV, stride_lb, stride_lh,
                      plan.causal_offset, float(sm_scale), None if delta is None else delta.float().contiguous())
