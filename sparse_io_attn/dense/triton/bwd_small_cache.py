"""Small-cache backward kernels, Algorithm 6 (Appendix C), ``@triton.jit`` only.

Every matrix is cut into ``BLOCK x BLOCK`` tiles (the paper's ``B = sqrt(M/4)``); a program holds at
most three tiles and two length-``BLOCK`` vectors (see :mod:`.tiles`).

* :func:`_tile_matmul_kernel`: ``C = alpha * A B`` with tiled ``A, B, C`` (one program per output
  tile, streaming the tiles of its row of ``A`` and column of ``B``) -- every matrix product of
  phases 1, 2 and 4 and of the other gradients. Transposes come in through strides.
* :func:`_softmax_kernel`: phase 1, lines 15-35 of Algorithm 2: one program per row block ``i``
  computes the score tiles ``A[i, j] = scale * S[i, :] A2[j, :]^T``, writes them to ``f``, then reads
  them back and writes ``f[i, j] = exp(A[i, j] - m_i) / l_i``. It keeps the running row maximum
  ``m_i`` beside the paper's row sum ``l_i`` (numerically safe softmax; the paper's ``exp`` without
  the maximum overflows). With ``WRITE_LSE`` (the small-cache forward) it also writes
  ``lse_i = m_i + log(l_i)`` (fp32, natural log), the statistic the large-cache backward reads.
* :func:`_phase3_kernel`: Algorithm 4, ``p = f o q - diag((f o q) 1) f`` in two sweeps over a row
  block (the row sums ``v_i`` first, then ``p``).

Counter slots come from :mod:`.slots`, built from the traffic model's ``PRODUCT_TENSORS``,
``SOFTMAX_TENSORS`` and ``PHASE3_TENSORS``.
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import dot, io_add, nbytes

import triton
import triton.language as tl

from sparse_io_attn.dense.triton.common import _store_product
from sparse_io_attn.dense.triton.slots import (PHASE3_F, PHASE3_P, PHASE3_Q, SOFTMAX_A2, SOFTMAX_F, SOFTMAX_LSE,
                                               SOFTMAX_S)


@triton.jit
def _tile_matmul_kernel(
    a_ptr, b_ptr, c_ptr, io_ptr,
    stride_az, stride_am, stride_ak,
    stride_bz, stride_bk, stride_bn,
    stride_cz, stride_cm, stride_cn,
    size_m, size_n, size_k, alpha,
    BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    COUNT_IO: tl.constexpr,
):
    """``C = alpha * A B`` on ``BLOCK x BLOCK`` tiles; counter roles
    :data:`~sparse_io_attn.dense.traffic.PRODUCT_TENSORS` (``a`` = A, ``b`` = B, ``c`` = C)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    off_z = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask_m = offs_m < size_m
    mask_n = offs_n < size_n
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    rd_a = tl.zeros([], dtype=tl.int64)
    rd_b = tl.zeros([], dtype=tl.int64)
    for k0 in range(0, size_k, BLOCK):
        offs_k = k0 + tl.arange(0, BLOCK)
        mask_k = offs_k < size_k
        mask_a = mask_m[:, None] & mask_k[None, :]
        mask_b = mask_k[:, None] & mask_n[None, :]
        a = tl.load(a_ptr + off_z * stride_az + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_a, other=0.0)  # [BLOCK, BLOCK]
        b = tl.load(b_ptr + off_z * stride_bz + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_b, other=0.0)  # [BLOCK, BLOCK]
        acc = dot(a, b, acc, DOT_DTYPE)  # [BLOCK, BLOCK]
        if COUNT_IO:
            rd_a += nbytes(mask_a, a_ptr)
            rd_b += nbytes(mask_b, b_ptr)
    _store_product(c_ptr + off_z * stride_cz + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc * alpha,
                   mask_m[:, None] & mask_n[None, :], rd_a, rd_b, io_ptr, COUNT_IO)


@triton.jit
def _softmax_kernel(
    s_ptr, a2_ptr, f_ptr, lse_ptr, io_ptr,
    stride_sz, stride_sm, stride_sd,
    stride_kz, stride_kn, stride_kd,
    stride_fz, stride_fm, stride_fn,
    seqlen, head_dim, sm_scale,
    BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr, WRITE_LSE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """Phase 1: ``f = softmax(scale * S A2^T)`` for one row block (and ``lse`` with ``WRITE_LSE``,
    contiguous fp32 ``[Z, n]``); counter slots :data:`~sparse_io_attn.dense.traffic.SOFTMAX_TENSORS`."""
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask_m = offs_m < seqlen
    s_base = s_ptr + off_z * stride_sz
    k_base = a2_ptr + off_z * stride_kz
    f_base = f_ptr + off_z * stride_fz
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    rd_s = tl.zeros([], dtype=tl.int64)
    rd_k = tl.zeros([], dtype=tl.int64)
    rd_f = tl.zeros([], dtype=tl.int64)
    wr_f = tl.zeros([], dtype=tl.int64)
    # lines 15-27: score tiles A[i, j] = scale * S[i, :] A2[j, :]^T, written to f; row max and sum
    for n0 in range(0, seqlen, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask_n = offs_n < seqlen
        acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
        for k0 in range(0, head_dim, BLOCK):
            offs_k = k0 + tl.arange(0, BLOCK)
            mask_k = offs_k < head_dim
            mask_s = mask_m[:, None] & mask_k[None, :]
            mask_a2 = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_base + offs_m[:, None] * stride_sm + offs_k[None, :] * stride_sd,
                        mask=mask_s, other=0.0)  # [BLOCK, BLOCK] tile S[i, k]
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_k[:, None] * stride_kd,
                         mask=mask_a2, other=0.0)  # [BLOCK, BLOCK] tile (A2^T)[k, j]
            acc = dot(s, kt, acc, DOT_DTYPE)  # [BLOCK, BLOCK]
            if COUNT_IO:
                rd_s += nbytes(mask_s, s_ptr)
                rd_k += nbytes(mask_a2, a2_ptr)
        scores = tl.where(mask_n[None, :], acc * sm_scale, float("-inf"))  # [BLOCK, BLOCK]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(scores - m_safe[:, None]), axis=1)
        m_i = m_new
        mask_f = mask_m[:, None] & mask_n[None, :]
        tl.store(f_base + offs_m[:, None] * stride_fm + offs_n[None, :] * stride_fn,
                 scores.to(f_ptr.dtype.element_ty), mask=mask_f)
        if COUNT_IO:
            wr_f += nbytes(mask_f, f_ptr)
    # lines 28-33: f[i, j] = diag(l_i)^-1 exp(A[i, j] - m_i)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for n0 in range(0, seqlen, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask_f = mask_m[:, None] & (offs_n[None, :] < seqlen)
        ptrs = f_base + offs_m[:, None] * stride_fm + offs_n[None, :] * stride_fn
        scores = tl.load(ptrs, mask=mask_f, other=float("-inf")).to(tl.float32)  # [BLOCK, BLOCK]
        f = tl.exp(scores - m_safe[:, None]) * inv_l[:, None]
        tl.store(ptrs, f.to(f_ptr.dtype.element_ty), mask=mask_f)
        if COUNT_IO:
            rd_f += nbytes(mask_f, f_ptr)
            wr_f += nbytes(mask_f, f_ptr)
    if WRITE_LSE:  # the forward's row statistic: lse_i = m_i + log(l_i)
        tl.store(lse_ptr + off_z * seqlen + offs_m, m_safe + tl.log(l_i), mask=mask_m)
    if COUNT_IO:
        io_add(io_ptr, SOFTMAX_S, rd_s, 0)
        io_add(io_ptr, SOFTMAX_A2, rd_k, 0)
        io_add(io_ptr, SOFTMAX_F, rd_f, wr_f)
        if WRITE_LSE:
            io_add(io_ptr, SOFTMAX_LSE, 0, nbytes(mask_m, lse_ptr))


@triton.jit
def _phase3_kernel(
    f_ptr, q_ptr, p_ptr, io_ptr,
    stride_z, stride_m, stride_n,
    seqlen,
    BLOCK: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """Phase 3: ``p = f o q - diag((f o q) 1) f`` for one row block (``f, q, p`` share strides);
    counter slots :data:`~sparse_io_attn.dense.traffic.PHASE3_TENSORS`."""
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask_m = offs_m < seqlen
    base = off_z * stride_z + offs_m[:, None] * stride_m
    v = tl.zeros([BLOCK], dtype=tl.float32)
    rd_f = tl.zeros([], dtype=tl.int64)
    rd_q = tl.zeros([], dtype=tl.int64)
    wr = tl.zeros([], dtype=tl.int64)
    # lines 5-9: v_i = (f o q)[i, :] 1
    for n0 in range(0, seqlen, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask = mask_m[:, None] & (offs_n[None, :] < seqlen)
        f = tl.load(f_ptr + base + offs_n[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + base + offs_n[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        v += tl.sum(f * q, axis=1)  # [BLOCK]
        if COUNT_IO:
            rd_f += nbytes(mask, f_ptr)
            rd_q += nbytes(mask, q_ptr)
    # lines 10-16: p[i, j] = f o q - diag(v_i) f
    for n0 in range(0, seqlen, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask = mask_m[:, None] & (offs_n[None, :] < seqlen)
        f = tl.load(f_ptr + base + offs_n[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + base + offs_n[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        p = f * q - v[:, None] * f  # [BLOCK, BLOCK]
        tl.store(p_ptr + base + offs_n[None, :] * stride_n, p.to(p_ptr.dtype.element_ty), mask=mask)
        if COUNT_IO:
            rd_f += nbytes(mask, f_ptr)
            rd_q += nbytes(mask, q_ptr)
            wr += nbytes(mask, p_ptr)
    if COUNT_IO:
        io_add(io_ptr, PHASE3_F, rd_f, 0)
        io_add(io_ptr, PHASE3_Q, rd_q, 0)
        io_add(io_ptr, PHASE3_P, 0, wr)
