"""Block-sparse attention forward kernel (``@triton.jit`` only; the launcher is :mod:`.launch`).

One program per (query tile of ``BLOCK_M`` rows, batch x query head). It walks the schedule
(:mod:`sparse_io_attn.block_sparse.schedule`) of its layout row in two flat loops over key tiles
of ``BLOCK_N`` keys (``TILES_N = BLOCK_SIZE_KV // BLOCK_N`` tiles per kept block; the block index
comes from the list, the tile offset from the loop counter), so Triton's pipeliner can
multi-buffer the K/V loads:

1. **partial blocks**: key padding, the causal test ``j <= i + causal_offset`` and the block's
   element mask bits (:mod:`sparse_io_attn.layout._bits`) are applied; tiles with no allowed
   element for any row of the program (past ``seqlen_k`` or past the causal diagonal) are not
   loaded.
2. **full blocks**: no mask at all, aligned unmasked loads (``EVEN_D``: no head-dim mask either).

Online softmax in base 2 with ``sm_scale * LOG2E`` folded into one multiply; fp32 accumulators.
Writes ``o`` (input dtype), ``lse`` (fp32, natural log, ``-inf`` on rows with no allowed key,
whose output is 0) and ``stats`` (fp32 ``[2, rows]``: the base-2 row maximum ``m`` and ``log2`` of
the row sum, ``+inf``/``0`` on empty rows), from which backward recomputes ``P`` as here (the
attention kit's :mod:`~sparse_io_attn._attention.triton.softmax`). With ``COUNT_IO`` each program
tallies the bytes it moves per tensor and adds them once at its end (compiled out otherwise).

The prologue every row kernel shares (forward, dQ, decode: the program's query tile and its lists'
ranges) is :func:`_query_tile` and :func:`_list_range`.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import score_tile, softmax_step, store_rows
from sparse_io_attn._attention.triton.slots import OUT_RESIDUAL
from sparse_io_attn._attention.triton.tally import tally_forward, tally_residual
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.block_sparse.triton.slots import FWD_LAYOUT, FWD_MASK

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tile_bits(mask_ptr, mask_id, row_in_block, col_in_block, load_ok,
               BLOCK_SIZE_Q: tl.constexpr, MASK_WORDS: tl.constexpr):
    """Element-mask bits of a tile of a partial block (True where allowed); all True where the block
    has no element mask (``mask_id < 0``) or ``load_ok`` is False. ``row_in_block`` (query rows) and
    ``col_in_block`` (key columns) are 2-D and broadcast to the tile: ``[rows, 1]`` and ``[1, cols]``
    give a ``[rows, cols]`` tile, ``[1, rows]`` and ``[cols, 1]`` its transpose (dK/dV's ``[keys,
    queries]``), without transposing a tile."""
    words = tl.load(mask_ptr + mask_id.to(tl.int64) * (BLOCK_SIZE_Q * MASK_WORDS)
                    + row_in_block * MASK_WORDS + col_in_block // 32,
                    mask=tl.where(mask_id >= 0, load_ok, False), other=-1)  # int32, the tile's shape
    return ((words >> (col_in_block % 32)) & 1) != 0


@triton.jit
def _query_tile(pid_m, pid_zh, num_heads_q, num_heads_kv, seqlen_q, head_dim, head_dim_v,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                DV_IS_D: tl.constexpr):
    """The query tile of program ``(pid_m, pid_zh = batch x query head)``: ``(off_z, off_h, off_hkv,
    m_start, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv)`` (the KV head of the GQA group; key
    lanes ``offs_n`` of a tile, head-dim lanes ``offs_d`` of Q/K and ``offs_dv`` of V)."""
    off_z = (pid_zh // num_heads_q).to(tl.int64)
    off_h = pid_zh % num_heads_q
    off_hkv = (off_h // (num_heads_q // num_heads_kv)).to(tl.int64)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)
    return (off_z, off_h, off_hkv, m_start, offs_m, tl.arange(0, BLOCK_N), offs_d, offs_m < seqlen_q, mask_d,
            offs_dv, mask_dv)


@triton.jit
def _list_range(full_ptr_ptr, part_ptr_ptr, entry):
    """``(part_start, part_end, full_start, full_end)``: the partial and full lists' ranges of one CSR
    row (or CSC column) ``entry`` of the schedule."""
    return (tl.load(part_ptr_ptr + entry), tl.load(part_ptr_ptr + entry + 1), tl.load(full_ptr_ptr + entry),
            tl.load(full_ptr_ptr + entry + 1))


@triton.jit
def _kv_tile(k_base, v_base, idx_ptr, mask_id_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv,
             mask_dv, row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
             BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
             BLOCK_N: tl.constexpr, TILES_N: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
             MASKED: tl.constexpr):
    """``(k, v, valid, keys, mask_rows)`` of key tile ``t % TILES_N`` of block ``idx_ptr[t // TILES_N]``
    for the query rows ``offs_m`` (forward and dQ). ``MASKED`` (a partial block): ``valid``
    ``[BLOCK_M, BLOCK_N]`` marks the allowed elements (key padding, the causal test, the element mask
    ``mask_id_ptr[t // TILES_N]``), ``keys`` counts the keys loaded and ``mask_rows`` the query rows
    that read mask bits. Otherwise (a full block: every element allowed, every key in range) the loads
    have no bounds checks, ``valid``, ``keys`` and ``mask_rows`` are 0 (the caller counts whole blocks)."""
    blk = tl.load(idx_ptr + t // TILES_N)
    if MASKED:
        mask_id = tl.load(mask_id_ptr + t // TILES_N)
        col_in_block = (t % TILES_N) * BLOCK_N + offs_n
        n_start = blk * BLOCK_SIZE_KV + (t % TILES_N) * BLOCK_N
        cols = n_start + offs_n
        live = n_start < seqlen_k
        if IS_CAUSAL:
            live = live & (n_start <= m_last + causal_offset)
        mask_n = tl.where(live, cols < seqlen_k, False)  # (scalar & vector: tl.where, for the interpreter)
        k, v = load_row_pair(k_base, v_base, cols, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd,
                             stride_vn, stride_vd, True, EVEN_D)  # [BLOCK_N, HEAD_DIM], [BLOCK_N, HEAD_DIM_V]
        valid = mask_n[None, :] & _tile_bits(mask_ptr, mask_id, row_in_block[:, None], col_in_block[None, :],
                                             tl.where(live, mask_m[:, None], False), BLOCK_SIZE_Q, MASK_WORDS)
        if IS_CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + causal_offset)  # [BLOCK_M, BLOCK_N]
        keys = tl.sum(mask_n.to(tl.int64))
        mask_rows = tl.where(live & (mask_id >= 0), tl.sum(mask_m.to(tl.int64)), 0)
    else:
        n_start = tl.multiple_of(blk * BLOCK_SIZE_KV + (t % TILES_N) * BLOCK_N, BLOCK_N)
        cols = n_start + offs_n
        k, v = load_row_pair(k_base, v_base, cols, None, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd,
                             stride_vn, stride_vd, False, EVEN_D)  # [BLOCK_N, HEAD_DIM | HEAD_DIM_V], no bounds checks
        valid = 0
        keys = 0
        mask_rows = 0
    return k, v, valid, keys, mask_rows


@triton.jit
def _attn_fwd_step(acc, l_i, m_i, keys_loaded, mask_rows, q, k_base, v_base, idx_ptr, mask_id_ptr, mask_ptr, t,
                   offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv, row_in_block, m_last,
                   stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
                   BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
                   BLOCK_N: tl.constexpr, TILES_N: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax (:func:`_kv_tile`; ``MASKED``: a partial block, whose
    disallowed elements get probability 0 and whose rows may have nothing allowed yet, kept at a
    finite shift). Returns ``(acc, l_i, m_i, keys_loaded, mask_rows)``."""
    k, v, valid, keys, tile_mask_rows = _kv_tile(
        k_base, v_base, idx_ptr, mask_id_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv,
        row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
        BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, MASKED)
    s = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
        if COUNT_IO:
            keys_loaded += keys
            mask_rows += tile_mask_rows
    acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE, MAY_BE_EMPTY=MASKED)
    return acc, l_i, m_i, keys_loaded, mask_rows


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, sinks_ptr, res_ptr,
    full_ptr_ptr, full_idx_ptr, part_ptr_ptr, part_idx_ptr, part_mask_ptr, mask_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, num_q_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, COUNT_IO: tl.constexpr,
):
    TILES_N: tl.constexpr = BLOCK_SIZE_KV // BLOCK_N
    pid_zh = tl.program_id(1)
    off_z, off_h, off_hkv, m_start, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv = _query_tile(
        tl.program_id(0), pid_zh, num_heads_q, num_heads_kv, seqlen_q, head_dim, head_dim_v, BLOCK_M, BLOCK_N, HEAD_DIM,
        HEAD_DIM_V, DV_IS_D)

    q = tl.load(q_ptr + off_z * stride_qz + off_h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    # this tile's row of the schedule (absolute offsets into the lists)
    part_start, part_end, full_start, full_end = _list_range(
        full_ptr_ptr, part_ptr_ptr, (off_z * stride_lb + off_h * stride_lh) * (num_q_blocks + 1) + m_start // BLOCK_SIZE_Q)
    row_in_block = m_start % BLOCK_SIZE_Q + tl.arange(0, BLOCK_M)
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1   # last real query row of the tile

    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)
    mask_rows = tl.zeros([], dtype=tl.int64)

    # 1. partial blocks: padding, causal and element masks; 2. full blocks: no mask, no bounds checks
    for t in range(0, (part_end - part_start) * TILES_N):
        acc, l_i, m_i, keys_loaded, mask_rows = _attn_fwd_step(
            acc, l_i, m_i, keys_loaded, mask_rows, q, k_base, v_base, part_idx_ptr + part_start,
            part_mask_ptr + part_start, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv,
            row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=True)
    for t in range(0, (full_end - full_start) * TILES_N):
        acc, l_i, m_i, keys_loaded, mask_rows = _attn_fwd_step(
            acc, l_i, m_i, keys_loaded, mask_rows, q, k_base, v_base, full_idx_ptr + full_start,
            part_mask_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv, row_in_block,
            m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=False)
    if COUNT_IO:
        keys_loaded += (full_end - full_start).to(tl.int64) * BLOCK_SIZE_KV

    store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, pid_zh.to(tl.int64) * seqlen_q + offs_m,
               off_z * stride_oz + off_h.to(tl.int64) * stride_oh + offs_m * stride_om, offs_dv * stride_od,
               mask_m, mask_dv, stats_stride, sinks_ptr, off_h + offs_m * 0, HAS_SINKS, res_ptr, HAS_RESIDUAL)

    if COUNT_IO:
        tally_forward(io_ptr, tl.sum(mask_m.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, 1)
        tally_residual(io_ptr, OUT_RESIDUAL, tl.sum(mask_m.to(tl.int64)), head_dim_v * ELEM_BYTES, HAS_RESIDUAL)
        n_part = (part_end - part_start).to(tl.int64) * TILES_N
        n_full = (full_end - full_start).to(tl.int64) * TILES_N
        io_add(io_ptr, FWD_LAYOUT, (4 + 2 * n_part + n_full) * 4, 0)
        io_add(io_ptr, FWD_MASK, mask_rows * ((BLOCK_N + 31) // 32) * 4, 0)
