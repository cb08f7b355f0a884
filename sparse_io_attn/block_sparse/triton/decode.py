"""Block-sparse decode kernels (``@triton.jit`` only; the launcher is :mod:`.launch`): one query
token or a few (``Nq <= 16``: decoding, speculative verification) against a long KV cache,
split-K (flash-decoding) over the kept blocks of the decoded rows.

``_attn_decode_kernel``: one program per (split ``s``, batch x head group x query block). Its rows
are ``HEADS`` query heads (a GQA group whose heads share one list, or one head) times the
``TOKENS`` rows of the query block, one ``[BLOCK_M, HEAD_DIM]`` query tile that shares every K/V tile.
The row's items (key tiles of ``BLOCK_N`` keys of its kept blocks: partial blocks first, then full
ones, as the forward walks them) are cut into ``NUM_SPLITS`` contiguous ranges; the program walks
the partial and full items of range ``s`` with the forward's step (:func:`.fwd._attn_fwd_step`:
the same masks, scores and online softmax). With one split it writes ``o``, ``lse`` and ``stats``
like the forward; otherwise its partial row results (``m``, ``l`` and the unnormalised ``acc``, fp32)
go to the ``partial`` buffer and the attention kit's merge kernel
(:func:`~sparse_io_attn._attention.triton.kernels.attn_decode_merge_kernel`) merges each row's
splits in split order (log-sum-exp), then writes ``o``, ``lse``, ``stats``. K/V are read where they live (any
strides): nothing outside the kept blocks is touched.

With ``COUNT_IO`` each program tallies the bytes it moves per tensor (the forward's convention;
the traffic model is :func:`sparse_io_attn.block_sparse.traffic.block_sparse_decode_forward`).
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import store_split_rows
from sparse_io_attn._attention.triton.tally import tally_forward
from sparse_io_attn._attention.triton.tile_io import value_lanes
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.block_sparse.triton.fwd import _attn_fwd_step, _list_range
from sparse_io_attn.block_sparse.triton.slots import DEC_LAYOUT, DEC_MASK

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _attn_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, partial_ptr, sinks_ptr,
    full_ptr_ptr, full_idx_ptr, part_ptr_ptr, part_idx_ptr, part_mask_ptr, mask_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, num_q_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
    HEADS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT_IO: tl.constexpr,
):
    TILES_N: tl.constexpr = BLOCK_SIZE_KV // BLOCK_N
    split = tl.program_id(0)
    pid = tl.program_id(1)
    r = pid % num_q_blocks                                  # query block
    zg = pid // num_q_blocks
    groups = num_heads_q // HEADS
    off_z = (zg // groups).to(tl.int64)
    h0 = (zg % groups) * HEADS                              # first query head of the program
    off_hkv = (h0 // (num_heads_q // num_heads_kv)).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    head = h0 + offs_r // TOKENS                            # [BLOCK_M]: row i is head h0 + i // TOKENS,
    row_in_block = offs_r % TOKENS                          # token r * BLOCK_SIZE_Q + i % TOKENS
    offs_m = r * BLOCK_SIZE_Q + row_in_block
    mask_m = (offs_r // TOKENS < HEADS) & (row_in_block < BLOCK_SIZE_Q) & (offs_m < seqlen_q)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)

    q = tl.load(q_ptr + off_z * stride_qz + head.to(tl.int64)[:, None] * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    # the program's list row, and its items: partial tiles [0, P), full tiles [P, T); split s takes [lo, hi)
    part_start, part_end, full_start, full_end = _list_range(
        full_ptr_ptr, part_ptr_ptr, (off_z * stride_lb + h0 * stride_lh) * (num_q_blocks + 1) + r)
    n_part = (part_end - part_start) * TILES_N
    n_items = n_part + (full_end - full_start) * TILES_N
    lo = (split * n_items) // NUM_SPLITS
    hi = ((split + 1) * n_items) // NUM_SPLITS
    part_hi = tl.minimum(hi, n_part)
    full_lo = tl.maximum(lo, n_part) - n_part
    full_hi = tl.maximum(hi, n_part) - n_part
    m_last = tl.minimum(r * BLOCK_SIZE_Q + BLOCK_SIZE_Q, seqlen_q) - 1   # last query token of the block

    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)
    mask_rows = tl.zeros([], dtype=tl.int64)
    for t in range(lo, part_hi):
        acc, l_i, m_i, keys_loaded, mask_rows = _attn_fwd_step(
            acc, l_i, m_i, keys_loaded, mask_rows, q, k_base, v_base, part_idx_ptr + part_start,
            part_mask_ptr + part_start, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv,
            row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=True)
    for t in range(full_lo, full_hi):
        acc, l_i, m_i, keys_loaded, mask_rows = _attn_fwd_step(
            acc, l_i, m_i, keys_loaded, mask_rows, q, k_base, v_base, full_idx_ptr + full_start,
            part_mask_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv, row_in_block,
            m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=False)

    rows_out = (off_z * num_heads_q + head) * seqlen_q + offs_m      # [BLOCK_M]: the rows' flat index
    store_split_rows(o_ptr, lse_ptr, stats_ptr, partial_ptr, acc, l_i, m_i, split, rows_out,
                     off_z * stride_oz + head.to(tl.int64) * stride_oh + offs_m * stride_om, offs_dv * stride_od,
                     offs_dv, mask_m, mask_dv, stats_stride, sinks_ptr, head + offs_m * 0, HEAD_DIM_V, NUM_SPLITS,
                     HAS_SINKS)

    if COUNT_IO:
        keys_loaded += (full_hi - full_lo).to(tl.int64) * BLOCK_N
        tally_forward(io_ptr, tl.sum(mask_m.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, NUM_SPLITS)
        n_tiles = (part_hi - lo).to(tl.int64)
        n_tiles = tl.where(n_tiles > 0, n_tiles, 0)
        io_add(io_ptr, DEC_LAYOUT, (4 + 2 * n_tiles + (full_hi - full_lo)) * 4, 0)
        io_add(io_ptr, DEC_MASK, mask_rows * ((BLOCK_N + 31) // 32) * 4, 0)
