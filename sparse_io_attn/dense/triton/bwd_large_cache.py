"""Large-cache backward kernels, Algorithms 7-9 (Appendix D), ``@triton.jit`` only.

All ``n x d`` operands are contiguous ``[Z, n, d]`` (the launcher guarantees it), ``lse``/``v`` are
fp32 ``[Z, n]``; ``f = exp(scale * S A2^T - lse)`` is recomputed tile by tile and never stored.

* :func:`_row_kernel` (rows outer, keys inner). With ``FAITHFUL`` it is Algorithm 8: a program
  keeps the ``d x d`` gradient ``g`` in fast memory for its whole life, walks row blocks ``i`` of
  ``B_r = BLOCK_M`` rows (``S_i, O_i, dO_i, A1_i, l_i`` read once; ``v_i = (dO_i o O_i) 1``), and for
  each key block ``j`` of ``B_c = BLOCK_N`` rows reads ``h_j`` and ``A2_j`` and computes
  ``q_ij, f_ij, p_ij``, ``T_{*,j} = A1_i^T p_ij`` and ``g += T_{*,j} A2_j`` (lines 6-25). Beside ``g``
  it accumulates ``dS_i = p_i A2`` for the gradient of ``A1``. ``num_splits`` programs per batch
  element share the row blocks (round robin) and write one partial ``g`` each.
  Without ``FAITHFUL`` it is FlashAttention-2's dQ loop: ``v`` comes precomputed, no ``g``.
* :func:`_col_kernel` (keys outer, rows inner; FlashAttention-2's dK/dV loop): a program keeps
  ``A2_j, h_j`` and accumulates ``dA2_j = scale * p_{:,j}^T S`` and ``dh_j = f_{:,j}^T dO``.

Counter slots come from :mod:`.slots`, built from the traffic model's ``ROW_TENSORS`` (``DQ_TENSORS``
without ``FAITHFUL``) and ``COL_TENSORS``.
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import dot, io_add, nbytes

import triton
import triton.language as tl

from sparse_io_attn.dense.triton.common import _program, _rows
from sparse_io_attn.dense.triton.slots import (COL_A2, COL_DA2, COL_DH, COL_DO, COL_H, COL_LSE, COL_S, COL_V, ROW_A1,
                                               ROW_A2, ROW_DO, ROW_DS, ROW_G, ROW_H, ROW_LSE, ROW_OV, ROW_S)


@triton.jit
def _row_kernel(
    s_ptr, a2_ptr, h_ptr, do_ptr, lse_ptr, ov_ptr, a1_ptr, ds_ptr, g_ptr, io_ptr,
    seqlen, head_dim, num_splits, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, FAITHFUL: tl.constexpr,
    DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """Rows outer, keys inner (Algorithm 8 with ``FAITHFUL``, else the dQ loop); counter roles
    :data:`~sparse_io_attn.dense.traffic.ROW_TENSORS`."""
    pid_s, off_z, base, offs_d, mask_d = _program(seqlen, head_dim, HEAD_DIM)
    num_m = tl.cdiv(seqlen, BLOCK_M)
    if FAITHFUL:
        g = tl.zeros([HEAD_DIM, HEAD_DIM], dtype=tl.float32)  # line 5: g in cache
    rd_s = tl.zeros([], dtype=tl.int64)
    rd_a2 = tl.zeros([], dtype=tl.int64)
    rd_h = tl.zeros([], dtype=tl.int64)
    rd_do = tl.zeros([], dtype=tl.int64)
    rd_l = tl.zeros([], dtype=tl.int64)
    rd_ov = tl.zeros([], dtype=tl.int64)
    rd_a1 = tl.zeros([], dtype=tl.int64)
    wr_ds = tl.zeros([], dtype=tl.int64)
    for mb in range(pid_s, num_m, num_splits):
        offs_m, mask_m, mask_md, rows = _rows(base, mb * BLOCK_M, BLOCK_M, seqlen, head_dim, offs_d, mask_d)
        do = tl.load(do_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
        if FAITHFUL:  # lines 7-9: v_i = (dO_i o O_i) 1, then O_i leaves the cache
            o = tl.load(ov_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
            v = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # [BLOCK_M]
        else:
            v = tl.load(ov_ptr + off_z * seqlen + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        s = tl.load(s_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
        lse = tl.load(lse_ptr + off_z * seqlen + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        if FAITHFUL:
            a1 = tl.load(a1_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
        ds = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for n0 in range(0, seqlen, BLOCK_N):
            offs_n, mask_n, mask_nd, cols = _rows(base, n0, BLOCK_N, seqlen, head_dim, offs_d, mask_d)
            h = tl.load(h_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
            q = dot(do, tl.trans(h), None, DOT_DTYPE)  # [BLOCK_M, BLOCK_N], line 12
            a2 = tl.load(a2_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
            scores = dot(s, tl.trans(a2), None, DOT_DTYPE) * sm_scale  # [BLOCK_M, BLOCK_N], line 14
            f = tl.exp(scores - lse[:, None])  # lines 15-16
            f = tl.where(mask_m[:, None] & mask_n[None, :], f, 0.0)
            p = f * (q - v[:, None])  # [BLOCK_M, BLOCK_N], line 18
            ds = dot(p, a2, ds, DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]
            if FAITHFUL:
                t = dot(tl.trans(a1), p, None, DOT_DTYPE)  # [HEAD_DIM, BLOCK_N], line 20
                g = dot(t, a2, g, DOT_DTYPE)  # [HEAD_DIM, HEAD_DIM], line 21
            if COUNT_IO:
                rd_h += nbytes(mask_nd, h_ptr)
                rd_a2 += nbytes(mask_nd, a2_ptr)
        tl.store(ds_ptr + rows, ds.to(ds_ptr.dtype.element_ty), mask=mask_md)
        if COUNT_IO:
            rd_do += nbytes(mask_md, do_ptr)
            rd_s += nbytes(mask_md, s_ptr)
            rd_l += nbytes(mask_m, lse_ptr)
            wr_ds += nbytes(mask_md, ds_ptr)
            if FAITHFUL:
                rd_ov += nbytes(mask_md, ov_ptr)
                rd_a1 += nbytes(mask_md, a1_ptr)
            else:
                rd_ov += nbytes(mask_m, ov_ptr)
    if FAITHFUL:  # line 26: write g (one partial per program)
        mask_g = mask_d[:, None] & mask_d[None, :]
        g_ptrs = g_ptr + (off_z * num_splits + pid_s) * head_dim * head_dim \
            + offs_d[:, None] * head_dim + offs_d[None, :]
        tl.store(g_ptrs, g * sm_scale, mask=mask_g)
    if COUNT_IO:
        io_add(io_ptr, ROW_S, rd_s, 0)
        io_add(io_ptr, ROW_A2, rd_a2, 0)
        io_add(io_ptr, ROW_H, rd_h, 0)
        io_add(io_ptr, ROW_DO, rd_do, 0)
        io_add(io_ptr, ROW_LSE, rd_l, 0)
        io_add(io_ptr, ROW_OV, rd_ov, 0)
        io_add(io_ptr, ROW_DS, 0, wr_ds)
        if FAITHFUL:
            io_add(io_ptr, ROW_A1, rd_a1, 0)
            io_add(io_ptr, ROW_G, 0, nbytes(mask_g, g_ptr))


@triton.jit
def _col_kernel(
    s_ptr, a2_ptr, h_ptr, do_ptr, lse_ptr, v_ptr, da2_ptr, dh_ptr, io_ptr,
    seqlen, head_dim, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """Keys outer, rows inner (the dK/dV loop); counter slots :data:`~sparse_io_attn.dense.traffic.COL_TENSORS`."""
    pid_n, off_z, base, offs_d, mask_d = _program(seqlen, head_dim, HEAD_DIM)
    offs_n, mask_n, mask_nd, cols = _rows(base, pid_n * BLOCK_N, BLOCK_N, seqlen, head_dim, offs_d, mask_d)
    a2 = tl.load(a2_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
    h = tl.load(h_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
    da2 = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dh = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    rd_s = tl.zeros([], dtype=tl.int64)
    rd_do = tl.zeros([], dtype=tl.int64)
    rd_l = tl.zeros([], dtype=tl.int64)
    rd_v = tl.zeros([], dtype=tl.int64)
    for m0 in range(0, seqlen, BLOCK_M):
        offs_m, mask_m, mask_md, rows = _rows(base, m0, BLOCK_M, seqlen, head_dim, offs_d, mask_d)
        s = tl.load(s_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
        do = tl.load(do_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
        lse = tl.load(lse_ptr + off_z * seqlen + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        v = tl.load(v_ptr + off_z * seqlen + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        scores = dot(s, tl.trans(a2), None, DOT_DTYPE) * sm_scale  # [BLOCK_M, BLOCK_N]
        f = tl.where(mask_m[:, None] & mask_n[None, :], tl.exp(scores - lse[:, None]), 0.0)
        q = dot(do, tl.trans(h), None, DOT_DTYPE)  # [BLOCK_M, BLOCK_N]
        p = f * (q - v[:, None])  # [BLOCK_M, BLOCK_N]
        dh = dot(tl.trans(f), do, dh, DOT_DTYPE)  # [BLOCK_N, HEAD_DIM]
        da2 = dot(tl.trans(p), s, da2, DOT_DTYPE)  # [BLOCK_N, HEAD_DIM]
        if COUNT_IO:
            rd_s += nbytes(mask_md, s_ptr)
            rd_do += nbytes(mask_md, do_ptr)
            rd_l += nbytes(mask_m, lse_ptr)
            rd_v += nbytes(mask_m, v_ptr)
    tl.store(da2_ptr + cols, (da2 * sm_scale).to(da2_ptr.dtype.element_ty), mask=mask_nd)
    tl.store(dh_ptr + cols, dh.to(dh_ptr.dtype.element_ty), mask=mask_nd)
    if COUNT_IO:
        io_add(io_ptr, COL_S, rd_s, 0)
        io_add(io_ptr, COL_A2, nbytes(mask_nd, a2_ptr), 0)
        io_add(io_ptr, COL_H, nbytes(mask_nd, h_ptr), 0)
        io_add(io_ptr, COL_DO, rd_do, 0)
        io_add(io_ptr, COL_LSE, rd_l, 0)
        io_add(io_ptr, COL_V, rd_v, 0)
        io_add(io_ptr, COL_DA2, 0, nbytes(mask_nd, da2_ptr))
        io_add(io_ptr, COL_DH, 0, nbytes(mask_nd, dh_ptr))
