"""The kernels both attention ops launch as they are (``@triton.jit`` only; the launch descriptions
are :func:`~.launch.preprocess_call` and :func:`~.launch.merge_call`):

* ``attn_bwd_preprocess_kernel``: the backward's ``delta = rowsum(dO * O)`` (fp32 ``[B, Hq, Nq]``).
* ``attn_decode_merge_kernel``: the split-K decode's partial rows merged in split order
  (:func:`merge_rows`, which the selection op's key-major merge calls with per-row split counts).

With ``COUNT_IO`` each program tallies the bytes it moves per tensor (slots :mod:`.slots`, model
:mod:`sparse_io_attn._attention.traffic`)."""
from __future__ import annotations

from sparse_io_attn._attention.triton.slots import PRE_DELTA, PRE_DO, PRE_O, PRE_RESIDUAL
from sparse_io_attn._attention.triton.softmax import store_rows
from sparse_io_attn._attention.triton.tally import tally_merge
from sparse_io_attn._triton.jit import io_add  # (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr, res_ptr, io_ptr,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    seqlen_q, num_heads_q, head_dim,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    COUNT_IO: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` in fp32; ``HAS_RESIDUAL``: ``O + r``, ``r`` the forward's rounding residual
    (``res_ptr``, ``o``'s strides): the fp32 output's row deltas (:mod:`sparse_io_attn._attention.delta`)."""
    pid_m = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = (pid_zh // num_heads_q).to(tl.int64)
    off_h = (pid_zh % num_heads_q).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seqlen_q
    mask = mask_m[:, None] & (offs_d < head_dim)[None, :]
    o_offs = off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    o = tl.load(o_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, HEAD_DIM]
    if HAS_RESIDUAL:
        o += tl.load(res_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)  # [BLOCK_M, HEAD_DIM]
    delta = tl.sum(o * do.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(delta_ptr + pid_zh.to(tl.int64) * seqlen_q + offs_m, delta, mask=mask_m)
    if COUNT_IO:
        rows = tl.sum(mask_m.to(tl.int64))
        io_add(io_ptr, PRE_O, rows * head_dim * ELEM_BYTES, 0)
        io_add(io_ptr, PRE_DO, rows * head_dim * ELEM_BYTES, 0)
        io_add(io_ptr, PRE_DELTA, 0, rows * 4)
        if HAS_RESIDUAL:
            io_add(io_ptr, PRE_RESIDUAL, rows * head_dim * ELEM_BYTES, 0)


@triton.jit
def merge_rows(partial_ptr, o_ptr, lse_ptr, stats_ptr, rows, mask_r, counts, n_splits, stride_oz, stride_oh,
               stride_om, stride_od, num_rows, seqlen_q, num_heads_q, head_dim, sinks_ptr, HEAD_DIM: tl.constexpr,
               HAS_SINKS: tl.constexpr, res_ptr, HAS_RESIDUAL: tl.constexpr):
    """Rows ``rows`` (flat ``(b, h, t)``) of ``partial [splits, num_rows, 2 + HEAD_DIM]`` (``HEAD_DIM``,
    ``head_dim``: the output's, V's) merged in split order,
    each row's first ``counts`` splits (``counts`` per row, ``n_splits`` their maximum; ``M = max m_s``, ``L =
    sum l_s 2^(m_s - M)``, ``o = sum acc_s 2^(m_s - M) / L``, as a running merge), then ``o``, ``lse``,
    ``stats`` (``HAS_RESIDUAL``: and ``o``'s rounding residual at ``res_ptr``, :func:`store_rows`). Splits without an
    allowed key (``l_s = 0``) add nothing; a row without any gets ``o = 0``."""
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    m_i = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    l_i = tl.zeros(rows.shape, dtype=tl.float32)
    acc = tl.zeros([rows.shape[0], HEAD_DIM], dtype=tl.float32)
    for s in tl.range(0, n_splits, num_stages=2):   # (its own stages: the pipeliner multi-buffers the loads)
        ok = mask_r & (s < counts)
        rows64 = rows.to(tl.int64)
        base = partial_ptr + ((rows64 * 0 + s) * num_rows + rows64) * (2 + HEAD_DIM)  # (int64 offsets)
        m_s = tl.load(base, mask=ok, other=float("-inf"))
        l_s = tl.load(base + 1, mask=ok, other=0.0)
        a_s = tl.load(base[:, None] + 2 + offs_d[None, :], mask=ok[:, None] & mask_d[None, :], other=0.0)
        live = l_s != 0.0
        m_new = tl.where(live, tl.maximum(m_i, m_s), m_i)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # finite: no -inf - -inf
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2(m_i - m_ref))
        beta = tl.where(live, tl.math.exp2(m_s - m_ref), 0.0)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    z = rows // (num_heads_q * seqlen_q)
    h = (rows // seqlen_q) % num_heads_q
    m = rows % seqlen_q
    store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, rows,
               z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh + m * stride_om, offs_d * stride_od,
               mask_r, mask_d, num_rows, sinks_ptr, h, HAS_SINKS, res_ptr, HAS_RESIDUAL)


@triton.jit
def attn_decode_merge_kernel(
    partial_ptr, o_ptr, lse_ptr, stats_ptr, sinks_ptr, io_ptr,
    stride_oz, stride_oh, stride_om, stride_od,
    num_rows, seqlen_q, num_heads_q, head_dim,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, ELEM_BYTES: tl.constexpr,
    HAS_SINKS: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per ``BLOCK_R`` rows: the splits' partial results merged in split order
    (:func:`merge_rows`), then ``o``, ``lse``, ``stats``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < num_rows
    merge_rows(partial_ptr, o_ptr, lse_ptr, stats_ptr, rows, mask_r, NUM_SPLITS, NUM_SPLITS, stride_oz, stride_oh,
               stride_om, stride_od, num_rows, seqlen_q, num_heads_q, head_dim, sinks_ptr, HEAD_DIM, HAS_SINKS, o_ptr,
               False)
    if COUNT_IO:
        n = tl.sum(mask_r.to(tl.int64))
        tally_merge(io_ptr, n, n * NUM_SPLITS, head_dim * ELEM_BYTES, head_dim)


__all__ = ["attn_bwd_preprocess_kernel", "attn_decode_merge_kernel", "merge_rows"]
