"""Triton kernels shared by the dense forward and the large-cache backward (``@triton.jit`` only).

* :func:`_proj_kernel`: ``C = alpha * A W`` for ``A [Z, n, d]`` and a weight ``W [d, d']`` shared by
  the batch (Algorithm 7: one program per row block ``A_i``, read once, times the column blocks of
  ``W`` read in turn). Transposed weights come in through strides.
* :func:`_atb_kernel`: ``C[z] = alpha * A[z]^T B[z]`` (``d x d'``, fp32), one program per column
  block of ``C``; it streams the rows of ``A`` and ``B``.
* :func:`_delta_kernel`: ``v = (O o dO) 1`` (fp32), FlashAttention-2's preprocessing.

Helpers of the kernels that read contiguous ``[Z, n, d]`` operands (the forward, the large-cache
backward): :func:`_program` (the program's block and batch element, the head-dim columns) and
:func:`_rows` (a block of rows: indices, masks, element offsets). :func:`_load_tile`: a masked tile
of a strided operand; :func:`_store_product`: a product kernel's last step (``C`` stored, its three
slots tallied).

Counting (``COUNT_IO``): each program tallies the bytes of every masked load/store (in-range
lanes only, :func:`~sparse_io_attn._triton.jit.nbytes`) and adds them at its end with
:func:`~sparse_io_attn._triton.jit.io_add`. Counter slots come from :mod:`.slots`, built from the
traffic model's ``PRODUCT_TENSORS`` (positions: a product's launcher names its own tensors, e.g.
``("A1", "X", "S")``) and ``DELTA_TENSORS``.
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import dot, io_add, nbytes

import triton
import triton.language as tl

from sparse_io_attn.dense.triton.slots import DELTA_DO, DELTA_O, DELTA_V, MATMUL_A, MATMUL_B, MATMUL_C


@triton.jit
def _program(seqlen, head_dim, HEAD_DIM: tl.constexpr):
    """This program's block (grid axis 0) and batch element ``z`` (axis 1, int64), the element where
    ``z``'s contiguous ``[n, d]`` operand starts, and the head-dim columns with their mask."""
    off_z = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.program_id(0), off_z, off_z * seqlen * head_dim, offs_d, offs_d < head_dim


@triton.jit
def _rows(base, start, BLOCK: tl.constexpr, seqlen, head_dim, offs_d, mask_d):
    """Rows ``[start, start + BLOCK)`` of a contiguous ``[n, d]`` operand starting at element
    ``base``: their indices, in-range mask, the tile's ``[BLOCK, HEAD_DIM]`` mask and its element
    offsets."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < seqlen
    return offs, mask, mask[:, None] & mask_d[None, :], base + offs[:, None] * head_dim + offs_d[None, :]


@triton.jit
def _load_tile(base, offs_r, n_r, stride_r, offs_c, n_c, stride_c):
    """The ``[len(offs_r), len(offs_c)]`` tile at ``base + r * stride_r + c * stride_c`` for rows
    ``r < n_r`` and columns ``c < n_c`` (zeros elsewhere), and that mask."""
    mask = (offs_r[:, None] < n_r) & (offs_c[None, :] < n_c)
    return tl.load(base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0), mask


@triton.jit
def _store_product(c_ptrs, c, mask_c, rd_a, rd_b, io_ptr, COUNT_IO: tl.constexpr):
    """A product kernel's last step: ``c`` stored (in ``C``'s dtype) where ``mask_c``, and with
    ``COUNT_IO`` the bytes of A and B read and of C written added to their slots."""
    tl.store(c_ptrs, c.to(c_ptrs.dtype.element_ty), mask=mask_c)
    if COUNT_IO:
        io_add(io_ptr, MATMUL_A, rd_a, 0)
        io_add(io_ptr, MATMUL_B, rd_b, 0)
        io_add(io_ptr, MATMUL_C, 0, nbytes(mask_c, c_ptrs))


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
    """``C = alpha * A W``; counter slots :data:`~sparse_io_attn.dense.traffic.PRODUCT_TENSORS`
    (``a`` = A, ``b`` = W, ``c`` = C)."""
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, HEAD_DIM)
    a, mask_a = _load_tile(a_ptr + off_z * stride_az, offs_m, seqlen, stride_am, offs_k, d_in,
                           stride_ad)  # [BLOCK_M, HEAD_DIM], read once (Algorithm 7, line 7)
    rd_w = tl.zeros([], dtype=tl.int64)
    wr_c = tl.zeros([], dtype=tl.int64)
    for c0 in range(0, d_out, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        w, mask_w = _load_tile(w_ptr, offs_k, d_in, stride_wk, offs_c, d_out, stride_wn)  # [HEAD_DIM, BLOCK_C]
        c = dot(a, w, None, DOT_DTYPE) * alpha  # [BLOCK_M, BLOCK_C]
        mask_c = (offs_m[:, None] < seqlen) & (offs_c[None, :] < d_out)
        tl.store(c_ptr + off_z * stride_cz + offs_m[:, None] * stride_cm + offs_c[None, :] * stride_cn,
                 c.to(c_ptr.dtype.element_ty), mask=mask_c)
        if COUNT_IO:
            rd_w += nbytes(mask_w, w_ptr)
            wr_c += nbytes(mask_c, c_ptr)
    if COUNT_IO:
        io_add(io_ptr, MATMUL_A, nbytes(mask_a, a_ptr), 0)
        io_add(io_ptr, MATMUL_B, rd_w, 0)
        io_add(io_ptr, MATMUL_C, 0, wr_c)


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
    """``C[z] = alpha * A[z]^T B[z]`` (fp32); counter slots
    :data:`~sparse_io_attn.dense.traffic.PRODUCT_TENSORS` (``a`` = A, ``b`` = B, ``c`` = C)."""
    pid_c = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, HEAD_DIM)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([HEAD_DIM, BLOCK_C], dtype=tl.float32)
    rd_a = tl.zeros([], dtype=tl.int64)
    rd_b = tl.zeros([], dtype=tl.int64)
    for m0 in range(0, seqlen, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        a, mask_a = _load_tile(a_ptr + off_z * stride_az, offs_m, seqlen, stride_am, offs_k, d_a,
                               stride_ad)  # [BLOCK_M, HEAD_DIM]
        b, mask_b = _load_tile(b_ptr + off_z * stride_bz, offs_m, seqlen, stride_bm, offs_c, d_b,
                               stride_bd)  # [BLOCK_M, BLOCK_C]
        acc = dot(tl.trans(a), b, acc, DOT_DTYPE)  # [HEAD_DIM, BLOCK_C]
        if COUNT_IO:
            rd_a += nbytes(mask_a, a_ptr)
            rd_b += nbytes(mask_b, b_ptr)
    _store_product(c_ptr + off_z * stride_cz + offs_k[:, None] * stride_ck + offs_c[None, :] * stride_cn, acc * alpha,
                   (offs_k[:, None] < d_a) & (offs_c[None, :] < d_b), rd_a, rd_b, io_ptr, COUNT_IO)


@triton.jit
def _delta_kernel(
    o_ptr, do_ptr, v_ptr, io_ptr,
    stride_oz, stride_om, stride_od,
    stride_dz, stride_dm, stride_dd,
    seqlen, head_dim,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """``v = (O o dO) 1`` (fp32 ``[Z, n]``); counter slots :data:`~sparse_io_attn.dense.traffic.DELTA_TENSORS`."""
    pid_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o, mask = _load_tile(o_ptr + off_z * stride_oz, offs_m, seqlen, stride_om, offs_d, head_dim,
                         stride_od)  # [BLOCK_M, HEAD_DIM]
    do, _ = _load_tile(do_ptr + off_z * stride_dz, offs_m, seqlen, stride_dm, offs_d, head_dim,
                       stride_dd)  # [BLOCK_M, HEAD_DIM]
    v = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # [BLOCK_M]
    mask_m = offs_m < seqlen
    tl.store(v_ptr + off_z * seqlen + offs_m, v, mask=mask_m)
    if COUNT_IO:
        io_add(io_ptr, DELTA_O, nbytes(mask, o_ptr), 0)
        io_add(io_ptr, DELTA_DO, nbytes(mask, do_ptr), 0)
        io_add(io_ptr, DELTA_V, 0, nbytes(mask_m, v_ptr))
