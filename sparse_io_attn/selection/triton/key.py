"""Key-major selection forward and merges (``@triton.jit`` only; the launcher is :mod:`.launch_families`): the
family ``"key"`` for blocks of 16 keys and more with few heads per selection (MoBA, NSA), after
MoBA's ``moba_efficient`` and FlashMoBA: the query tokens that chose a key block, gathered into
dense tiles, run against that block read once per tile.

* ``_key_fwd_kernel``: one program per tile of the plan's key-major lists (``work``: list ``(l, c)``
  and tile ``i``, :func:`~sparse_io_attn.selection.worklists.key_work`) and per batch x unit of
  ``SEL_HEADS`` heads (axis 1). Its ``BLOCK_M`` rows are ``BLOCK_M // SEL_ROWS`` tokens of the list x
  the unit's heads (:func:`.bwd._gathered_rows`); it walks block ``c`` in key tiles of ``BLOCK_N``
  (whole tiles that every row sees whole: no per-element test; the ragged tile at the sequence end and
  the tiles some row sees past its causal diagonal: masked) with the kit's online softmax, and writes
  each row's partial ``(m, l, acc)`` at ``partial[slot, row]`` (``slot``: the pair's slot in the row,
  from the key-major list). Programs past the last tile read their work entry and stop. ``IS_VARLEN``:
  the block's keys from the plan's block table, the causal offset the tile's tokens share (one sequence).
* ``_key_merge_kernel``: one program per ``BLOCK_R`` rows (flat ``(b, h, t)``): each row's
  ``row_counts`` partials merged in slot order (ascending block: the kit's
  :func:`~sparse_io_attn._attention.triton.kernels.merge_rows`), then ``o``, ``lse``, ``stats``; a
  row without a block gets ``o = 0``, ``lse = -inf``. Deterministic (no atomics on data).
* ``_key_dq_merge_kernel``: the backward's counterpart. The key-major dK/dV kernel
  (:func:`.bwd._sel_bwd_dkdv_kernel` with ``STORE_DQ``) writes each gathered row's ``dS @ k`` per key
  tile at its slot; this sums a row's slots in order (then their key tiles) into ``dq``.

With ``COUNT_IO`` each program tallies its bytes (model:
:func:`sparse_io_attn.selection.traffic_families.key_forward`).
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.kernels import merge_rows
from sparse_io_attn._attention.triton.softmax import score_tile, softmax_step, store_partial_rows
from sparse_io_attn._attention.triton.slots import MERGE_RESIDUAL
from sparse_io_attn._attention.triton.tally import tally_forward, tally_merge, tally_residual
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.selection.triton.bwd import _gathered_rows
from sparse_io_attn.selection.triton.slots import DEC_PLAN, DQM_DQ, DQM_PARTIAL, DQM_PLAN, MERGE_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _key_fwd_step(acc, l_i, m_i, q, k_base, v_base, tok, n_start, key_end, offs_n, offs_d, mask_d, offs_dv, mask_dv,
                  stride_kn, stride_kd, stride_vn, stride_vd, causal_offset, qk_scale, EVEN_D: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """Key tile ``[n_start, n_start + BLOCK_N)`` of the block against the gathered rows (tokens ``tok``).
    ``MASKED``: keys past ``key_end`` are not loaded and, with ``IS_CAUSAL``, keys past a row's diagonal
    get probability 0. Returns ``(acc, l_i, m_i)``."""
    cols = n_start + offs_n  # [BLOCK_N]
    mask_n = cols < key_end
    k, v = load_row_pair(k_base, v_base, cols, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd,
                         stride_vn, stride_vd, MASKED, EVEN_D)  # [BLOCK_N, HEAD_DIM | HEAD_DIM_V]
    s = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        valid = mask_n[None, :]
        if IS_CAUSAL:
            valid = valid & (cols[None, :] <= tok[:, None] + causal_offset)
        s = tl.where(valid, s, float("-inf"))
    return softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE, MAY_BE_EMPTY=MASKED)


@triton.jit
def _key_fwd_kernel(
    q_ptr, k_ptr, v_ptr, partial_ptr, work_ptr, col_ptr_ptr, col_query_ptr, col_slot_ptr, table_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    num_selections, heads_per_selection, units, num_kv_blocks, work_capacity, num_rows,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    BLOCK_T: tl.constexpr = BLOCK_M // SEL_ROWS  # tokens per tile
    p = tl.program_id(0)  # the tile
    zu = tl.program_id(1)  # batch x unit of the selection's heads
    lc = tl.load(work_ptr + p)
    live = lc >= 0
    lc = tl.maximum(lc, 0)
    i = tl.load(work_ptr + work_capacity + p, mask=live, other=0)
    off_l = lc // num_kv_blocks
    blk = lc % num_kv_blocks
    off_z = (off_l // num_selections + zu // units).to(tl.int64)  # (a stored selection of one batch, or shared)
    off_h = (off_l % num_selections) * heads_per_selection + (zu % units) * SEL_HEADS  # the unit's first head
    off_hkv = (off_h // (num_heads_q // num_heads_kv)).to(tl.int64)
    col = off_l * (num_kv_blocks + 1) + blk
    lo = tl.load(col_ptr_ptr + col, mask=live, other=0)
    n = tl.load(col_ptr_ptr + col + 1, mask=live, other=0) - lo  # tokens that chose block blk

    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)
    e, hh, row_ok, tok = _gathered_rows(col_query_ptr + lo, n, i, offs_r, SEL_HEADS, SEL_ROWS, BLOCK_M)
    slot = tl.load(col_slot_ptr + lo + e, mask=e < n, other=0)  # [BLOCK_M] the pairs' slots in their rows
    heads = (off_h + hh).to(tl.int64)  # [BLOCK_M]
    q = tl.load(q_ptr + off_z * stride_qz + heads[:, None] * stride_qh + tok[:, None].to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    # the block's keys [key_start, key_end): whole key tiles every row sees whole first, then the rest
    # (IS_VARLEN: from the block table; the list's tokens share one sequence, hence one causal offset)
    if IS_VARLEN:
        key_start = tl.load(table_ptr + blk, mask=live, other=0)
        key_end = tl.where(live, tl.load(table_ptr + num_kv_blocks + blk, mask=live, other=0), key_start)
    else:
        key_start = blk * BLOCK_SIZE
        key_end = tl.where(live, tl.minimum(key_start + BLOCK_SIZE, seqlen_k), key_start)
    n_tiles = (key_end - key_start + BLOCK_N - 1) // BLOCK_N
    n_plain = (key_end - key_start) // BLOCK_N
    if IS_CAUSAL:  # the tile's first token (the lowest: lists ascend) sees keys up to its diagonal
        first = tl.min(tl.where(row_ok, tok, seqlen_q))
        if IS_VARLEN:
            causal_offset = tl.load(table_ptr + 2 * num_kv_blocks + first, mask=live, other=0)
        n_plain = tl.minimum(n_plain, tl.maximum(first + causal_offset + 1 - key_start, 0) // BLOCK_N)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    for kt in range(0, n_plain):
        acc, l_i, m_i = _key_fwd_step(acc, l_i, m_i, q, k_base, v_base, tok, key_start + kt * BLOCK_N, key_end,
                                      offs_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn,
                                      stride_vd, causal_offset, qk_scale, EVEN_D, IS_CAUSAL, DOT_DTYPE, MASKED=False)
    for kt in range(n_plain, n_tiles):
        acc, l_i, m_i = _key_fwd_step(acc, l_i, m_i, q, k_base, v_base, tok, key_start + kt * BLOCK_N, key_end,
                                      offs_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn,
                                      stride_vd, causal_offset, qk_scale, EVEN_D, IS_CAUSAL, DOT_DTYPE, MASKED=True)
    rows_out = (off_z * num_heads_q + heads) * seqlen_q + tok  # [BLOCK_M] flat rows (b, h, t)
    store_partial_rows(partial_ptr, acc, l_i, m_i, slot, rows_out, offs_dv, row_ok, mask_dv, num_rows, HEAD_DIM_V)

    if COUNT_IO:
        tokens = tl.where(live, tl.minimum(n - i * BLOCK_T, BLOCK_T), 0).to(tl.int64)
        tally_forward(io_ptr, tl.sum(row_ok.to(tl.int64)), (key_end - key_start).to(tl.int64),
                      head_dim, head_dim_v, ELEM_BYTES, 2)
        table = (2 + (1 if IS_CAUSAL else 0)) if IS_VARLEN else 0  # block start, end (and the tokens' offset)
        io_add(io_ptr, DEC_PLAN, (1 + tl.where(live, 3 + table, 0) + 2 * tokens) * 4, 0)


@triton.jit
def _key_merge_kernel(
    partial_ptr, o_ptr, lse_ptr, stats_ptr, sinks_ptr, res_ptr, row_counts_ptr, io_ptr,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_lb, heads_per_selection, num_rows, seqlen_q, num_heads_q, head_dim,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, COUNT_IO: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (b, h, t)
    mask_r = rows < num_rows
    z = rows // (num_heads_q * seqlen_q)
    h = (rows // seqlen_q) % num_heads_q
    off_l = z * stride_lb + h // heads_per_selection
    counts = tl.load(row_counts_ptr + off_l * seqlen_q + rows % seqlen_q, mask=mask_r, other=0)  # [BLOCK_R]
    merge_rows(partial_ptr, o_ptr, lse_ptr, stats_ptr, rows, mask_r, counts, tl.max(counts), stride_oz, stride_oh,
               stride_om, stride_od, num_rows, seqlen_q, num_heads_q, head_dim, sinks_ptr, HEAD_DIM, HAS_SINKS, res_ptr,
               HAS_RESIDUAL)
    if COUNT_IO:
        n = tl.sum(mask_r.to(tl.int64))
        tally_merge(io_ptr, n, tl.sum(counts.to(tl.int64)), head_dim * ELEM_BYTES, head_dim)
        tally_residual(io_ptr, MERGE_RESIDUAL, n, head_dim * ELEM_BYTES, HAS_RESIDUAL)
        io_add(io_ptr, MERGE_PLAN, n * 4, 0)


@triton.jit
def _key_dq_merge_kernel(
    partial_ptr, dq_ptr, rows_ptr, row_counts_ptr, table_ptr, io_ptr,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, heads_per_selection, max_blocks, num_kv_blocks, num_rows, seqlen_q, seqlen_k, num_heads_q, head_dim,
    sm_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KEY_TILES: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr, IS_VARLEN: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per ``BLOCK_R`` rows (flat ``(b, h, t)``): ``dq = sm_scale * sum`` of the row's dQ
    partials ``partial [max_blocks * KEY_TILES, num_rows, HEAD_DIM]`` in slot order, each slot's key tiles in
    order (with several key tiles per block, a tile past the sequence end was not written: its block id
    decides, ``IS_VARLEN``: the block's start and end in the table)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < num_rows
    z = rows // (num_heads_q * seqlen_q)
    h = (rows // seqlen_q) % num_heads_q
    t = rows % seqlen_q
    row = (z * stride_lb + h // heads_per_selection) * seqlen_q + t  # the plan's row
    counts = tl.load(row_counts_ptr + row, mask=mask_r, other=0)  # [BLOCK_R]
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    dq = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    tiles = tl.zeros([], dtype=tl.int64)
    for j in tl.range(0, tl.max(counts), num_stages=2):   # (its own stages: the partial rows multi-buffered)
        ok = mask_r & (j < counts)
        if KEY_TILES > 1:
            blk = tl.load(rows_ptr + row.to(tl.int64) * max_blocks + j, mask=ok, other=0)
            if IS_VARLEN:
                n_keys = tl.load(table_ptr + num_kv_blocks + blk, mask=ok, other=0) - tl.load(table_ptr + blk,
                                                                                              mask=ok, other=0)
        for kt in tl.static_range(KEY_TILES):
            live = ok
            if KEY_TILES > 1:
                if IS_VARLEN:
                    live = live & (kt * BLOCK_N < n_keys)
                else:
                    live = live & (blk * BLOCK_SIZE + kt * BLOCK_N < seqlen_k)
            rows64 = rows.to(tl.int64)
            src = (rows64 * 0 + j * KEY_TILES + kt) * num_rows + rows64  # (int64 offsets)
            dq += tl.load(partial_ptr + src[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=live[:, None] & mask_d[None, :], other=0.0)
            if COUNT_IO:
                tiles += tl.sum(live.to(tl.int64))
    tl.store(dq_ptr + z.to(tl.int64)[:, None] * stride_dqz + h.to(tl.int64)[:, None] * stride_dqh
             + t[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_d[None, :])
    if COUNT_IO:
        n = tl.sum(mask_r.to(tl.int64))
        ids = tl.sum(counts.to(tl.int64)) * (3 if IS_VARLEN else 1) if KEY_TILES > 1 else 0  # (and start, end)
        io_add(io_ptr, DQM_PARTIAL, tiles * head_dim * 4, 0)
        io_add(io_ptr, DQM_PLAN, (n + ids) * 4, 0)
        io_add(io_ptr, DQM_DQ, 0, n * head_dim * ELEM_BYTES)
