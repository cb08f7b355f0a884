"""Element-masked selection kernels (``@triton.jit`` only; the launcher is :mod:`.launch_families`): the
family ``"masked"`` for blocks smaller than a tile (single tokens: DeepSeek Sparse Attention) with few
heads per selection. A tile's rows are ``BLOCK_T`` consecutive query tokens x the ``SEL_HEADS`` heads of
one unit (sharing the selection and a KV head; ``SEL_ROWS`` rows per token, the rows past the unit's
heads padding); its keys are the tiles of 64 consecutive keys holding a key the tile's tokens selected
(:func:`~sparse_io_attn.selection.worklists.masked_tiles`), each with one int64 word of bits per token
(selected, inside the keys and, causal, at or before the diagonal: the only mask the kernels apply) and
one word of their union: only the union's keys are loaded (a key no token selected is never read).

* ``_masked_rows_kernel``: one program per (query tile, batch x unit): the tile's key tiles ascending;
  the forward (the kit's online softmax; writes ``o``, ``lse``, ``stats``) or, with ``DQ``, dQ (the
  kit's dQ step) on the same walk.
* ``_masked_dkdv_kernel``: one program per (key tile, batch x KV head): for every selection serving the
  group, the query tiles holding a bit of this key tile (the transposed lists), ``SUB_M`` rows at a time
  (one flat loop, each step re-reading its list entry) with the keys as every product's M (``S^T = K Q^T``: tensor-core products at head dim 128 without
  spills), the kit's dK/dV step; ``dk``, ``dv`` written once.

Probabilities are recomputed from the forward's ``stats`` (the kit's ``probabilities``, never above 1). Deterministic, no atomics on data. With ``COUNT_IO`` each program tallies its
bytes (model: :func:`sparse_io_attn.selection.traffic_families.masked_forward` / ``masked_backward``):
rows, the union's keys per key tile, list entries (int32), one bit word per token and key tile and the
union words (int64). Packed sequences need nothing here: the bits' builders read the block table.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.slots import DKDV_DK, DKDV_DV, OUT_RESIDUAL
from sparse_io_attn._attention.triton.softmax import (dkdv_step, dq_step, probabilities, score_tile, softmax_step,
                                                      store_rows)
from sparse_io_attn._attention.triton.tally import tally_backward, tally_forward, tally_residual
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes, store_dkdv
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.selection.triton.bwd import _row_inputs
from sparse_io_attn.selection.triton.fwd import _unit
from sparse_io_attn.selection.triton.slots import DKDV_PLAN, DQ_PLAN, FWD_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tile_rows(qt, seqlen_q, first, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
               ROWS: tl.constexpr):
    """Rows ``[first, first + ROWS)`` of query tile ``qt`` (``BLOCK_M`` rows): ``(tok, hh, row_ok, tokens)``:
    row ``r`` is token ``qt * BLOCK_T + r // SEL_ROWS``, head ``r % SEL_ROWS`` of the unit; ``row_ok`` real
    tokens and heads; ``tokens`` those rows' tokens inside the sequence."""
    BLOCK_T: tl.constexpr = BLOCK_M // SEL_ROWS
    r = first + tl.arange(0, ROWS)
    tok = qt * BLOCK_T + r // SEL_ROWS  # [ROWS]
    hh = r % SEL_ROWS
    row_ok = (tok < seqlen_q) & (hh < SEL_HEADS)
    tokens = tl.maximum(tl.minimum(seqlen_q - qt * BLOCK_T - first // SEL_ROWS, ROWS // SEL_ROWS), 0).to(tl.int64)
    return tok, hh, row_ok, tokens


@triton.jit
def _key_tile(k_base, v_base, kt, union, offs_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn,
              stride_vd, BLOCK_N: tl.constexpr):
    """``(k, v, keys)``: the keys of key tile ``kt`` set in ``union`` (an int64 word: those some row of the
    tile selected; the others are not loaded, 0) as ``[BLOCK_N, HEAD_DIM]`` and ``[BLOCK_N, HEAD_DIM_V]``
    tiles, and how many."""
    mask_n = ((union >> offs_n.to(tl.int64)) & 1) != 0
    k, v = load_row_pair(k_base, v_base, kt * BLOCK_N + offs_n, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn,
                         stride_kd, stride_vn, stride_vd, True, True)
    return k, v, tl.sum(mask_n.to(tl.int64))


@triton.jit
def _bits(bits_ptr, tok, row_ok, kt, num_key_tiles, offs_n):
    """``allowed [rows, BLOCK_N]``: bit ``j`` of each row's token's word of key tile ``kt``."""
    word = tl.load(bits_ptr + tok.to(tl.int64) * num_key_tiles + kt, mask=row_ok, other=0)  # [rows] int64
    return ((word[:, None] >> offs_n[None, :].to(tl.int64)) & 1) != 0


@triton.jit
def _masked_rows_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, stats_ptr, sinks_ptr, res_ptr, do_ptr, delta_ptr, bits_ptr, union_ptr, tiles_ptr,
    counts_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_lb, heads_per_selection, num_query_tiles, num_key_tiles, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DQ: tl.constexpr, ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """The forward (``DQ`` False: ``out`` = ``o``, writes ``lse`` and ``stats``) or dQ (``DQ``: ``out`` =
    ``dq``; reads ``do``, ``stats``, ``delta``) of one query tile (axis 0) and batch x unit (axis 1): the
    tile's key tiles ascending."""
    qt = tl.program_id(0)
    off_z, off_h, off_l, off_hkv = _unit(tl.program_id(1), num_heads_q, num_heads_kv, stride_lb, heads_per_selection,
                                         SEL_HEADS)
    tok, hh, row_ok, tokens = _tile_rows(qt, seqlen_q, 0, SEL_HEADS, SEL_ROWS, BLOCK_M, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)
    heads = (off_h + hh).to(tl.int64)  # [BLOCK_M]
    t64 = tok.to(tl.int64)
    rows_out = (off_z * num_heads_q + heads) * seqlen_q + tok  # [BLOCK_M] flat rows (b, h, t)
    q_rows = off_z * stride_qz + heads * stride_qh + t64 * stride_qm
    if DQ:
        q, do, m_row, log2_sum, delta = _row_inputs(q_ptr, do_ptr, q_rows,
                                                    off_z * stride_doz + heads * stride_doh + t64 * stride_dom,
                                                    offs_d, stride_qd, stride_dod, row_ok, mask_d, offs_dv, mask_dv,
                                                    stats_ptr, stats_stride, delta_ptr, rows_out)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # dq
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & mask_d[None, :],
                    other=0.0)  # [BLOCK_M, HEAD_DIM]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)  # o
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh
    bits_base = bits_ptr + off_l * seqlen_q * num_key_tiles
    row = (off_l * num_query_tiles + qt).to(tl.int64)
    cnt = tl.load(counts_ptr + row)
    qk_scale = sm_scale * LOG2E
    keys = tl.zeros([], dtype=tl.int64)
    for e in range(0, cnt):
        kt = tl.load(tiles_ptr + row * num_key_tiles + e)
        k, v, n_keys = _key_tile(k_base, v_base, kt, tl.load(union_ptr + row * num_key_tiles + kt), offs_n, offs_d,
                                 mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, BLOCK_N)
        s = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_M, BLOCK_N] (dQ: as the forward rounds it)
        s = tl.where(_bits(bits_base, tok, row_ok, kt, num_key_tiles, offs_n), s, float("-inf"))
        if DQ:
            acc = dq_step(acc, probabilities(s, m_row[:, None], log2_sum[:, None]), do, k, v, delta, DOT_DTYPE)
        else:
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, DOT_DTYPE, MAY_BE_EMPTY=True)
        keys += n_keys
    out_rows = off_z * stride_oz + heads * stride_oh + t64 * stride_om  # [BLOCK_M]
    plan_bytes = (1 + cnt.to(tl.int64)) * 4 + cnt.to(tl.int64) * (tokens + 1) * 8
    if DQ:
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :] * stride_od,
                 (acc * sm_scale).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
        if COUNT_IO:
            tally_backward(io_ptr, tl.sum(row_ok.to(tl.int64)), keys, head_dim, head_dim_v, ELEM_BYTES, DKDV=False)
            io_add(io_ptr, DQ_PLAN, plan_bytes, 0)
    else:
        store_rows(out_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, rows_out, out_rows, offs_dv * stride_od, row_ok,
                   mask_dv, stats_stride, sinks_ptr, heads, HAS_SINKS, res_ptr, HAS_RESIDUAL)
        if COUNT_IO:
            tally_forward(io_ptr, tl.sum(row_ok.to(tl.int64)), keys, head_dim, head_dim_v, ELEM_BYTES, 1)
            tally_residual(io_ptr, OUT_RESIDUAL, tl.sum(row_ok.to(tl.int64)), head_dim_v * ELEM_BYTES, HAS_RESIDUAL)
            io_add(io_ptr, FWD_PLAN, plan_bytes, 0)


@triton.jit
def _masked_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr, bits_ptr, union_ptr, tiles_ptr, counts_ptr,
    io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, heads_per_selection, num_query_tiles, num_key_tiles, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, SEL_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    SUBS: tl.constexpr = BLOCK_M // SUB_M
    kt = tl.program_id(0)  # the key tile
    pid_zg = tl.program_id(1)  # batch x kv head
    off_z = (pid_zg // num_heads_kv).to(tl.int64)
    off_g = (pid_zg % num_heads_kv).to(tl.int64)
    group = num_heads_q // num_heads_kv
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < head_dim
    offs_dv, mask_dv = value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V, DV_IS_D)
    cols = kt * BLOCK_N + offs_n
    union = tl.zeros([], dtype=tl.int64)  # the keys of this tile some selection serving the group selected
    for i in range(0, group // SEL_HEADS):
        off_l = off_z * stride_lb + (off_g * group + i * SEL_HEADS) // heads_per_selection
        union = union | tl.load(union_ptr + off_l * num_key_tiles + kt)
    k, v, n_keys = _key_tile(k_ptr + off_z * stride_kz + off_g * stride_kh, v_ptr + off_z * stride_vz
                             + off_g * stride_vh, kt, union, offs_n, offs_d, mask_d, offs_dv, mask_dv, stride_kn,
                             stride_kd, stride_vn, stride_vd, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    queries = tl.zeros([], dtype=tl.int64)
    entries = tl.zeros([], dtype=tl.int64)
    words = tl.zeros([], dtype=tl.int64)
    for i in range(0, group // SEL_HEADS):  # the selections serving this group, SEL_HEADS heads each
        off_h = off_g * group + i * SEL_HEADS
        off_l = off_z * stride_lb + off_h // heads_per_selection
        col = off_l * num_key_tiles + kt
        cnt = tl.load(counts_ptr + col)
        bits_base = bits_ptr + off_l * seqlen_q * num_key_tiles
        for i in range(0, cnt * SUBS):  # the list's query tiles, SUB_M rows (whole tokens) at a time
            qt = tl.load(tiles_ptr + col.to(tl.int64) * num_query_tiles + i // SUBS)
            tok, hh, row_ok, tokens = _tile_rows(qt, seqlen_q, (i % SUBS) * SUB_M, SEL_HEADS, SEL_ROWS, BLOCK_M,
                                                 SUB_M)
            heads = (off_h + hh).to(tl.int64)
            t64 = tok.to(tl.int64)
            q, do, m_row, log2_sum, delta = _row_inputs(
                q_ptr, do_ptr, off_z * stride_qz + heads * stride_qh + t64 * stride_qm,
                off_z * stride_doz + heads * stride_doh + t64 * stride_dom, offs_d, stride_qd, stride_dod,
                row_ok, mask_d, offs_dv, mask_dv, stats_ptr, stats_stride, delta_ptr,
                (off_z * num_heads_q + heads) * seqlen_q + tok)
            sT = score_tile(k, q, qk_scale, DOT_DTYPE)  # [BLOCK_N, SUB_M]: the keys as every product's M
            allowed = tl.trans(_bits(bits_base, tok, row_ok, kt, num_key_tiles, offs_n))
            pT = probabilities(tl.where(allowed, sT, float("-inf")), m_row[None, :], log2_sum[None, :])
            dk, dv = dkdv_step(dk, dv, pT, q, do, v, delta, DOT_DTYPE)
            if COUNT_IO:
                queries += tl.sum(row_ok.to(tl.int64))
                words += tokens
        entries += cnt.to(tl.int64) * SUBS
    store_dkdv(dk_ptr + off_z * stride_dkz + off_g * stride_dkh, dv_ptr + off_z * stride_dvz + off_g * stride_dvh,
               dk, dv, cols, cols < seqlen_k, offs_d, mask_d, offs_dv, mask_dv, stride_dkn, stride_dkd, stride_dvn,
               stride_dvd, sm_scale)
    if COUNT_IO:
        tally_backward(io_ptr, queries, n_keys, head_dim, head_dim_v, ELEM_BYTES, DKDV=True)
        rest = (tl.minimum(seqlen_k - kt * BLOCK_N, BLOCK_N) - n_keys) * ELEM_BYTES  # written, not read
        io_add(io_ptr, DKDV_DK, 0, rest * head_dim)
        io_add(io_ptr, DKDV_DV, 0, rest * head_dim_v)
        io_add(io_ptr, DKDV_PLAN, ((group // SEL_HEADS) + entries) * 4 + (words + group // SEL_HEADS) * 8, 0)
