"""The row-panel product kernel of the sparse operands, ``C = A B`` on block-sparse operands
(``@triton.jit`` only; shared helpers in :mod:`.common`, the launcher is :func:`.launch.matmul`):
``Q = A1 X`` and ``H = A3 Y`` in the forward, ``dA1 = dQ X^T``, ``dX = A1^T dQ``, ``dA3 = dH Y^T``,
``dY = A3^T dH`` in the backward (kernels ``paper_q``, ``paper_h``, ``paper_da1``, ``paper_dx``,
``paper_da3``, ``paper_dy`` of the I/O report).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import io_add, nbytes  # (sets TRITON_INTERPRET first)
from sparse_io_attn.sparse_operands.triton.common import (_acc_d_tiles, _d_ids, _entries, _group, _group_operand,
                                                          _load_d_tiles, _shared, _store_d_tiles, _tile_ptrs,
                                                          _zero_d_tiles)
from sparse_io_attn.sparse_operands.triton.slots import MATMUL_A, MATMUL_B, MATMUL_C, MATMUL_COLSUM, MATMUL_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _bsr_matmul_kernel(
    a_ptr, b_ptr, c_ptr, colsum_ptr, bmap_ptr, cmap_ptr, pair_ptr_ptr, pair_a_ptr, pair_k_ptr, plan_ids_ptr,
    a_nb, stride_a_ta, stride_a_tb, stride_a_r, stride_a_c, stride_a_gb, stride_a_gh,
    b_nb, stride_b_ta, stride_b_tb, stride_b_r, stride_b_c, stride_b_gb, stride_b_gh, stride_bmap_gb, stride_bmap_gh,
    c_nb, stride_c_ta, stride_c_tb, stride_c_r, stride_c_c, stride_c_gb, stride_c_gh, stride_cmap_gb, stride_cmap_gh,
    stride_colsum_blk, stride_colsum_g,
    size_m, size_k, size_n, num_rows, num_heads,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, NUM_N_TILES: tl.constexpr,
    WRITE_COLSUM: tl.constexpr, DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program per row block ``i`` of ``C = A B``, computing the whole row panel ``C[i, :]``
    (``NUM_N_TILES`` column tiles, one fp32 accumulator each): for each listed pair ``(A tile of
    (i, k), k)`` it loads the A tile once and, of the row panel ``B[k, :]``, only the tiles stored in
    both ``B[k, :]`` and ``C[i, :]``, and multiplies only those (absent column tiles: no load, no
    FLOPs). The panel is stored on ``C[i, :]``'s stored tiles. With ``WRITE_COLSUM`` it also writes
    the panel's column sums (fp32) to ``colsum[i, :]``. Counter slots: ``MATMUL_TENSORS`` (a, b, c,
    colsum, plan: pair lists, block-map rows and the group's plan id). Grid ``(row blocks, B * H)``:
    group ``(b, h)`` offsets every operand by its group strides (0 along an axis it is shared on) and
    reads its plan, part ``plan_ids[g]`` of the concatenated pair lists."""
    i = tl.program_id(0)
    zb, zh, g = _group(num_heads)
    a_ptr += zb * stride_a_gb + zh * stride_a_gh
    b_ptr, bmap_ptr = _group_operand(b_ptr, bmap_ptr, zb, zh, stride_b_gb, stride_b_gh, stride_bmap_gb, stride_bmap_gh)
    c_ptr, cmap_ptr = _group_operand(c_ptr, cmap_ptr, zb, zh, stride_c_gb, stride_c_gh, stride_cmap_gb, stride_cmap_gh)
    colsum_ptr += g.to(tl.int64) * stride_colsum_g
    pair_ptr_ptr += tl.load(plan_ids_ptr + g) * (num_rows + 1)
    start, end = _entries(pair_ptr_ptr, i)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = tl.arange(0, BLOCK_N)
    mask_m = i * BLOCK_M + offs_m < size_m
    c_ids = _d_ids(cmap_ptr, i, NUM_N_TILES)
    acc = _zero_d_tiles(BLOCK_M, BLOCK_N, NUM_N_TILES)  # tuple of [BLOCK_M, BLOCK_N]
    a_bytes = tl.zeros([], dtype=tl.int64)
    b_bytes = tl.zeros([], dtype=tl.int64)
    for p in tl.range(start, end, num_stages=LOOP_STAGES):
        ta = tl.load(pair_a_ptr + p)
        k = tl.load(pair_k_ptr + p)
        mask_k = k * BLOCK_K + offs_k < size_k
        mask_mk = mask_m[:, None] & mask_k[None, :]  # [BLOCK_M, BLOCK_K]
        b_ids = _d_ids(bmap_ptr, k, NUM_N_TILES)
        both = _shared(c_ids, b_ids, NUM_N_TILES)
        a = tl.load(_tile_ptrs(a_ptr, ta, offs_m, offs_k, a_nb, stride_a_ta, stride_a_tb, stride_a_r, stride_a_c),
                    mask=mask_mk, other=0.0)  # [BLOCK_M, BLOCK_K]
        b_tiles, b_read = _load_d_tiles(b_ptr, b_ids, both, offs_k, mask_k, b_nb, stride_b_ta, stride_b_tb, stride_b_r,
                                        stride_b_c, size_n, BLOCK_N, NUM_N_TILES)  # tuple of [BLOCK_K, BLOCK_N]
        acc = _acc_d_tiles(acc, a, b_tiles, both, DOT_DTYPE, NUM_N_TILES)
        if COUNT_IO:
            a_bytes += nbytes(mask_mk, a_ptr)
            b_bytes += b_read
    c_bytes = _store_d_tiles(c_ptr, c_ids, acc, offs_m, mask_m, c_nb, stride_c_ta, stride_c_tb, stride_c_r,
                             stride_c_c, size_n, BLOCK_N, NUM_N_TILES)
    colsum_bytes = tl.zeros([], dtype=tl.int64)
    if WRITE_COLSUM:  # column sums of the stored (rounded) values; rows outside the matrix are 0
        for t in tl.static_range(NUM_N_TILES):
            mask_n = offs_bn < tl.where(c_ids[t] >= 0, tl.minimum(BLOCK_N, size_n - t * BLOCK_N), 0)
            colsum = tl.sum(acc[t].to(c_ptr.dtype.element_ty).to(tl.float32), axis=0)  # [BLOCK_N]
            tl.store(colsum_ptr + i * stride_colsum_blk + t * BLOCK_N + offs_bn, colsum, mask=mask_n)
            colsum_bytes += nbytes(mask_n, colsum_ptr)
    if COUNT_IO:
        n_pairs = (end - start).to(tl.int64)
        io_add(io_ptr, MATMUL_A, a_bytes, 0)
        io_add(io_ptr, MATMUL_B, b_bytes, 0)
        io_add(io_ptr, MATMUL_C, 0, c_bytes)
        if WRITE_COLSUM:
            io_add(io_ptr, MATMUL_COLSUM, 0, colsum_bytes)
        io_add(io_ptr, MATMUL_PLAN, (1 + n_pairs) * 4 * NUM_N_TILES + (3 + 2 * n_pairs) * 4, 0)
