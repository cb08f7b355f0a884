"""Triton kernels shared by the dense forward and the large-cache backward (``@triton.jit`` only).

* :func:`_proj_kernel`: ``C = alpha * A W`` for ``A [Z, n, d]`` and a weight ``W [d, d']`` shared by
  the batch (Algorithm 7: one program per row block ``A_i``, read once, times the column blocks of
  ``W`` read in turn). Transposed weights come in through strides.
* :func:`_atb_kernel`: ``C[z] = alpha * A[z]^T B[z]`` (``d x d'``, fp32), one program per column
  block of ``C``; it streams the rows of ``A`` and ``B``.
* :func:`_delta_kernel`: ``v = (O o dO) 1`` (fp32), FlashAttention-2's preprocessing.

Counting (``COUNT_IO``): each program tallies the elements of every masked load/store (in-range
lanes only) times the element size and adds them with one ``tl.atomic_add`` per entry at its end;
``io_ptr`` is ``[tensors, 2]`` int64 (read, write) in the order the launcher names the tensors.
"""
from __future__ import annotations

from sparse_io_attn._triton.runtime import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """``a @ b`` with an fp32 result, operands cast to ``DOT_DTYPE``. ``tl.float32`` gives exact
    fp32 products (``input_precision="ieee"``, no tf32): used for fp32 inputs and under the
    interpreter, whose bf16 ``tl.dot`` is wrong; bf16/fp16 inputs on a GPU use their own dtype."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _nbytes(mask, ptr):
    """Bytes a masked 2-D load/store of ``mask`` through pointer ``ptr`` moves (int64 scalar)."""
    elem_bytes: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return tl.sum(tl.sum(mask.to(tl.int64), axis=1), axis=0) * elem_bytes


@triton.jit
def _nbytes1(mask, ptr):
    """:func:`_nbytes` for a 1-D mask."""
    elem_bytes: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return tl.sum(mask.to(tl.int64), axis=0) * elem_bytes


@triton.jit
def _io_add(io_ptr, slot: tl.constexpr, read, written):
    """Add one program's tally of tensor ``slot`` to the launch's counter (one atomic per entry)."""
    tl.atomic_add(io_ptr + 2 * slot, read)
    tl.atomic_add(io_ptr + 2 * slot + 1, written)


@triton.jit
def _proj_kernel(
    a_ptr, w_ptr, c_ptr, io_ptr,
    stride_az, stride_am, stride_ad,
    stride_wk, stride_wn,
    stride_cz, stride_cm, stride_cn,
    seqlen, d_in, d_out, alpha,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    # tensors: 0 = A (read), 1 = W (read), 2 = C (written)
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, HEAD_DIM)
    mask_a = (offs_m[:, None] < seqlen) & (offs_k[None, :] < d_in)
    a = tl.load(a_ptr + off_z * stride_az + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ad,
                mask=mask_a, other=0.0)  # [BLOCK_M, HEAD_DIM], read once (Algorithm 7, line 7)
    rd_w = tl.zeros([], dtype=tl.int64)
    wr_c = tl.zeros([], dtype=tl.int64)
    for c0 in range(0, d_out, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_w = (offs_k[:, None] < d_in) & (offs_c[None, :] < d_out)
        w = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_c[None, :] * stride_wn,
                    mask=mask_w, other=0.0)  # [HEAD_DIM, BLOCK_C]
        c = _mm(a, w, DOT_DTYPE) * alpha  # [BLOCK_M, BLOCK_C]
        mask_c = (offs_m[:, None] < seqlen) & (offs_c[None, :] < d_out)
        tl.store(c_ptr + off_z * stride_cz + offs_m[:, None] * stride_cm + offs_c[None, :] * stride_cn,
                 c.to(c_ptr.dtype.element_ty), mask=mask_c)
        if COUNT_IO:
            rd_w += _nbytes(mask_w, w_ptr)
            wr_c += _nbytes(mask_c, c_ptr)
    if COUNT_IO:
        _io_add(io_ptr, 0, _nbytes(mask_a, a_ptr), 0)
        _io_add(io_ptr, 1, rd_w, 0)
        _io_add(io_ptr, 2, 0, wr_c)


@triton.jit
def _atb_kernel(
    a_ptr, b_ptr, c_ptr, io_ptr,
    stride_az, stride_am, stride_ad,
    stride_bz, stride_bm, stride_bd,
    stride_cz, stride_ck, stride_cn,
    seqlen, d_a, d_b, alpha,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    # tensors: 0 = A (read), 1 = B (read), 2 = C (written, fp32 per batch element)
    pid_c = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, HEAD_DIM)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([HEAD_DIM, BLOCK_C], dtype=tl.float32)
    rd_a = tl.zeros([], dtype=tl.int64)
    rd_b = tl.zeros([], dtype=tl.int64)
    for m0 in range(0, seqlen, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_a = (offs_m[:, None] < seqlen) & (offs_k[None, :] < d_a)
        mask_b = (offs_m[:, None] < seqlen) & (offs_c[None, :] < d_b)
        a = tl.load(a_ptr + off_z * stride_az + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ad,
                    mask=mask_a, other=0.0)  # [BLOCK_M, HEAD_DIM]
        b = tl.load(b_ptr + off_z * stride_bz + offs_m[:, None] * stride_bm + offs_c[None, :] * stride_bd,
                    mask=mask_b, other=0.0)  # [BLOCK_M, BLOCK_C]
        acc += _mm(tl.trans(a), b, DOT_DTYPE)  # [HEAD_DIM, BLOCK_C]
        if COUNT_IO:
            rd_a += _nbytes(mask_a, a_ptr)
            rd_b += _nbytes(mask_b, b_ptr)
    mask_o = (offs_k[:, None] < d_a) & (offs_c[None, :] < d_b)
    tl.store(c_ptr + off_z * stride_cz + offs_k[:, None] * stride_ck + offs_c[None, :] * stride_cn,
             (acc * alpha).to(c_ptr.dtype.element_ty), mask=mask_o)
    if COUNT_IO:
        _io_add(io_ptr, 0, rd_a, 0)
        _io_add(io_ptr, 1, rd_b, 0)
        _io_add(io_ptr, 2, 0, _nbytes(mask_o, c_ptr))


@triton.jit
def _delta_kernel(
    o_ptr, do_ptr, v_ptr, io_ptr,
    stride_oz, stride_om, stride_od,
    stride_dz, stride_dm, stride_dd,
    seqlen, head_dim,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_IO: tl.constexpr,
):
    # tensors: 0 = O (read), 1 = dO (read), 2 = v (written, fp32 [Z, n])
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m[:, None] < seqlen) & (offs_d[None, :] < head_dim)
    o = tl.load(o_ptr + off_z * stride_oz + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, HEAD_DIM]
    do = tl.load(do_ptr + off_z * stride_dz + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                 mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, HEAD_DIM]
    v = tl.sum(o * do, axis=1)  # [BLOCK_M]
    mask_m = offs_m < seqlen
    tl.store(v_ptr + off_z * seqlen + offs_m, v, mask=mask_m)
    if COUNT_IO:
        _io_add(io_ptr, 0, _nbytes(mask, o_ptr), 0)
        _io_add(io_ptr, 1, _nbytes(mask, do_ptr), 0)
        _io_add(io_ptr, 2, 0, _nbytes1(mask_m, v_ptr))
