"""``@triton.jit`` helpers of the online softmax every attention kernel shares, one per mechanism:

* :func:`score_tile`: the base-2 scores of a tile, saturated to the finite fp32 range;
* :func:`softmax_step`: one tile of the forward's online softmax (running max, sum, accumulator);
* :func:`store_rows` / :func:`store_split_rows` / :func:`store_partial_rows`: a row block's outputs
  (``o``, ``lse``, ``stats``), or a decode split's (or a key-major tile's) partial ``(m, l, acc)``;
* :func:`load_stats` and :func:`probabilities`: the backward's recomputed probabilities from the
  forward's row statistics, never above 1;
* :func:`dq_step` / :func:`dkdv_step` (:func:`dkdv_ds_step`: also ``dS^T``): one tile's contribution
  to ``dQ`` and to ``dK``/``dV``.

Every kernel forms its scores, probabilities and outputs here, so the backward recomputes what the
forward computed and every op writes ``o``, ``lse`` and ``stats`` with one convention."""
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
def softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One tile of the online softmax: ``s [rows, keys]`` the tile's base-2 scores (``-inf`` where a key
    is not allowed), ``v [keys, HEAD_DIM_V]``. ``MAY_BE_EMPTY``: a row may have no allowed key yet
    (``m = -inf``), kept at a finite shift. Returns ``(acc, l_i, m_i)``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [rows]
    if MAY_BE_EMPTY:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.math.exp2(s - m_shift[:, None])  # [rows, keys]
    alpha = tl.math.exp2(m_i - m_shift)  # [rows]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot(p, v, acc * alpha[:, None], DOT_DTYPE)  # [rows, HEAD_DIM_V]
    return acc, l_i, m_new


@triton.jit
def load_stats(stats_ptr, stats_stride, rows, mask_m):
    """The forward's row maximum (base 2) and ``log2`` row sum; ``m = +inf`` on empty and padded
    rows, so that ``p = exp2((s - m) - log2_sum) = 0`` there."""
    m = tl.load(stats_ptr + rows, mask=mask_m, other=float("inf"))
    log2_sum = tl.load(stats_ptr + stats_stride + rows, mask=mask_m, other=0.0)
    return m, log2_sum


@triton.jit
def probabilities(s, m, log2_sum):
    """The forward's probabilities ``p = exp2((s - m) - log2_sum)`` recomputed from its row statistics
    (``m``, ``log2_sum`` broadcast to ``s``'s shape; ``s = -inf`` where an element is not allowed, ``m =
    +inf`` on empty rows: ``p = 0``). The exponent is capped at 0: a probability never exceeds 1, so
    a recomputed score that rounds above the forward's row maximum (other tile shapes or operand
    order, at logits ~1e9 an ulp is ~1e2) cannot overflow. NaN stays NaN."""
    return tl.math.exp2(tl.minimum((s - m) - log2_sum, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def dq_step(dq, p, do, k, v, delta, DOT_DTYPE: tl.constexpr):
    """``dq += (p * (do @ v^T - delta)) @ k`` for one key tile (``p [rows, keys]``)."""
    dp = dot(do, tl.trans(v), None, DOT_DTYPE)  # [rows, keys]
    ds = p * (dp - delta[:, None])  # [rows, keys]
    return dot(ds, k, dq, DOT_DTYPE)  # [rows, HEAD_DIM]


@triton.jit
def dkdv_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE: tl.constexpr, DP_FIRST: tl.constexpr = False):
    """``dv += p^T @ do``, ``dk += (p^T * (v @ do^T - delta)) @ q`` for one query tile (``pT [keys, rows]``).
    ``DP_FIRST``: ``dp^T`` and ``ds^T`` before both accumulating products, else ``dv`` first: the same
    values, but on Hopper the order decides what is live beside the in-flight ``wgmma`` (the block-sparse
    dK/dV's 128-key tiles need ``DP_FIRST`` to stay unspilled at head dim 128; the selection kernels
    compile without spills in the other order). Returns ``(dk, dv)``."""
    dk, dv, _ = dkdv_ds_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE, DP_FIRST)
    return dk, dv


@triton.jit
def dkdv_ds_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE: tl.constexpr, DP_FIRST: tl.constexpr = False):
    """:func:`dkdv_step` that also returns the tile's ``dS^T = p^T * (v @ do^T - delta)`` (``[keys, rows]``):
    a kernel that owns the rows' dQ partials forms ``dS @ k`` from it. Returns ``(dk, dv, dsT)``."""
    if not DP_FIRST:
        dv = dot(pT, do, dv, DOT_DTYPE)  # [keys, HEAD_DIM]
    dpT = dot(v, tl.trans(do), None, DOT_DTYPE)  # [keys, rows]
    dsT = pT * (dpT - delta[None, :])  # [keys, rows]
    if DP_FIRST:
        dv = dot(pT, do, dv, DOT_DTYPE)  # [keys, HEAD_DIM]
    dk = dot(dsT, q, dk, DOT_DTYPE)  # [keys, HEAD_DIM]
    return dk, dv, dsT


@triton.jit
def fold_sink(acc, l_i, m_i, s2):
    """``(acc, l, m)`` with each row's sink folded in (``s2``: the head's sink in base-2 units, ``-inf`` for
    none; :mod:`sparse_io_attn._attention.sinks`): ``m' = max(m, s2)``, ``l' = l 2^(m - m') + 2^(s2 - m')``,
    ``acc' = acc 2^(m - m')``. A row without an allowed key gets ``l' = 1``, ``m' = s2``: ``o = 0``,
    ``lse = s``."""
    sink = s2 > float("-inf")
    m = tl.where(l_i == 0.0, float("-inf"), m_i)       # (an empty row's running shift is not a maximum)
    top = tl.where(sink, tl.maximum(m, s2), 0.0)       # m', finite where there is a sink (no -inf - -inf)
    scale = tl.math.exp2(m - top)                      # 0 for an empty row
    l_new = l_i * scale + tl.math.exp2(s2 - top)
    return (tl.where(sink[:, None], acc * scale[:, None], acc), tl.where(sink, l_new, l_i),
            tl.where(sink, top, m_i))


@triton.jit
def store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, rows_out, o_rows, o_cols, mask_r, mask_d, stats_stride,
               sinks_ptr, heads, HAS_SINKS: tl.constexpr, res_ptr, HAS_RESIDUAL: tl.constexpr):
    """The rows' outputs from ``(acc, l, m)``: ``o = acc / l`` (0 on empty rows; at ``o_ptr + o_rows[:, None]
    + o_cols[None, :]``), ``lse`` (natural log, ``-inf`` on empty rows) and ``stats`` (row maximum, log2
    row sum; ``+inf``/0 on empty rows) at the flat rows ``rows_out``. ``HAS_SINKS``: the rows' heads'
    sinks (``sinks_ptr``: fp32 base-2 ``[Hq]``, ``heads``: each row's head) folded in first
    (:func:`fold_sink`); the sink's 4 bytes per row are not counted (nor in the traffic model).
    ``HAS_RESIDUAL``: also the output's rounding residual ``fl(o - fl(o))`` in ``o``'s dtype at ``res_ptr``
    (same offsets as ``o``), from which the backward forms its row deltas as from the fp32 output
    (:mod:`sparse_io_attn._attention.delta`)."""
    if HAS_SINKS:
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, tl.load(sinks_ptr + heads, mask=mask_r, other=float("-inf")))
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    log2_sum = tl.where(empty, 0.0, tl.math.log2(tl.where(empty, 1.0, l_i)))
    o = out.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + o_rows[:, None] + o_cols[None, :], o, mask=mask_r[:, None] & mask_d[None, :])
    if HAS_RESIDUAL:
        tl.store(res_ptr + o_rows[:, None] + o_cols[None, :], (out - o.to(tl.float32)).to(res_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_d[None, :])
    tl.store(lse_ptr + rows_out, tl.where(empty, float("-inf"), (m_i + log2_sum) * LN2), mask=mask_r)
    tl.store(stats_ptr + rows_out, tl.where(empty, float("inf"), m_i), mask=mask_r)
    tl.store(stats_ptr + stats_stride + rows_out, log2_sum, mask=mask_r)


@triton.jit
def store_split_rows(o_ptr, lse_ptr, stats_ptr, partial_ptr, acc, l_i, m_i, split, rows_out, o_rows, o_cols, offs_d,
                     mask_r, mask_d, stats_stride, sinks_ptr, heads, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     HAS_SINKS: tl.constexpr):
    """A decode split's rows: with one split the outputs (:func:`store_rows`, ``o`` at ``o_rows[:, None] +
    o_cols[None, :]``); otherwise its ``(m, l, acc)`` into ``partial [NUM_SPLITS, stats_stride rows, 2 +
    HEAD_DIM]`` (fp32; ``HEAD_DIM``, ``offs_d``, ``mask_d``: the output's, V's head dim) for the merge kernel."""
    if NUM_SPLITS == 1:
        store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, rows_out, o_rows, o_cols, mask_r, mask_d, stats_stride,
                   sinks_ptr, heads, HAS_SINKS, o_ptr, False)
    else:
        store_partial_rows(partial_ptr, acc, l_i, m_i, split, rows_out, offs_d, mask_r, mask_d, stats_stride,
                           HEAD_DIM)


@triton.jit
def store_partial_rows(partial_ptr, acc, l_i, m_i, split, rows_out, offs_d, mask_r, mask_d, num_rows,
                       HEAD_DIM: tl.constexpr):
    """Rows' partial results ``(m, l, acc)`` (fp32, ``acc`` unnormalised) at ``partial[split, rows_out]`` of
    ``partial [splits, num_rows, 2 + HEAD_DIM]`` (``HEAD_DIM``: V's; ``split``: a scalar, or one per row), for
    :func:`~sparse_io_attn._attention.triton.kernels.merge_rows`."""
    rows64 = rows_out.to(tl.int64)
    base = partial_ptr + ((rows64 * 0 + split) * num_rows + rows64) * (2 + HEAD_DIM)  # (int64 offsets)
    tl.store(base, m_i, mask=mask_r)
    tl.store(base + 1, l_i, mask=mask_r)
    tl.store(base[:, None] + 2 + offs_d[None, :], acc, mask=mask_r[:, None] & mask_d[None, :])


__all__ = ["dkdv_ds_step", "dkdv_step", "dq_step", "load_stats", "probabilities", "score_tile", "softmax_step",
           "fold_sink", "store_partial_rows", "store_rows", "store_split_rows"]
