"""Selection decode kernel (``@triton.jit`` only; the launcher is :mod:`.launch`): one query token or
a few (``Nq <= 16``: decoding, speculative verification) against a long KV cache, split-K
(flash-decoding) over each token's selected blocks.

``_sel_decode_kernel``: one program per (batch x head unit x chunk of ``BLOCK_H`` heads x query
token, split ``s``): the forward's row program (:mod:`.fwd`: the ``SEL_HEADS`` query heads sharing
one selection and one KV head are the tile's rows) restricted to split ``s`` of the row's key steps.
The row's ``n_steps`` key steps (whole blocks unmasked, the last block's ``TILES`` steps masked,
exactly as the forward cuts them) are cut into ``NUM_SPLITS`` contiguous ranges ``[s * n / S,
(s + 1) * n / S)``; the program walks the unmasked and masked steps of its range with the forward's
step (:func:`.fwd._sel_fwd_step`: the same gathers, masks, scores and online softmax). Only the
plan's normalised rows are read (no key-major lists: nothing of size O(Nk)); K/V are read where they
live (any strides), only the selected keys.

With one split it writes ``o``, ``lse`` and ``stats`` like the forward; otherwise its partial row
results (``m``, ``l`` and the unnormalised ``acc``, fp32) go to the ``partial`` buffer
``[NUM_SPLITS, B * Hq * Nq, 2 + HEAD_DIM_V]`` and the attention kit's merge kernel
(:func:`sparse_io_attn._attention.triton.kernels.attn_decode_merge_kernel`: rows flat ``(b, h, t)``) merges each row's splits in split order (log-sum-exp), bitwise repeatable,
into ``o``, ``lse`` and the ``stats`` the backward kernels read.

With ``COUNT_IO`` each program tallies its bytes per tensor (the forward's convention: allowed keys
only, one plan entry per key step of a ``TILES``-step block, each gathered slot once, one row count
per program); the traffic model is :func:`sparse_io_attn.selection.traffic.selection_decode_forward`.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import store_split_rows
from sparse_io_attn._attention.triton.tally import tally_forward
from sparse_io_attn._attention.triton.tile_io import value_lanes
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.selection.triton.fwd import (_head_unit, _row_bounds, _row_keys, _row_plan_reads, _row_steps,
                                                 _sel_fwd_step)
from sparse_io_attn.selection.triton.slots import DEC_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _sel_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, partial_ptr, sinks_ptr, rows_ptr, row_counts_ptr, table_ptr,
    io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_lb, heads_per_selection, max_blocks, num_kv_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOTS: tl.constexpr, TILES: tl.constexpr, MASK_LANES: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT_IO: tl.constexpr,
):
    pid = tl.program_id(0)  # ((batch, head unit, chunk of BLOCK_H heads), query token)
    split = tl.program_id(1)
    t = pid % seqlen_q
    off_z, offs_h, mask_h, off_l, off_hkv = _head_unit(pid // seqlen_q, num_heads_q, num_heads_kv, stride_lb,
                                                       heads_per_selection, SEL_HEADS, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    mask_hd = mask_h[:, None] & mask_d[None, :]
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)

    q = tl.load(q_ptr + off_z * stride_qz + offs_h[:, None] * stride_qh + t.to(tl.int64) * stride_qm
                + offs_d[None, :] * stride_qd, mask=mask_hd, other=0.0)  # [BLOCK_H, HEAD_DIM]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    # the token's row of the plan, its key steps (unmasked [0, n_full), masked [n_full, n_steps)) and
    # this split's range [lo, hi) of them
    cnt, row_ptr, n_steps, n_full = _row_steps(rows_ptr, row_counts_ptr, off_l * seqlen_q + t, max_blocks, SLOTS, TILES)
    lo = (split * n_steps) // NUM_SPLITS
    hi = ((split + 1) * n_steps) // NUM_SPLITS
    k_base, v_base, shift = _row_keys(table_ptr, row_ptr, cnt, k_base, v_base, stride_kn, stride_vn, BLOCK_SIZE,
                                      IS_VARLEN)

    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_V], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)
    for s in range(lo, tl.minimum(hi, n_full)):
        acc, l_i, m_i, keys_loaded = _sel_fwd_step(
            acc, l_i, m_i, keys_loaded, q, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=False)
        if COUNT_IO:  # an unmasked step loads its slots' keys of tile s % TILES (whole blocks when SLOTS > 1)
            keys_loaded += SLOTS * tl.minimum(BLOCK_N, BLOCK_SIZE - (s % TILES) * BLOCK_N).to(tl.int64)
    key_end, delta = _row_bounds(table_ptr, row_ptr, cnt, t, num_kv_blocks, shift, seqlen_k, causal_offset, IS_CAUSAL,
                                 IS_VARLEN)
    for s in range(tl.maximum(lo, n_full), hi):
        acc, l_i, m_i, keys_loaded = _sel_fwd_step(
            acc, l_i, m_i, keys_loaded, q, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, key_end, delta, qk_scale,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=True)

    rows_out = (off_z * num_heads_q + offs_h) * seqlen_q + t  # [BLOCK_H] rows of lse / stats / partial
    store_split_rows(o_ptr, lse_ptr, stats_ptr, partial_ptr, acc, l_i, m_i, split, rows_out,
                     off_z * stride_oz + offs_h * stride_oh + t.to(tl.int64) * stride_om, offs_dv * stride_od,
                     offs_dv, mask_h, mask_dv, stats_stride, sinks_ptr, offs_h, HEAD_DIM_V, NUM_SPLITS, HAS_SINKS)

    if COUNT_IO:
        tally_forward(io_ptr, tl.sum(mask_h.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, NUM_SPLITS)
        entries = cnt * TILES  # the row's entries (a slot per step of a TILES-step block; slots once)
        taken = tl.minimum(hi * SLOTS, entries) - tl.minimum(lo * SLOTS, entries)
        io_add(io_ptr, DEC_PLAN, (_row_plan_reads(cnt, 0, IS_CAUSAL, IS_VARLEN) + taken.to(tl.int64)) * 4, 0)
