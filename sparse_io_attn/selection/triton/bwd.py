"""Selection attention backward kernels (``@triton.jit`` only; the launcher is :mod:`.launch`).

Deterministic, no atomics on data:

* ``delta = rowsum(dO * O)``: the attention kit's preprocess kernel
  (:func:`~sparse_io_attn._attention.triton.kernels.attn_bwd_preprocess_kernel`).
* ``_sel_bwd_dkdv_kernel``: **key-major**, one program per (key tile of ``BLOCK_N`` keys inside key
  block ``c``, batch x KV head ``j``). For every selection serving the query heads of group ``j``
  it walks the key-major list of ``(l, c)`` (``plan.keys()``: the tokens that chose ``c``,
  ascending) in one flat loop of tiles of ``BLOCK_M`` gathered rows, row ``r`` = (token
  ``col_query[lo + r // SEL_ROWS]``, head ``r % SEL_ROWS`` of the selection's heads in the group;
  ``SEL_ROWS = next_pow2(SEL_HEADS)``, the rows past ``SEL_HEADS`` padding). dK, dV stay in
  registers and are written once. Only the list's first entries can see keys of the tile past
  their diagonal (entry ``e`` holds a token ``>= c * BLOCK_SIZE - delta + e``): the tiles holding
  the first ``last_key - c * BLOCK_SIZE`` entries apply the causal test (``MASKED``), the rest run
  without one; a key tile past the sequence end or the block end masks every tile. ``IS_VARLEN``: the
  block's keys from the plan's block table (unused slots empty: no work), and a list's tokens, all of one
  sequence, share the row offset of its first (the same edge argument from the block's first key).
* ``_sel_bwd_dq_kernel``: **query-major** like the forward (:mod:`.fwd`): one program per (query
  token, batch x head unit), the heads as the tile's rows, the row's blocks in key steps.

Probabilities are recomputed as the forward computed them, ``p = exp2((s - m) - log2_sum)`` from its
``stats`` (scores by the kit's :func:`~sparse_io_attn._attention.triton.softmax.score_tile`; the dK/dV
kernel transposes ``q @ k^T`` rather than forming ``k @ q^T``); empty and padded rows (``m = +inf``)
get ``p = 0``, hence zero gradients. ``COUNT_IO`` as in the forward.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import (dkdv_ds_step, dkdv_step, dq_step, load_stats, probabilities,
                                                      score_tile)
from sparse_io_attn._attention.triton.tally import tally_backward
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes, store_dkdv
from sparse_io_attn._triton.jit import LOG2E, dot, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.selection.triton.fwd import (_head_unit, _key_step, _row_bounds, _row_keys, _row_plan_reads,
                                                 _row_steps)
from sparse_io_attn.selection.triton.slots import DKDV_PARTIAL, DKDV_PLAN, DQ_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _gathered_rows(query_ptr, n, i, offs_r, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tile ``i`` of a key-major list (``n`` tokens at ``query_ptr``) as ``BLOCK_M`` gathered rows, row
    ``r`` = (entry ``e = r // SEL_ROWS``, head ``hh = r % SEL_ROWS`` of the unit): ``(e, hh, row_ok,
    tok)``, ``row_ok`` the rows of a listed token and a real head, ``tok`` the entries' tokens (0 past
    the list)."""
    r = i * BLOCK_M + offs_r  # [BLOCK_M] gathered rows
    e = r // SEL_ROWS  # the row's list entry
    hh = r % SEL_ROWS  # its head among the selection's heads in this group
    row_ok = e < n
    if SEL_ROWS != SEL_HEADS:
        row_ok = row_ok & (hh < SEL_HEADS)
    tok = tl.load(query_ptr + e, mask=e < n, other=0)  # [BLOCK_M] query tokens
    return e, hh, row_ok, tok


@triton.jit
def _row_inputs(q_ptr, do_ptr, q_rows, do_rows, offs_d, stride_qd, stride_dod, mask_r, mask_d, offs_dv, mask_dv,
                stats_ptr, stats_stride, delta_ptr, rows):
    """The backward's inputs of query rows at offsets ``q_rows`` / ``do_rows`` (from ``q_ptr`` / ``do_ptr``):
    ``q [rows, HEAD_DIM]``, ``do [rows, HEAD_DIM_V]`` (head-dim lanes ``offs_d`` / ``offs_dv``), and at the
    flat rows ``rows`` (``(b, h, t)``) the forward's row maximum and log2 sum and ``delta`` (padding rows:
    ``m = +inf``, so ``p = 0``)."""
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=mask_r[:, None] & mask_d[None, :],
                other=0.0)
    do = tl.load(do_ptr + do_rows[:, None] + offs_dv[None, :] * stride_dod, mask=mask_r[:, None] & mask_dv[None, :],
                 other=0.0)
    m_row, log2_sum = load_stats(stats_ptr, stats_stride, rows, mask_r)
    delta = tl.load(delta_ptr + rows, mask=mask_r, other=0.0)
    return q, do, m_row, log2_sum, delta


@triton.jit
def _sel_bwd_dkdv_step(dk, dv, k, v, q_base, do_base, row_base, query_ptr, slot_ptr, table_ptr, partial_ptr, split,
                       n, i, offs_r, offs_n, offs_d, mask_d, offs_dv, mask_dv, mask_n, stats_ptr, stats_stride,
                       delta_ptr, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, seqlen_q,
                       causal_offset, qk_scale,
                       SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                       KEY_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_DTYPE: tl.constexpr, STORE_DQ: tl.constexpr,
                       MASKED: tl.constexpr):
    """Gathered row tile ``i`` of one key-major list (``n`` tokens at ``query_ptr``; heads from
    ``q_base``/``do_base``/``row_base``). ``MASKED``: disallowed elements (past the diagonal, keys
    outside the tile) get ``p = 0``; otherwise every element of a real row is allowed (padding rows
    have ``m = +inf``, so ``p = 0``). ``STORE_DQ``: each row's ``dS @ k`` (unscaled, fp32) goes to
    ``partial[slot * KEY_TILES + split, row]`` (``slot``: the pair's slot in its row, at ``slot_ptr``;
    ``split``: this key tile of the block). ``IS_VARLEN``: ``causal_offset`` is where the table's row
    offsets start. Returns ``(dk, dv)``."""
    e, hh, row_ok, tok = _gathered_rows(query_ptr, n, i, offs_r, SEL_HEADS, SEL_ROWS, BLOCK_M)
    mask_md = row_ok[:, None] & mask_d[None, :]
    rows = row_base + hh.to(tl.int64) * seqlen_q + tok  # [BLOCK_M] rows of stats / delta
    q, do, m_row, log2_sum, delta = _row_inputs(q_base, do_base, hh * stride_qh + tok * stride_qm,
                                                hh * stride_doh + tok * stride_dom, offs_d, stride_qd, stride_dod,
                                                row_ok, mask_d, offs_dv, mask_dv, stats_ptr, stats_stride, delta_ptr,
                                                rows)
    if STORE_DQ:   # keys as every product's M (wgmma at 32-row tiles): the scores formed k @ q^T
        sT = score_tile(k, q, qk_scale, DOT_DTYPE)  # [BLOCK_N, BLOCK_M]
    else:
        sT = tl.trans(score_tile(q, k, qk_scale, DOT_DTYPE))  # [BLOCK_N, BLOCK_M]: as the forward rounds it
    if MASKED:
        valid = mask_n[:, None] & row_ok[None, :]  # [BLOCK_N, BLOCK_M]
        if IS_CAUSAL:
            if IS_VARLEN:  # (a list's tokens share one sequence: its first token's offset; read here, where used)
                causal_offset = tl.load(table_ptr + causal_offset + tl.load(query_ptr))
            valid = valid & (offs_n[:, None] <= tok[None, :] + causal_offset)
        sT = tl.where(valid, sT, float("-inf"))
    pT = probabilities(sT, m_row[None, :], log2_sum[None, :])  # [BLOCK_N, BLOCK_M]
    if STORE_DQ:
        dk, dv, dsT = dkdv_ds_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE)
        dqT = dot(tl.trans(k), dsT, None, DOT_DTYPE)  # [HEAD_DIM, BLOCK_M]
        slot = tl.load(slot_ptr + e, mask=e < n, other=0)  # [BLOCK_M]
        dst = (slot * KEY_TILES + split).to(tl.int64) * stats_stride + rows  # [BLOCK_M] partial rows
        tl.store(partial_ptr + dst[None, :] * HEAD_DIM + offs_d[:, None], dqT, mask=tl.trans(mask_md))
        return dk, dv
    return dkdv_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE)


@triton.jit
def _sel_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr, col_ptr_ptr, col_query_ptr, col_slot_ptr,
    table_ptr, partial_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, heads_per_selection, num_kv_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KEY_TILES: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_DTYPE: tl.constexpr, STORE_DQ: tl.constexpr,
    ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    pid_n = tl.program_id(0)  # (key block, key tile inside it)
    pid_zg = tl.program_id(1)  # batch x kv head
    blk = pid_n // KEY_TILES
    off_z = (pid_zg // num_heads_kv).to(tl.int64)
    off_g = (pid_zg % num_heads_kv).to(tl.int64)
    group = num_heads_q // num_heads_kv
    if IS_VARLEN:  # the block's keys [key_start, key_end) from the table (unused slots: empty at seqlen_k)
        key_start = tl.load(table_ptr + blk)
        key_end = tl.load(table_ptr + num_kv_blocks + blk)
    else:
        key_start = blk * BLOCK_SIZE
        key_end = tl.minimum(blk * BLOCK_SIZE + BLOCK_SIZE, seqlen_k)  # the block's keys: [key_start, key_end)
    n_start = key_start + (pid_n % KEY_TILES) * BLOCK_N
    live = n_start < key_end
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < key_end
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)

    k, v = load_row_pair(k_ptr + off_z * stride_kz + off_g * stride_kh, v_ptr + off_z * stride_vz + off_g * stride_vh,
                         offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn, stride_vd,
                         True, EVEN_D)  # [BLOCK_N, HEAD_DIM], [BLOCK_N, HEAD_DIM_V]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    # list entries e < n_edge may see keys of this tile past their diagonal (every tile is masked
    # when the key tile is ragged: past the block end or the sequence end)
    n_edge = tl.minimum(n_start + BLOCK_N, key_end) - 1 - key_start
    ragged = n_start + BLOCK_N > key_end
    entries = tl.zeros([], dtype=tl.int64)
    offset_reads = tl.zeros([], dtype=tl.int64)  # (IS_VARLEN, causal: masked tiles, each reads the row offset)

    for i in range(0, group // SEL_HEADS):  # the selections serving this group, SEL_HEADS heads each
        off_h = off_g * group + i * SEL_HEADS  # their first query head
        off_l = off_z * stride_lb + off_h // heads_per_selection
        col = off_l * (num_kv_blocks + 1) + blk
        lo = tl.load(col_ptr_ptr + col, mask=live, other=0)
        n = tl.load(col_ptr_ptr + col + 1, mask=live, other=0) - lo  # tokens that chose this block
        n_tiles = (n * SEL_ROWS + BLOCK_M - 1) // BLOCK_M
        if IS_CAUSAL:
            edge_rows = tl.maximum(tl.minimum(n, n_edge), 0) * SEL_ROWS
            n_masked = tl.where(ragged, n_tiles, (edge_rows + BLOCK_M - 1) // BLOCK_M)
        else:
            n_masked = tl.where(ragged, n_tiles, 0)
        delta_c = causal_offset
        if IS_VARLEN:  # a masked tile reads the row offset its list's tokens share at table_ptr + delta_c + tok0
            delta_c = 2 * num_kv_blocks
            if IS_CAUSAL and COUNT_IO:
                offset_reads += n_masked.to(tl.int64)
        q_base = q_ptr + off_z * stride_qz + off_h * stride_qh
        do_base = do_ptr + off_z * stride_doz + off_h * stride_doh
        row_base = (off_z * num_heads_q + off_h) * seqlen_q  # stats / delta are contiguous [.., B, Hq, Nq]

        # 1. the first entries (causal test) or a ragged key tile; 2. the rest: no mask
        for t in range(0, n_masked):
            dk, dv = _sel_bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, row_base, col_query_ptr + lo, col_slot_ptr + lo, table_ptr, partial_ptr,
                pid_n % KEY_TILES, n, t, offs_r, offs_n, offs_d, mask_d, offs_dv, mask_dv, mask_n, stats_ptr,
                stats_stride, delta_ptr, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, seqlen_q,
                delta_c, qk_scale, SEL_HEADS, SEL_ROWS, BLOCK_M, KEY_TILES, HEAD_DIM, IS_CAUSAL, IS_VARLEN, DOT_DTYPE,
                STORE_DQ, MASKED=True)
        for t in range(n_masked, n_tiles):
            dk, dv = _sel_bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, row_base, col_query_ptr + lo, col_slot_ptr + lo, table_ptr, partial_ptr,
                pid_n % KEY_TILES, n, t, offs_r, offs_n, offs_d, mask_d, offs_dv, mask_dv, mask_n, stats_ptr,
                stats_stride, delta_ptr, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, seqlen_q,
                delta_c, qk_scale, SEL_HEADS, SEL_ROWS, BLOCK_M, KEY_TILES, HEAD_DIM, IS_CAUSAL, IS_VARLEN, DOT_DTYPE,
                STORE_DQ, MASKED=False)
        if COUNT_IO:
            entries += n.to(tl.int64)

    store_dkdv(dk_ptr + off_z * stride_dkz + off_g * stride_dkh, dv_ptr + off_z * stride_dvz + off_g * stride_dvh,
               dk, dv, offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
               sm_scale)

    if COUNT_IO:
        per_entry: tl.constexpr = (SEL_ROWS // BLOCK_M if SEL_ROWS > BLOCK_M else 1) * (2 if STORE_DQ else 1)
        # (a tile inside one token's heads reads its entry once; with STORE_DQ its slot too)
        reads = tl.where(live, 2 * (group // SEL_HEADS), 0) + entries * per_entry
        if IS_VARLEN:  # the block's start and end; per masked tile (causal) its list's first token and its offset
            reads += 2 + 2 * offset_reads
        tally_backward(io_ptr, entries * SEL_HEADS, tl.sum(mask_n.to(tl.int64)), head_dim, head_dim_v, ELEM_BYTES,
                       DKDV=True)
        io_add(io_ptr, DKDV_PLAN, reads * 4, 0)
        if STORE_DQ:
            io_add(io_ptr, DKDV_PARTIAL, 0, entries * SEL_HEADS * head_dim * 4)


@triton.jit
def _sel_bwd_dq_step(dq, q, do, m_row, log2_sum, delta, k_base, v_base, row_ptr, cnt, s, query, offs_n, offs_d,
                     mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
                     qk_scale, keys_loaded, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr,
                     TILES: tl.constexpr, MASK_LANES: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, MASKED: tl.constexpr):
    """One key step of dQ (:func:`~.fwd._key_step`; keys outside ``valid`` get ``p = 0``).
    Returns ``(dq, keys_loaded)``."""
    k, v, valid, keys = _key_step(k_base, v_base, row_ptr, cnt, s, query, offs_n, offs_d, mask_d, offs_dv, mask_dv,
                                  stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
                                  BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, MASKED)
    sc = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_H, BLOCK_N]: as the forward rounds it
    if MASKED:
        sc = tl.where(valid[None, :], sc, float("-inf"))
        if COUNT_IO:
            keys_loaded += keys
    elif MASK_LANES:
        sc = tl.where(valid[None, :], sc, float("-inf"))
    p = probabilities(sc, m_row[:, None], log2_sum[:, None])  # [BLOCK_H, BLOCK_N]
    return dq_step(dq, p, do, k, v, delta, DOT_DTYPE), keys_loaded


@triton.jit
def _sel_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dq_ptr, rows_ptr, row_counts_ptr, table_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, heads_per_selection, max_blocks, num_kv_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOTS: tl.constexpr, TILES: tl.constexpr, MASK_LANES: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    t = tl.program_id(0)  # the query token
    off_z, offs_h, mask_h, off_l, off_hkv = _head_unit(tl.program_id(1), num_heads_q, num_heads_kv, stride_lb,
                                                       heads_per_selection, SEL_HEADS, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    mask_hd = mask_h[:, None] & mask_d[None, :]
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)
    t64 = t.to(tl.int64)

    rows_out = (off_z * num_heads_q + offs_h) * seqlen_q + t  # [BLOCK_H] rows of stats / delta
    q, do, m_row, log2_sum, delta = _row_inputs(
        q_ptr, do_ptr, off_z * stride_qz + offs_h * stride_qh + t64 * stride_qm,
        off_z * stride_doz + offs_h * stride_doh + t64 * stride_dom, offs_d, stride_qd, stride_dod, mask_h, mask_d,
        offs_dv, mask_dv, stats_ptr, stats_stride, delta_ptr,
        rows_out)  # [BLOCK_H, HEAD_DIM], [BLOCK_H, HEAD_DIM_V], [BLOCK_H] x3
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    cnt, row_ptr, n_steps, n_full = _row_steps(rows_ptr, row_counts_ptr, off_l * seqlen_q + t, max_blocks, SLOTS, TILES)
    k_base, v_base, shift = _row_keys(table_ptr, row_ptr, cnt, k_base, v_base, stride_kn, stride_vn, BLOCK_SIZE,
                                      IS_VARLEN)
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)

    # 1. whole blocks: no per-element test; 2. the last block's steps: padding, causality, count
    for s in range(0, n_full):
        dq, keys_loaded = _sel_bwd_dq_step(
            dq, q, do, m_row, log2_sum, delta, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale, keys_loaded,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=False)
    key_end, offset = _row_bounds(table_ptr, row_ptr, cnt, t, num_kv_blocks, shift, seqlen_k, causal_offset,
                                  IS_CAUSAL, IS_VARLEN)
    for s in range(n_full, n_steps):
        dq, keys_loaded = _sel_bwd_dq_step(
            dq, q, do, m_row, log2_sum, delta, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, key_end, offset, qk_scale, keys_loaded,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=True)

    tl.store(dq_ptr + off_z * stride_dqz + offs_h[:, None] * stride_dqh + t64 * stride_dqm
             + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_hd)

    if COUNT_IO:
        keys_loaded += (n_full // TILES).to(tl.int64) * SLOTS * BLOCK_SIZE
        tally_backward(io_ptr, tl.sum(mask_h.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, DKDV=False)
        io_add(io_ptr, DQ_PLAN, _row_plan_reads(cnt, TILES, IS_CAUSAL, IS_VARLEN) * 4, 0)
