"""``@triton.jit`` helpers of the online softmax every attention kernel shares: the score tile
(:func:`score_tile`), the forward's row statistics read back by the backward (:func:`load_stats`),
and a row block's outputs (:func:`store_rows`). Every kernel forms its scores and stores its rows
here, so the backward recomputes the forward's probabilities exactly and every op writes ``o``,
``lse`` and ``stats`` with one convention."""
from __future__ import annotations

from sparse_io_attn._triton.jit import FP32_MAX, LN2, dot  # (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def score_tile(q, k, qk_scale, DOT_DTYPE: tl.constexpr):
    """Base-2 scores ``q @ k^T * qk_scale`` (``[rows of q, rows of k]``, fp32), saturated to the
    finite fp32 range: a score past it would be +-inf and the row maximum's subtraction
    ``inf - inf`` NaN; saturated, a row's largest scores share its probability. Every kernel forms
    its scores here, so backward recomputes them exactly as the forward did. NaN stays NaN."""
    s = dot(q, tl.trans(k), None, DOT_DTYPE) * qk_scale
    return tl.minimum(tl.maximum(s, -FP32_MAX, propagate_nan=tl.PropagateNan.ALL), FP32_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def load_stats(stats_ptr, stats_stride, rows, mask_m):
    """The forward's row maximum (base 2) and ``log2`` row sum; ``m = +inf`` on empty and padded
    rows, so that ``p = exp2((s - m) - log2_sum) = 0`` there."""
    m = tl.load(stats_ptr + rows, mask=mask_m, other=float("inf"))
    log2_sum = tl.load(stats_ptr + stats_stride + rows, mask=mask_m, other=0.0)
    return m, log2_sum


@triton.jit
def store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, rows_out, o_rows, offs_d, mask_r, mask_d, stats_stride):
    """The rows' outputs from ``(acc, l, m)``: ``o = acc / l`` (0 on empty rows), ``lse`` (natural log,
    ``-inf`` on empty rows) and ``stats`` (row maximum, log2 row sum; ``+inf``/0 on empty rows)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    log2_sum = tl.where(empty, 0.0, tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_d[None, :])
    tl.store(lse_ptr + rows_out, tl.where(empty, float("-inf"), (m_i + log2_sum) * LN2), mask=mask_r)
    tl.store(stats_ptr + rows_out, tl.where(empty, float("inf"), m_i), mask=mask_r)
    tl.store(stats_ptr + stats_stride + rows_out, log2_sum, mask=mask_r)


__all__ = ["load_stats", "score_tile", "store_rows"]
