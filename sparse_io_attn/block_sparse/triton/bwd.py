"""Block-sparse attention backward kernels (``@triton.jit`` only; the launcher is :mod:`.launch`).

FlashAttention-2 style and deterministic (no atomics on data):

* the preprocess ``delta = rowsum(dO * O)`` (fp32 ``[B, Hq, Nq]``) is the attention kit's
  (:func:`~sparse_io_attn._attention.triton.kernels.attn_bwd_preprocess_kernel`).
* ``_attn_bwd_dkdv_kernel``: one program per (key tile of ``BLOCK_N`` keys, batch x kv head). For
  every query head of the GQA group it walks the CSC schedule of its key block (partial query
  blocks, then full ones, each a flat loop over query tiles: ``BLOCK_M`` rows over full blocks,
  ``PART_M`` over partial ones: :func:`~sparse_io_attn.block_sparse.tiles.dkdv_part_rows`), so
  dK/dV are summed over the group inside one program. Every tile is formed key-major, ``[BLOCK_N,
  rows]``: the scores ``S^T = K Q^T`` directly (the transpose is on the loaded ``q`` tile, and every
  product has the key tile as its M, as in FlashAttention-2/3, FlexAttention and Triton's tutorial),
  or, with ``EXACT_SCORES``, the forward's ``Q K^T`` transposed (:func:`_scores_t`).
* ``_attn_bwd_dq_kernel``: one program per (query tile, batch x query head), walking the CSR
  schedule like the forward.

Partial tiles apply padding, the causal test and the element-mask bits (:func:`.fwd._tile_bits`);
full tiles run unmasked. Probabilities are recomputed as the forward computed them,
``p = exp2((s - m) - log2_sum)`` from its ``stats`` (row maximum and log2 row sum: exact even for
logits whose lse is too large to carry ``log2_sum``'s digits); empty and padded rows (``m = +inf``)
get ``p = 0``, hence zero gradients. ``COUNT_IO`` as in the forward.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import dkdv_step, dq_step, load_stats, probabilities, score_tile
from sparse_io_attn._attention.triton.tally import tally_backward
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes, store_dkdv
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.block_sparse.triton.fwd import _kv_tile, _list_range, _query_tile, _tile_bits
from sparse_io_attn.block_sparse.triton.slots import DKDV_LAYOUT, DKDV_MASK, DQ_LAYOUT, DQ_MASK

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scores_t(q, k, qk_scale, DOT_DTYPE: tl.constexpr, EXACT_SCORES: tl.constexpr):
    """The base-2 scores of a key tile ``k [BLOCK_N, HEAD_DIM]`` against a query tile ``q [BLOCK_M,
    HEAD_DIM]``, transposed: ``sT [BLOCK_N, BLOCK_M]``. ``EXACT_SCORES``: the forward's product ``q @
    k^T`` transposed, so the recomputed probabilities round exactly as the forward's (an fp32 tile
    transposed every step); else ``k @ q^T`` directly (the transpose is on the input tile ``q``, and
    every dK/dV product has the key tile as its M: Hopper's ``wgmma`` from ``BLOCK_N = 64``)."""
    if EXACT_SCORES:
        return tl.trans(score_tile(q, k, qk_scale, DOT_DTYPE))
    else:
        return score_tile(k, q, qk_scale, DOT_DTYPE)


@triton.jit
def _attn_bwd_dkdv_step(dk, dv, queries_loaded, mask_rows, k, v, q_base, do_base, stats_row, delta_row, idx_ptr,
                        mask_id_ptr, mask_ptr, t, offs_m0, offs_n, offs_d, mask_d, offs_dv, mask_dv, col_in_block,
                        n_start, stats_stride, stride_qm, stride_qd, stride_dom, stride_dod, seqlen_q,
                        causal_offset, qk_scale, BLOCK_SIZE_Q: tl.constexpr, MASK_WORDS: tl.constexpr,
                        BLOCK_M: tl.constexpr, TILES_M: tl.constexpr, EVEN_D: tl.constexpr,
                        IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, EXACT_SCORES: tl.constexpr,
                        COUNT_IO: tl.constexpr, MASKED: tl.constexpr):
    """One query tile of dK/dV: tile ``t % TILES_M`` of query block ``idx_ptr[t // TILES_M]``; scores
    ``[BLOCK_N, BLOCK_M]`` by :func:`_scores_t`. ``MASKED``: a partial block (query padding, the causal
    test, the element mask ``mask_id_ptr[t // TILES_M]``, all formed as ``[keys, queries]`` tiles;
    disallowed elements get ``p = 0``; queries and mask rows tallied); else a full block (every element
    allowed, every query in range and its row non-empty: no mask, no bounds checks). The loads come
    after the score product in program order, so the compiled loop reads the row statistics and mask
    words from shared memory only when they are used (fewer live registers beside dK/dV).
    Returns ``(dk, dv, queries_loaded, mask_rows)``."""
    blk = tl.load(idx_ptr + t // TILES_M)
    if MASKED:
        mask_id = tl.load(mask_id_ptr + t // TILES_M)
        m_start = blk * BLOCK_SIZE_Q + (t % TILES_M) * BLOCK_M
        offs_m = m_start + offs_m0
        live = m_start < seqlen_q
        if IS_CAUSAL:
            live = live & (tl.minimum(m_start + BLOCK_M, seqlen_q) - 1 + causal_offset >= n_start)
        mask_m = tl.where(live, offs_m < seqlen_q, False)
        q, do = load_row_pair(q_base, do_base, offs_m, mask_m, offs_d, mask_d, offs_dv, mask_dv, stride_qm, stride_qd,
                              stride_dom, stride_dod, True, EVEN_D)  # [BLOCK_M, HEAD_DIM], [BLOCK_M, HEAD_DIM_V]
        sT = _scores_t(q, k, qk_scale, DOT_DTYPE, EXACT_SCORES)  # [BLOCK_N, BLOCK_M]
        row_in_block = (t % TILES_M) * BLOCK_M + offs_m0
        validT = mask_m[None, :] & _tile_bits(mask_ptr, mask_id, row_in_block[None, :], col_in_block[:, None],
                                              mask_m[None, :], BLOCK_SIZE_Q, MASK_WORDS)  # [BLOCK_N, BLOCK_M]
        if IS_CAUSAL:
            validT = validT & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
        sT = tl.where(validT, sT, float("-inf"))
        m_row, log2_sum = load_stats(stats_row, stats_stride, offs_m, mask_m)  # [BLOCK_M] x2
        pT = probabilities(sT, m_row[None, :], log2_sum[None, :])  # [BLOCK_N, BLOCK_M]
        delta = tl.load(delta_row + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        if COUNT_IO:
            queries_loaded += tl.sum(mask_m.to(tl.int64))
            mask_rows += tl.where(mask_id >= 0, tl.sum(mask_m.to(tl.int64)), 0)
    else:
        m_start = tl.multiple_of(blk * BLOCK_SIZE_Q + (t % TILES_M) * BLOCK_M, BLOCK_M)
        offs_m = m_start + offs_m0
        q, do = load_row_pair(q_base, do_base, offs_m, None, offs_d, mask_d, offs_dv, mask_dv, stride_qm, stride_qd,
                              stride_dom, stride_dod, False, EVEN_D)  # [BLOCK_M, HEAD_DIM | HEAD_DIM_V], unchecked
        sT = _scores_t(q, k, qk_scale, DOT_DTYPE, EXACT_SCORES)  # [BLOCK_N, BLOCK_M]
        m_row = tl.load(stats_row + offs_m)  # [BLOCK_M], finite: the row keeps this block
        log2_sum = tl.load(stats_row + stats_stride + offs_m)
        pT = probabilities(sT, m_row[None, :], log2_sum[None, :])  # [BLOCK_N, BLOCK_M]
        delta = tl.load(delta_row + offs_m)
    dk, dv = dkdv_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE, DP_FIRST=True)
    return dk, dv, queries_loaded, mask_rows


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr,
    full_ptr_ptr, full_idx_ptr, part_ptr_ptr, part_idx_ptr, part_mask_ptr, mask_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, num_kv_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, EXACT_SCORES: tl.constexpr, PART_M: tl.constexpr,
    ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    TILES_M: tl.constexpr = BLOCK_SIZE_Q // BLOCK_M
    TILES_PART: tl.constexpr = BLOCK_SIZE_Q // PART_M
    pid_n = tl.program_id(0)
    pid_zg = tl.program_id(1)
    off_z = (pid_zg // num_heads_kv).to(tl.int64)
    off_g = (pid_zg % num_heads_kv).to(tl.int64)
    group = num_heads_q // num_heads_kv
    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_part0 = tl.arange(0, PART_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < seqlen_k
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)

    k, v = load_row_pair(k_ptr + off_z * stride_kz + off_g * stride_kh, v_ptr + off_z * stride_vz + off_g * stride_vh,
                         offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn, stride_vd,
                         True, EVEN_D)  # [BLOCK_N, HEAD_DIM], [BLOCK_N, HEAD_DIM_V]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    col_in_block = n_start % BLOCK_SIZE_KV + tl.arange(0, BLOCK_N)
    queries_loaded = tl.zeros([], dtype=tl.int64)
    index_entries = tl.zeros([], dtype=tl.int64)
    mask_rows = tl.zeros([], dtype=tl.int64)

    # the group's first query head; each head's rows of q, do and of stats / delta (contiguous [.., B, Hq, Nq])
    q_base = q_ptr + off_z * stride_qz + off_g * group * stride_qh
    do_base = do_ptr + off_z * stride_doz + off_g * group * stride_doh
    row_base = (off_z * num_heads_q + off_g * group) * seqlen_q
    stats_row = stats_ptr + row_base
    delta_row = delta_ptr + row_base
    entry = (off_z * stride_lb + off_g * group * stride_lh) * (num_kv_blocks + 1) + n_start // BLOCK_SIZE_KV
    for _ in range(0, group):
        part_start, part_end, full_start, full_end = _list_range(full_ptr_ptr, part_ptr_ptr, entry)

        # 1. partial blocks: padding, causal and element masks; 2. full blocks: no mask, no bounds checks
        for t in range(0, (part_end - part_start) * TILES_PART):
            dk, dv, queries_loaded, mask_rows = _attn_bwd_dkdv_step(
                dk, dv, queries_loaded, mask_rows, k, v, q_base, do_base, stats_row, delta_row,
                part_idx_ptr + part_start, part_mask_ptr + part_start, mask_ptr, t, offs_part0, offs_n, offs_d,
                mask_d, offs_dv, mask_dv, col_in_block, n_start, stats_stride, stride_qm, stride_qd, stride_dom,
                stride_dod, seqlen_q, causal_offset, qk_scale, BLOCK_SIZE_Q, MASK_WORDS, PART_M, TILES_PART, EVEN_D,
                IS_CAUSAL, DOT_DTYPE, EXACT_SCORES, COUNT_IO, MASKED=True)
        for t in range(0, (full_end - full_start) * TILES_M):
            dk, dv, queries_loaded, mask_rows = _attn_bwd_dkdv_step(
                dk, dv, queries_loaded, mask_rows, k, v, q_base, do_base, stats_row, delta_row,
                full_idx_ptr + full_start, part_mask_ptr, mask_ptr, t, offs_m0, offs_n, offs_d, mask_d, offs_dv,
                mask_dv, col_in_block, n_start, stats_stride, stride_qm, stride_qd, stride_dom, stride_dod, seqlen_q,
                causal_offset, qk_scale, BLOCK_SIZE_Q, MASK_WORDS, BLOCK_M, TILES_M, EVEN_D, IS_CAUSAL, DOT_DTYPE,
                EXACT_SCORES, COUNT_IO, MASKED=False)
        if COUNT_IO:
            queries_loaded += (full_end - full_start).to(tl.int64) * BLOCK_SIZE_Q
            index_entries += 4 + 2 * (part_end - part_start).to(tl.int64) * TILES_PART \
                + (full_end - full_start).to(tl.int64) * TILES_M
        q_base += stride_qh
        do_base += stride_doh
        stats_row += seqlen_q
        delta_row += seqlen_q
        entry += stride_lh * (num_kv_blocks + 1)

    store_dkdv(dk_ptr + off_z * stride_dkz + off_g * stride_dkh, dv_ptr + off_z * stride_dvz + off_g * stride_dvh,
               dk, dv, offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
               sm_scale)

    if COUNT_IO:
        tally_backward(io_ptr, queries_loaded, tl.sum(mask_n.to(tl.int64)), head_dim, head_dim_v, ELEM_BYTES,
                       DKDV=True)
        io_add(io_ptr, DKDV_LAYOUT, index_entries * 4, 0)
        io_add(io_ptr, DKDV_MASK, mask_rows * ((BLOCK_N + 31) // 32) * 4, 0)


@triton.jit
def _attn_bwd_dq_step(dq, keys_loaded, mask_rows, q, do, m_row, log2_sum, delta, k_base, v_base, idx_ptr,
                      mask_id_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv, row_in_block,
                      m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
                      BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILES_N: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of dQ (:func:`_kv_tile`; ``MASKED``: a partial block, whose disallowed elements
    get ``p = 0``). Returns ``(dq, keys_loaded, mask_rows)``."""
    k, v, valid, keys, tile_mask_rows = _kv_tile(
        k_base, v_base, idx_ptr, mask_id_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv,
        row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
        BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, MASKED)
    s = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_M, BLOCK_N]: as the forward rounds it
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
        if COUNT_IO:
            keys_loaded += keys
            mask_rows += tile_mask_rows
    p = probabilities(s, m_row[:, None], log2_sum[:, None])  # [BLOCK_M, BLOCK_N]
    dq = dq_step(dq, p, do, k, v, delta, DOT_DTYPE)
    return dq, keys_loaded, mask_rows


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dq_ptr,
    full_ptr_ptr, full_idx_ptr, part_ptr_ptr, part_idx_ptr, part_mask_ptr, mask_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, num_q_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr, MASK_WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    TILES_N: tl.constexpr = BLOCK_SIZE_KV // BLOCK_N
    pid_zh = tl.program_id(1)
    off_z, off_h, off_hkv, m_start, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv = _query_tile(
        tl.program_id(0), pid_zh, num_heads_q, num_heads_kv, seqlen_q, head_dim, head_dim_v, BLOCK_M, BLOCK_N, HEAD_DIM,
        HEAD_DIM_V, DV_IS_D)
    mask_md = mask_m[:, None] & mask_d[None, :]

    q, do = load_row_pair(q_ptr + off_z * stride_qz + off_h.to(tl.int64) * stride_qh,
                          do_ptr + off_z * stride_doz + off_h.to(tl.int64) * stride_doh, offs_m, mask_m, offs_d, mask_d,
                          offs_dv, mask_dv, stride_qm, stride_qd, stride_dom, stride_dod, True,
                          EVEN_D)  # [BLOCK_M, HEAD_DIM], [BLOCK_M, HEAD_DIM_V]
    row_base = pid_zh.to(tl.int64) * seqlen_q
    m_row, log2_sum = load_stats(stats_ptr, stats_stride, row_base + offs_m, mask_m)  # [BLOCK_M] x2
    delta = tl.load(delta_ptr + row_base + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    part_start, part_end, full_start, full_end = _list_range(
        full_ptr_ptr, part_ptr_ptr, (off_z * stride_lb + off_h * stride_lh) * (num_q_blocks + 1) + m_start // BLOCK_SIZE_Q)
    row_in_block = m_start % BLOCK_SIZE_Q + tl.arange(0, BLOCK_M)
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)
    mask_rows = tl.zeros([], dtype=tl.int64)

    # 1. partial blocks: padding, causal and element masks; 2. full blocks: no mask, no bounds checks
    for t in range(0, (part_end - part_start) * TILES_N):
        dq, keys_loaded, mask_rows = _attn_bwd_dq_step(
            dq, keys_loaded, mask_rows, q, do, m_row, log2_sum, delta, k_base, v_base, part_idx_ptr + part_start,
            part_mask_ptr + part_start, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv,
            row_in_block, m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=True)
    for t in range(0, (full_end - full_start) * TILES_N):
        dq, keys_loaded, mask_rows = _attn_bwd_dq_step(
            dq, keys_loaded, mask_rows, q, do, m_row, log2_sum, delta, k_base, v_base, full_idx_ptr + full_start,
            part_mask_ptr, mask_ptr, t, offs_m, offs_n, offs_d, mask_m, mask_d, offs_dv, mask_dv, row_in_block,
            m_last, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE_Q, BLOCK_SIZE_KV, MASK_WORDS, BLOCK_N, TILES_N, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO,
            MASKED=False)
    if COUNT_IO:
        keys_loaded += (full_end - full_start).to(tl.int64) * BLOCK_SIZE_KV

    tl.store(dq_ptr + off_z * stride_dqz + off_h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_md)

    if COUNT_IO:
        tally_backward(io_ptr, tl.sum(mask_m.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, DKDV=False)
        n_part = (part_end - part_start).to(tl.int64) * TILES_N
        n_full = (full_end - full_start).to(tl.int64) * TILES_N
        io_add(io_ptr, DQ_LAYOUT, (4 + 2 * n_part + n_full) * 4, 0)
        io_add(io_ptr, DQ_MASK, mask_rows * ((BLOCK_N + 31) // 32) * 4, 0)
