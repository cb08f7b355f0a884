"""Selection attention forward kernel (``@triton.jit`` only; the launcher is :mod:`.launch`).

Query-major (NSA/DSA style): one program per (query token ``t``, batch x *head unit*), a head unit
being the ``SEL_HEADS`` query heads that share one selection and one KV head
(:func:`~sparse_io_attn.selection.tiles.sel_heads`; ``BLOCK_H`` rows, padded, several programs past
:func:`~sparse_io_attn.selection.tiles.head_rows`' cap). The heads are the tile's rows; the
row's normalised blocks (``plan.rows[l, t, :plan.row_counts[l, t]]``, ascending) are walked in one
flat loop of *key steps* of ``BLOCK_N`` gathered keys (:func:`_key_step`):

* ``SLOTS > 1`` (blocks smaller than ``BLOCK_N``): step ``s`` gathers slots ``s * SLOTS + i // BLOCK_SIZE``,
  key ``rows[..] * BLOCK_SIZE + i % BLOCK_SIZE`` for lane ``i``;
* ``TILES >= 1`` (blocks of ``BLOCK_N`` keys or more): step ``s`` is tile ``s % TILES`` of slot ``s // TILES``.

Only the last block of a row can straddle the causal diagonal (rows are ascending and no block
lies wholly in the future) or hold the ragged end of the keys (the largest block), and only the
last step group can hold slots past the row's count: every step but the last ``TILES`` is
unmasked (``MASKED=False``: no per-element test; ``MASK_LANES`` only when the block size and
``BLOCK_N`` do not divide one another), the last ``TILES`` steps apply key padding, causality and
the count (``MASKED=True``). Keys past the diagonal or the sequence are not loaded.

Packed sequences (``IS_VARLEN``, ``table_ptr``: the plan's block table, :mod:`sparse_io_attn.selection.varlen`):
a row's blocks ascend inside its sequence, whose blocks follow each other whole but its last, so the row
runs as on the fixed grid with K/V moved by the sequence's shift (:func:`_row_keys`) and its masked
steps bounded by its last block's end and its own causal offset (:func:`_row_bounds`): the steps' code
is the fixed grid's, and without ``IS_VARLEN`` the generated code is unchanged.

Online softmax in base 2 (``sm_scale * LOG2E`` folded into one multiply, scores formed by the
attention kit's :func:`~sparse_io_attn._attention.triton.softmax.score_tile`, as every kernel forms
them); writes ``o``, ``lse`` (natural log, ``-inf`` on empty rows) and ``stats``
(base-2 row maximum, log2 row sum; ``+inf``/``0`` on empty rows). With ``COUNT_IO`` each program
adds its bytes per tensor at its end.
"""
from __future__ import annotations

from sparse_io_attn._attention.triton.softmax import score_tile, softmax_step, store_rows
from sparse_io_attn._attention.triton.slots import OUT_RESIDUAL
from sparse_io_attn._attention.triton.tally import tally_forward, tally_residual
from sparse_io_attn._attention.triton.tile_io import load_row_pair, value_lanes
from sparse_io_attn._triton.jit import LOG2E, io_add  # (sets TRITON_INTERPRET first)
from sparse_io_attn.selection.triton.slots import FWD_PLAN

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _head_unit(prog, num_heads_q, num_heads_kv, stride_lb, heads_per_selection,
               SEL_HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The rows of row program ``prog`` (batch, head unit, chunk of ``BLOCK_H`` heads) of the forward,
    decode and dQ kernels: ``(off_z, offs_h, mask_h, off_l, off_hkv)``, the batch element, the
    ``BLOCK_H`` query heads (``mask_h``: those of the unit), the stored selection they share and their
    KV head."""
    CHUNKS: tl.constexpr = (SEL_HEADS + BLOCK_H - 1) // BLOCK_H
    off_z, off_h, off_l, off_hkv = _unit(prog // CHUNKS, num_heads_q, num_heads_kv, stride_lb, heads_per_selection,
                                         SEL_HEADS)
    chunk = prog % CHUNKS
    offs_hh = tl.arange(0, BLOCK_H)
    mask_h = offs_hh < SEL_HEADS - chunk * BLOCK_H
    offs_h = (off_h + chunk * BLOCK_H + offs_hh).to(tl.int64)  # [BLOCK_H] query heads
    return off_z, offs_h, mask_h, off_l, off_hkv


@triton.jit
def _unit(prog, num_heads_q, num_heads_kv, stride_lb, heads_per_selection, SEL_HEADS: tl.constexpr):
    """Unit ``prog`` of ``B x Hq / SEL_HEADS`` (the ``SEL_HEADS`` query heads sharing one selection and one KV
    head): ``(off_z, off_h, off_l, off_hkv)``, its batch element, first query head, stored selection and KV head."""
    units = num_heads_q // SEL_HEADS
    off_z = (prog // units).to(tl.int64)
    off_h = (prog % units) * SEL_HEADS
    off_l = off_z * stride_lb + off_h // heads_per_selection  # the heads' selection
    off_hkv = (off_h // (num_heads_q // num_heads_kv)).to(tl.int64)
    return off_z, off_h, off_l, off_hkv


@triton.jit
def _row_steps(rows_ptr, row_counts_ptr, row, max_blocks, SLOTS: tl.constexpr, TILES: tl.constexpr):
    """Row ``row`` of the plan (a token of a stored selection; forward, decode and dQ): ``(cnt, row_ptr, n_steps,
    n_full)``, its block count and blocks, its key steps and the unmasked ones (every step before the last
    block's ``TILES``)."""
    cnt = tl.load(row_counts_ptr + row)
    n_steps = (cnt + SLOTS - 1) // SLOTS * TILES
    return cnt, rows_ptr + row * max_blocks, n_steps, tl.maximum(n_steps - TILES, 0)


@triton.jit
def _row_keys(table_ptr, row_ptr, cnt, k_base, v_base, stride_kn, stride_vn, BLOCK_SIZE: tl.constexpr,
              IS_VARLEN: tl.constexpr):
    """``(k_base, v_base, shift)`` of a row program: unchanged on the fixed grid; ``IS_VARLEN`` (packed
    sequences): block ``c`` of the row's sequence starts at key ``c * BLOCK_SIZE + shift`` (its first block's
    table entry; the sequence's blocks follow each other, whole but the last), so the row runs as on the
    fixed grid with K/V moved by ``shift`` keys (0 for a row without blocks)."""
    shift = 0
    if IS_VARLEN:
        live = cnt > 0
        first = tl.load(row_ptr, mask=live, other=0)
        shift = (tl.load(table_ptr + first, mask=live, other=0) - first * BLOCK_SIZE).to(tl.int64)
        k_base += shift * stride_kn
        v_base += shift * stride_vn
    return k_base, v_base, shift


@triton.jit
def _row_bounds(table_ptr, row_ptr, cnt, query, num_kv_blocks, shift, seqlen_k, causal_offset,
                IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(seqlen_k, causal_offset)`` of the row's masked steps: unchanged on the fixed grid; ``IS_VARLEN``
    (keys counted from ``shift``, :func:`_row_keys`): the end of the row's last block and the row's own
    causal offset from the block table, read after the unmasked steps (not live across them)."""
    if IS_VARLEN:
        live = cnt > 0
        last = tl.load(row_ptr + cnt - 1, mask=live, other=0)
        seqlen_k = tl.load(table_ptr + num_kv_blocks + last, mask=live, other=0) - shift
        if IS_CAUSAL:
            causal_offset = tl.load(table_ptr + 2 * num_kv_blocks + query, mask=live, other=0) - shift
    return seqlen_k, causal_offset


@triton.jit
def _row_plan_reads(cnt, TILES: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The int32 plan entries a row program reads: its row count, one row entry per key step of a block
    (each gathered slot once) and, ``IS_VARLEN`` with blocks, its first and last entries, their blocks'
    start and end and, causal, the row's offset (:func:`_row_keys`, :func:`_row_bounds`)."""
    n = 1 + cnt.to(tl.int64) * TILES
    if IS_VARLEN:
        n += tl.where(cnt > 0, 5 if IS_CAUSAL else 4, 0)
    return n


@triton.jit
def _key_step(k_base, v_base, row_ptr, cnt, s, query, offs_n, offs_d, mask_d, offs_dv, mask_dv,
              stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr, TILES: tl.constexpr,
              MASK_LANES: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """``(k, v, valid, keys)`` of key step ``s`` of the query row ``row_ptr`` (``cnt`` blocks) for
    query token ``query`` (forward and dQ). ``MASKED`` (the last block's steps): ``valid [BLOCK_N]``
    marks the keys inside a listed block, inside the sequence and (``IS_CAUSAL``) at or before the
    diagonal; only those are loaded and ``keys`` counts them. Otherwise every lane inside a block is
    an allowed key (``valid`` marks those lanes when ``MASK_LANES``; ``keys`` is 0: the caller counts
    whole blocks)."""
    off = (s % TILES) * BLOCK_N + offs_n % BLOCK_SIZE  # [BLOCK_N] key offset inside its block
    lane_ok = (offs_n < SLOTS * BLOCK_SIZE) & (off < BLOCK_SIZE)  # [BLOCK_N] lanes inside a block
    if SLOTS == 1:
        cols = tl.load(row_ptr + s // TILES) * BLOCK_SIZE + off  # [BLOCK_N]: one block per step
    else:
        slot = s * SLOTS + offs_n // BLOCK_SIZE  # [BLOCK_N] (TILES == 1): SLOTS blocks per step
        if MASKED:
            blk = tl.load(row_ptr + slot, mask=lane_ok & (slot < cnt), other=-1)
        elif MASK_LANES:
            blk = tl.load(row_ptr + slot, mask=lane_ok, other=-1)
        else:
            blk = tl.load(row_ptr + slot)
        cols = blk * BLOCK_SIZE + off  # [BLOCK_N]; negative where no slot
    if MASKED:
        valid = lane_ok & (cols >= 0) & (cols < seqlen_k)
        if IS_CAUSAL:
            valid = valid & (cols <= query + causal_offset)
        keys = tl.sum(valid.to(tl.int64))
    else:
        valid = lane_ok   # (read only when MASK_LANES)
        keys = 0
    k, v = load_row_pair(k_base, v_base, cols, valid, offs_d, mask_d, offs_dv, mask_dv, stride_kn, stride_kd, stride_vn,
                         stride_vd, MASKED or MASK_LANES, EVEN_D)  # [BLOCK_N, HEAD_DIM], [BLOCK_N, HEAD_DIM_V]
    return k, v, valid, keys


@triton.jit
def _sel_fwd_step(acc, l_i, m_i, keys_loaded, q, k_base, v_base, row_ptr, cnt, s, query, offs_n, offs_d, mask_d,
                  offs_dv, mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr, TILES: tl.constexpr,
                  MASK_LANES: tl.constexpr, EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, MASKED: tl.constexpr):
    """One key step of the online softmax (:func:`_key_step`; keys outside ``valid`` get
    probability 0). Returns ``(acc, l_i, m_i, keys_loaded)``."""
    k, v, valid, keys = _key_step(k_base, v_base, row_ptr, cnt, s, query, offs_n, offs_d, mask_d, offs_dv, mask_dv,
                                  stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset,
                                  BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, MASKED)
    sc = score_tile(q, k, qk_scale, DOT_DTYPE)  # [BLOCK_H, BLOCK_N]
    if MASKED:   # (a step keeps its block's first key: never an empty row)
        sc = tl.where(valid[None, :], sc, float("-inf"))
        if COUNT_IO:
            keys_loaded += keys
    elif MASK_LANES:
        sc = tl.where(valid[None, :], sc, float("-inf"))
    acc, l_i, m_i = softmax_step(acc, l_i, m_i, sc, v, DOT_DTYPE, MAY_BE_EMPTY=MASKED)
    return acc, l_i, m_i, keys_loaded


@triton.jit
def _sel_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, sinks_ptr, res_ptr, rows_ptr, row_counts_ptr, table_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_lb, heads_per_selection, max_blocks, num_kv_blocks, stats_stride,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, head_dim_v, sm_scale, causal_offset,
    BLOCK_SIZE: tl.constexpr, SEL_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOTS: tl.constexpr, TILES: tl.constexpr, MASK_LANES: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr,
    EVEN_D: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ELEM_BYTES: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, COUNT_IO: tl.constexpr,
):
    t = tl.program_id(0)  # the query token
    off_z, offs_h, mask_h, off_l, off_hkv = _head_unit(tl.program_id(1), num_heads_q, num_heads_kv, stride_lb,
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

    # this token's row of the plan: key steps [0, n_full) unmasked, [n_full, n_steps) the last block's
    cnt, row_ptr, n_steps, n_full = _row_steps(rows_ptr, row_counts_ptr, off_l * seqlen_q + t, max_blocks, SLOTS, TILES)
    k_base, v_base, shift = _row_keys(table_ptr, row_ptr, cnt, k_base, v_base, stride_kn, stride_vn, BLOCK_SIZE,
                                      IS_VARLEN)

    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_V], dtype=tl.float32)
    keys_loaded = tl.zeros([], dtype=tl.int64)

    # 1. whole blocks: no per-element test; 2. the last block's steps: padding, causality, count
    for s in range(0, n_full):
        acc, l_i, m_i, keys_loaded = _sel_fwd_step(
            acc, l_i, m_i, keys_loaded, q, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, causal_offset, qk_scale,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=False)
    key_end, delta = _row_bounds(table_ptr, row_ptr, cnt, t, num_kv_blocks, shift, seqlen_k, causal_offset, IS_CAUSAL,
                                 IS_VARLEN)
    for s in range(n_full, n_steps):
        acc, l_i, m_i, keys_loaded = _sel_fwd_step(
            acc, l_i, m_i, keys_loaded, q, k_base, v_base, row_ptr, cnt, s, t, offs_n, offs_d, mask_d, offs_dv,
            mask_dv, stride_kn, stride_kd, stride_vn, stride_vd, key_end, delta, qk_scale,
            BLOCK_SIZE, BLOCK_N, SLOTS, TILES, MASK_LANES, EVEN_D, IS_CAUSAL, DOT_DTYPE, COUNT_IO, MASKED=True)

    store_rows(o_ptr, lse_ptr, stats_ptr, acc, l_i, m_i, (off_z * num_heads_q + offs_h) * seqlen_q + t,
               off_z * stride_oz + offs_h * stride_oh + t.to(tl.int64) * stride_om, offs_dv * stride_od,
               mask_h, mask_dv, stats_stride, sinks_ptr, offs_h, HAS_SINKS, res_ptr, HAS_RESIDUAL)

    if COUNT_IO:
        keys_loaded += (n_full // TILES).to(tl.int64) * SLOTS * BLOCK_SIZE  # whole blocks of the unmasked steps
        tally_forward(io_ptr, tl.sum(mask_h.to(tl.int64)), keys_loaded, head_dim, head_dim_v, ELEM_BYTES, 1)
        tally_residual(io_ptr, OUT_RESIDUAL, tl.sum(mask_h.to(tl.int64)), head_dim_v * ELEM_BYTES, HAS_RESIDUAL)
        io_add(io_ptr, FWD_PLAN, _row_plan_reads(cnt, TILES, IS_CAUSAL, IS_VARLEN) * 4, 0)
