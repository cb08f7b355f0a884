"""Triton kernels for ``softmax(A1 X A2^T * scale) A3 Y`` with block-sparse operands (jit only; the
launcher is :mod:`sparse_io_attn.sparse_operands.triton.launch`).

Tiles are addressed as described in :mod:`sparse_io_attn.sparse_operands.operands`: tile id ``t`` from a block
map, element ``(r, c)`` at ``base + (t // nb) * stride_ta + (t % nb) * stride_tb + r * stride_r +
c * stride_c``.

Batch and heads: every kernel runs all ``(batch element, head)`` groups of a call in one launch,
grid axis 1 being ``g = b * H + h`` (:func:`_group`). A group's operand starts at
``base + b * stride_*_gb + h * stride_*_gh`` and its block map likewise (``stride_*map_gb/_gh``;
strides are 0 along an axis the operand or pattern is shared on); buffers allocated per group
(``h``, ``o``, ``lse``, ``delta``, ``w``, ``hsum``) are offset by ``g`` times their group stride.
The plans of all distinct patterns are concatenated; a group reads ``plan_ids[g]`` and starts its
row (column) pointers at ``plan_ids[g] * (blocks + 1)``.

Head dimension (attention kernels): the head dimension is cut into ``NUM_D_TILES`` d-tiles of
``BLOCK_D`` columns (a compile-time count). A program holds its own operand as a tuple of per-d-tile
register tensors (built in ``tl.static_range``, indexed by the static tile index) and, for each
kept score block, reads only the other operand's d-tiles stored in both block rows (a fully masked
load elsewhere: no traffic). Every product over the head dimension — ``S = Q A2^T`` in the forward
and dQ kernels (``S^T = A2 Q^T`` in dK/dV), ``dA2 += dS^T Q`` and ``dQ += dS A2`` — is a sum of
per-tile ``tl.dot`` calls each behind a runtime branch on the tile-presence flags, so d-tiles absent
from either operand cost neither loads nor FLOPs (:mod:`sparse_io_attn.sparse_operands.flops` models
the issued multiply-adds exactly). The row-panel product kernel ``_bsr_matmul_kernel`` treats its
output columns the same way: one accumulator per column tile of C, and per pair only the column
tiles stored in both ``B[k, :]`` and ``C[i, :]`` are loaded and multiplied.

Pipelining: every main loop is ``tl.range(..., num_stages=LOOP_STAGES)`` (the launch's stage count,
:mod:`.configs`). Triton's pipeliner otherwise multi-buffers only loads that reach a dot at the top
level of the loop; with the loop's own stage count it also takes the operand tiles whose only
products sit behind the presence branches.

Products go through :func:`sparse_io_attn._triton.jit.dot` with fp32 accumulation; its ``DOT_DTYPE``
constexpr (chosen by :func:`sparse_io_attn._triton.runtime.dot_dtype`) is ``tl.float32`` (exact IEEE
products) for fp32 inputs and under the interpreter, the inputs' 16-bit type otherwise. Softmax runs
in base 2: scores are multiplied once by ``qk_scale = sm_scale * LOG2E`` and exponentiated with
``exp2``; ``lse`` is stored (and read back) in natural-log units, fp32.

I/O counting (``COUNT_IO``, see :mod:`sparse_io_attn.tally.counter`): each program tallies the
bytes of the in-bounds, unmasked lanes it loads and stores (:func:`~sparse_io_attn._triton.jit.nbytes`)
per tensor, plus the index bytes it reads (block-map rows, pair and plan lists), and adds them once
at its end with :func:`~sparse_io_attn._triton.jit.io_add` into the named slots of
:mod:`sparse_io_attn.sparse_operands.triton.slots` (slot order: the tensor tuples of
:mod:`sparse_io_attn.sparse_operands.traffic`, whose model reproduces every tally).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import LN2, LOG2E, dot, io_add, nbytes  # (sets TRITON_INTERPRET first)
from sparse_io_attn.sparse_operands.triton.slots import (DKV_A2, DKV_A2_MAP, DKV_DA2, DKV_DELTA, DKV_DH, DKV_DO,
                                                         DKV_H, DKV_LAYOUT, DKV_LSE, DKV_Q, DKV_Q_MAP, DKV_W,
                                                         DQ_A2, DQ_A2_MAP, DQ_DELTA, DQ_DO, DQ_DQ, DQ_H, DQ_LAYOUT,
                                                         DQ_LSE, DQ_Q, DQ_Q_MAP, FWD_A2, FWD_A2_MAP, FWD_H,
                                                         FWD_HSUM, FWD_LAYOUT, FWD_LSE, FWD_O, FWD_Q, FWD_Q_MAP,
                                                         MATMUL_A, MATMUL_B, MATMUL_C, MATMUL_COLSUM, MATMUL_PLAN,
                                                         PRE_DELTA, PRE_DO, PRE_LSE, PRE_O, PRE_W)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tile_ptrs(base, t, offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c):
    """Pointers ``[len(offs_r), len(offs_c)]`` of tile ``t`` (scalar)."""
    t = t.to(tl.int64)
    return base + (t // nb) * stride_ta + (t % nb) * stride_tb + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c


@triton.jit
def _group(num_heads):
    """``(b, h, g)`` of this program's ``(batch element, head)`` group (grid axis 1, ``g = b * H + h``),
    ``b`` and ``h`` as int64 for the offsets."""
    g = tl.program_id(1)
    return (g // num_heads).to(tl.int64), (g % num_heads).to(tl.int64), g


@triton.jit
def _d_ids(map_ptr, row, NUM_D_TILES: tl.constexpr):
    """Tile ids (int32 scalars, -1 where absent) of the ``NUM_D_TILES`` d-tiles of one block row, as a
    tuple; reads ``4 * NUM_D_TILES`` bytes of the block map."""
    ids = ()
    for t in tl.static_range(NUM_D_TILES):
        ids = ids + (tl.load(map_ptr + row * NUM_D_TILES + t),)
    return ids


@triton.jit
def _shared(ids_a, ids_b, NUM_D_TILES: tl.constexpr):
    """Tuple of scalar flags: d-tile ``t`` is stored in both block rows."""
    keep = ()
    for t in tl.static_range(NUM_D_TILES):
        keep = keep + ((ids_a[t] >= 0) & (ids_b[t] >= 0),)
    return keep


@triton.jit
def _load_d_tiles(base, ids, keep, offs_r, mask_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                  BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Tuple of ``[len(offs_r), BLOCK_D]`` tiles of one block row, tile ``t`` read only where
    ``keep[t]`` (elsewhere the whole load is masked off: zeros, no traffic); and the bytes read
    (int64). ``mask_r``: in-range rows; ``n_cols``: the operand's width (head dimension, or the
    columns of a product's row panel)."""
    tiles = ()
    read = tl.zeros([], dtype=tl.int64)
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(keep[t], tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        mask = mask_r[:, None] & (offs_c < width)[None, :]  # [len(offs_r), BLOCK_D]
        x = tl.load(_tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r,
                               stride_c), mask=mask, other=0.0)
        tiles = tiles + (x,)
        read += nbytes(mask, base)
    return tiles, read


@triton.jit
def _store_d_tiles(base, ids, tiles, offs_r, mask_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                   BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Store a tuple of ``[len(offs_r), BLOCK_D]`` tiles on the stored d-tiles of one block row;
    returns the bytes written (int64)."""
    written = tl.zeros([], dtype=tl.int64)
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(ids[t] >= 0, tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        mask = mask_r[:, None] & (offs_c < width)[None, :]  # [len(offs_r), BLOCK_D]
        ptrs = _tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c)
        tl.store(ptrs, tiles[t].to(base.dtype.element_ty), mask=mask)
        written += nbytes(mask, base)
    return written


@triton.jit
def _scores(q_tiles, k_tiles, keep, s, DOT_DTYPE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``s + sum_t q_t k_t^T`` over the d-tiles with ``keep[t]`` only: absent tiles issue no ``tl.dot``."""
    for t in tl.static_range(NUM_D_TILES):
        if keep[t]:
            s = dot(q_tiles[t], tl.trans(k_tiles[t]), s, DOT_DTYPE)
    return s


@triton.jit
def _acc_d_tiles(accs, a, b_tiles, keep, DOT_DTYPE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``accs[t] + a @ b_t`` for the d-tiles with ``keep[t]``; other accumulators unchanged (no FLOPs)."""
    out = ()
    for t in tl.static_range(NUM_D_TILES):
        c = accs[t]
        if keep[t]:
            c = dot(a, b_tiles[t], c, DOT_DTYPE)
        out = out + (c,)
    return out


@triton.jit
def _zero_d_tiles(ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Tuple of ``NUM_D_TILES`` fp32 zero accumulators ``[ROWS, BLOCK_D]``."""
    out = ()
    for t in tl.static_range(NUM_D_TILES):
        out = out + (tl.zeros([ROWS, BLOCK_D], dtype=tl.float32),)
    return out


@triton.jit
def _attention_group(q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, zb, zh, g, stride_q_gb, stride_q_gh,
                     stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb, stride_a2map_gh,
                     stride_hg):
    """Group ``(b, h)``'s Q, A2 and their block maps, its ``h = A3 Y`` rows, and the part of the
    concatenated score plan it reads (``plan_ids[g]``: 4 bytes of the "layout" tally)."""
    q_ptr += zb * stride_q_gb + zh * stride_q_gh
    qmap_ptr += zb * stride_qmap_gb + zh * stride_qmap_gh
    a2_ptr += zb * stride_a2_gb + zh * stride_a2_gh
    a2map_ptr += zb * stride_a2map_gb + zh * stride_a2map_gh
    h_ptr += g.to(tl.int64) * stride_hg
    return q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, tl.load(plan_ids_ptr + g)


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
    b_ptr += zb * stride_b_gb + zh * stride_b_gh
    c_ptr += zb * stride_c_gb + zh * stride_c_gh
    bmap_ptr += zb * stride_bmap_gb + zh * stride_bmap_gh
    cmap_ptr += zb * stride_cmap_gb + zh * stride_cmap_gh
    colsum_ptr += g.to(tl.int64) * stride_colsum_g
    pair_ptr_ptr += tl.load(plan_ids_ptr + g) * (num_rows + 1)
    start = tl.load(pair_ptr_ptr + i)
    end = tl.load(pair_ptr_ptr + i + 1)
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
        b_tiles, b_read = _load_d_tiles(b_ptr, b_ids, both, offs_k, mask_k, offs_bn, b_nb, stride_b_ta, stride_b_tb,
                                        stride_b_r, stride_b_c, size_n, BLOCK_N, NUM_N_TILES)  # tuple of [BLOCK_K, BLOCK_N]
        acc = _acc_d_tiles(acc, a, b_tiles, both, DOT_DTYPE, NUM_N_TILES)
        if COUNT_IO:
            a_bytes += nbytes(mask_mk, a_ptr)
            b_bytes += b_read
    c_bytes = _store_d_tiles(c_ptr, c_ids, acc, offs_m, mask_m, offs_bn, c_nb, stride_c_ta, stride_c_tb, stride_c_r,
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


@triton.jit
def _paper_attn_fwd_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, hsum_ptr, o_ptr, lse_ptr,
    kept_crow_ptr, kept_col_ptr, zero_crow_ptr, zero_col_ptr, plan_ids_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
    stride_a2map_gh,
    stride_hg, stride_hn, stride_hd, stride_hsum_g, stride_hsum_blk, stride_og, stride_om, stride_od, stride_lse_g,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale, num_heads,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """One program per query block ``i``: online softmax (base 2) over the kept score blocks of row
    ``i`` plus the structurally zero blocks (score 0, counted ``cnt`` times, values summed in
    ``hsum``). Q's stored d-tiles are held for the whole program; per kept block only the d-tiles of
    A2 stored in both rows are read and multiplied. Writes ``o`` and ``lse`` (fp32, natural log,
    ``-inf`` on rows with no key). Grid ``(query blocks, B * H)``: see :func:`_attention_group`.
    Counter slots: ``FWD_TENSORS`` (q, a2, h, hsum, o, lse, q_map, a2_map, layout)."""
    i = tl.program_id(0)
    zb, zh, g = _group(num_heads)
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, part = _attention_group(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, zb, zh, g, stride_q_gb, stride_q_gh,
        stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb, stride_a2map_gh, stride_hg)
    gl = g.to(tl.int64)
    hsum_ptr += gl * stride_hsum_g
    o_ptr += gl * stride_og
    lse_ptr += gl * stride_lse_g
    rows_ptr = part * (tl.cdiv(seqlen_q, BLOCK_M) + 1)  # this group's row pointers in the concatenated plan
    kept_crow_ptr += rows_ptr
    zero_crow_ptr += rows_ptr
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    mask_m = rows < seqlen_q
    mask_dv = offs_dv < head_dim_v
    mask_mdv = mask_m[:, None] & mask_dv[None, :]  # [BLOCK_M, DV_PAD]
    q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
    q_tiles, q_bytes = _load_d_tiles(q_ptr, q_ids, _shared(q_ids, q_ids, NUM_D_TILES), offs_m, mask_m, offs_bd, q_nb,
                                     stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim, BLOCK_D,
                                     NUM_D_TILES)  # tuple of [BLOCK_M, BLOCK_D]
    a2_bytes = tl.zeros([], dtype=tl.int64)
    h_bytes = tl.zeros([], dtype=tl.int64)
    n_kept = tl.zeros([], dtype=tl.int64)
    layout_bytes = tl.full([], 12, dtype=tl.int64)  # plan id, kept_crow[i], kept_crow[i + 1]
    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    if HAS_ZERO:
        zs = tl.load(zero_crow_ptr + i)
        ze = tl.load(zero_crow_ptr + i + 1)
        hz = tl.zeros([DV_PAD], dtype=tl.float32)
        cnt = 0.0
        for p in range(zs, ze):
            j = tl.load(zero_col_ptr + p)
            hz += tl.load(hsum_ptr + j * stride_hsum_blk + offs_dv, mask=mask_dv, other=0.0)  # [DV_PAD]
            cnt += tl.minimum(BLOCK_N, seqlen_k - j * BLOCK_N).to(tl.float32)
        # a virtual key of score 0 (in any base) with multiplicity cnt and summed value hz
        m_i = tl.where(cnt > 0, 0.0, m_i)
        l_i = l_i + cnt
        acc = acc + hz[None, :]
        layout_bytes += 8 + 4 * (ze - zs).to(tl.int64)
    ks = tl.load(kept_crow_ptr + i)
    ke = tl.load(kept_crow_ptr + i + 1)
    for p in tl.range(ks, ke, num_stages=LOOP_STAGES):
        j = tl.load(kept_col_ptr + p)
        keys = j * BLOCK_N + offs_n
        mask_n = keys < seqlen_k
        mask_ndv = mask_n[:, None] & mask_dv[None, :]  # [BLOCK_N, DV_PAD]
        a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        a2_tiles, a2_read = _load_d_tiles(a2_ptr, a2_ids, both, offs_n, mask_n, offs_bd, a2_nb, stride_a2_ta,
                                          stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D,
                                          NUM_D_TILES)  # tuple of [BLOCK_N, BLOCK_D]
        s = _scores(q_tiles, a2_tiles, both, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_DTYPE, NUM_D_TILES)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.math.exp2(m_i - m_new)
        pr = tl.math.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                    mask=mask_ndv, other=0.0)  # [BLOCK_N, DV_PAD]
        acc = dot(pr.to(h.dtype), h, acc * alpha[:, None], DOT_DTYPE)  # [BLOCK_M, DV_PAD]
        m_i = m_new
        if COUNT_IO:
            a2_bytes += a2_read
            h_bytes += nbytes(mask_ndv, h_ptr)
            n_kept += 1
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))  # natural log
    tl.store(o_ptr + rows[:, None] * stride_om + offs_dv[None, :] * stride_od, out.to(o_ptr.dtype.element_ty),
             mask=mask_mdv)
    tl.store(lse_ptr + rows, lse, mask=mask_m)
    if COUNT_IO:
        io_add(io_ptr, FWD_Q, q_bytes, 0)
        io_add(io_ptr, FWD_A2, a2_bytes, 0)
        io_add(io_ptr, FWD_H, h_bytes, 0)
        if HAS_ZERO:
            io_add(io_ptr, FWD_HSUM, (ze - zs).to(tl.int64) * nbytes(mask_dv, hsum_ptr), 0)
        io_add(io_ptr, FWD_O, 0, nbytes(mask_mdv, o_ptr))
        io_add(io_ptr, FWD_LSE, 0, nbytes(mask_m, lse_ptr))
        io_add(io_ptr, FWD_Q_MAP, tl.full([], 4 * NUM_D_TILES, dtype=tl.int64), 0)
        io_add(io_ptr, FWD_A2_MAP, n_kept * 4 * NUM_D_TILES, 0)
        io_add(io_ptr, FWD_LAYOUT, layout_bytes + 4 * (ke - ks).to(tl.int64), 0)


@triton.jit
def _paper_attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, lse_ptr, delta_ptr, w_ptr,
    stride_og, stride_om, stride_od, stride_dog, stride_dom, stride_dod, stride_lse_g, stride_w_g, stride_w_blk,
    seqlen_q, head_dim_v, num_heads,
    io_ptr,
    BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` (fp32 ``[seqlen_q]``); with ``HAS_ZERO`` also
    ``w[i] = sum_rows exp(-lse) dO`` (fp32 ``[nqb, DV]``), the weight a structurally zero score block
    of query block ``i`` sends to the value gradient. Grid ``(query blocks, B * H)``; ``lse`` and
    ``delta`` share their group stride. Counter slots: ``PREPROCESS_TENSORS`` (o, do, lse, delta, w)."""
    i = tl.program_id(0)
    gl = tl.program_id(1).to(tl.int64)
    o_ptr += gl * stride_og
    do_ptr += gl * stride_dog
    lse_ptr += gl * stride_lse_g
    delta_ptr += gl * stride_lse_g
    w_ptr += gl * stride_w_g
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    mask_m = rows < seqlen_q
    mask_dv = offs_dv < head_dim_v
    mask_mdv = mask_m[:, None] & mask_dv[None, :]  # [BLOCK_M, DV_PAD]
    o = tl.load(o_ptr + rows[:, None] * stride_om + offs_dv[None, :] * stride_od, mask=mask_mdv,
                other=0.0).to(tl.float32)  # [BLOCK_M, DV_PAD]
    do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod, mask=mask_mdv,
                 other=0.0).to(tl.float32)  # [BLOCK_M, DV_PAD]
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=mask_m)
    if HAS_ZERO:
        lse = tl.load(lse_ptr + rows, mask=mask_m, other=float("inf"))  # [BLOCK_M], natural log
        wr = tl.where(lse < float("inf"), tl.math.exp2(-lse * LOG2E), 0.0)  # [BLOCK_M]; 0 on empty rows (lse = -inf)
        wr = tl.where(lse > float("-inf"), wr, 0.0)
        tl.store(w_ptr + i * stride_w_blk + offs_dv, tl.sum(wr[:, None] * do, axis=0), mask=mask_dv)
    if COUNT_IO:
        io_add(io_ptr, PRE_O, nbytes(mask_mdv, o_ptr), 0)
        io_add(io_ptr, PRE_DO, nbytes(mask_mdv, do_ptr), 0)
        io_add(io_ptr, PRE_DELTA, 0, nbytes(mask_m, delta_ptr))
        if HAS_ZERO:
            io_add(io_ptr, PRE_LSE, nbytes(mask_m, lse_ptr), 0)
            io_add(io_ptr, PRE_W, 0, nbytes(mask_dv, w_ptr))


@triton.jit
def _paper_attn_bwd_dkv_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, do_ptr, lse_ptr, delta_ptr, w_ptr, da2_ptr, dh_ptr,
    kept_ccol_ptr, kept_row_ptr, zero_ccol_ptr, zero_row_ptr, plan_ids_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
    stride_a2map_gh, stride_da2_gb, stride_da2_gh,
    stride_hg, stride_hn, stride_hd, stride_dog, stride_dom, stride_dod, stride_lse_g, stride_w_g, stride_w_blk,
    stride_dhn, stride_dhd,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale, num_heads,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
    LOOP_STAGES: tl.constexpr, BLOCK_M_SUB: tl.constexpr,
):
    """One program per key block ``j``: ``dH[j] = sum_i P_ij^T dO_i`` (+ the structurally zero blocks'
    ``w``) and ``dA2[j] = sum_i dS_ij^T Q_i`` on A2's stored tiles (``da2`` has A2's addressing). A2's
    stored d-tiles and their dA2 accumulators are held per d-tile; per kept block only the Q d-tiles
    stored in both rows are read, and only they enter ``S`` and ``dA2``. Probabilities are
    recomputed in base 2 from ``lse`` (natural log, converted with ``LOG2E``).
    A kept query block is processed in ``BLOCK_M // BLOCK_M_SUB`` slices of ``BLOCK_M_SUB`` rows, one
    loop iteration each (the loop runs over (kept block, slice) pairs; each slice reads its block's
    row id and Q block-map row), in the transposed form ``S^T = A2 Q^T``, ``dP^T = h dO^T``, so the
    key block's rows are every product's ``M``: the working set shrinks with the slice, not the data
    read (each Q, dO, lse, delta row still read once per kept block).
    Grid ``(key blocks, B * H)``: see :func:`_attention_group`; ``dh`` shares h's addressing, ``da2``
    A2's apart from its group strides. Counter slots: ``DKV_TENSORS`` (q, a2, h, do, lse, delta, w,
    da2, dh, q_map, a2_map, layout)."""
    j = tl.program_id(0)
    zb, zh, g = _group(num_heads)
    da2_ptr += zb * stride_da2_gb + zh * stride_da2_gh
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, part = _attention_group(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, zb, zh, g, stride_q_gb, stride_q_gh,
        stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb, stride_a2map_gh, stride_hg)
    gl = g.to(tl.int64)
    dh_ptr += gl * stride_hg
    do_ptr += gl * stride_dog
    lse_ptr += gl * stride_lse_g
    delta_ptr += gl * stride_lse_g
    w_ptr += gl * stride_w_g
    cols_ptr = part * (tl.cdiv(seqlen_k, BLOCK_N) + 1)  # this group's column pointers in the concatenated plan
    kept_ccol_ptr += cols_ptr
    zero_ccol_ptr += cols_ptr
    offs_sub = tl.arange(0, BLOCK_M_SUB)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    keys = j * BLOCK_N + offs_n
    mask_n = keys < seqlen_k
    mask_dv = offs_dv < head_dim_v
    mask_ndv = mask_n[:, None] & mask_dv[None, :]  # [BLOCK_N, DV_PAD]
    a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
    a2_tiles, a2_bytes = _load_d_tiles(a2_ptr, a2_ids, _shared(a2_ids, a2_ids, NUM_D_TILES), offs_n, mask_n, offs_bd,
                                       a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D,
                                       NUM_D_TILES)  # tuple of [BLOCK_N, BLOCK_D]
    h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                mask=mask_ndv, other=0.0)  # [BLOCK_N, DV_PAD]
    dh = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    da2 = _zero_d_tiles(BLOCK_N, BLOCK_D, NUM_D_TILES)  # tuple of [BLOCK_N, BLOCK_D]
    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    q_bytes = tl.zeros([], dtype=tl.int64)
    do_bytes = tl.zeros([], dtype=tl.int64)
    lse_bytes = tl.zeros([], dtype=tl.int64)
    delta_bytes = tl.zeros([], dtype=tl.int64)
    layout_bytes = tl.full([], 12, dtype=tl.int64)  # plan id, kept_ccol[j], kept_ccol[j + 1]
    ks = tl.load(kept_ccol_ptr + j)
    ke = tl.load(kept_ccol_ptr + j + 1)
    SLICES: tl.constexpr = BLOCK_M // BLOCK_M_SUB
    for it in tl.range(ks * SLICES, ke * SLICES, num_stages=LOOP_STAGES):  # (kept block, slice of its rows)
        p = it // SLICES
        i = tl.load(kept_row_ptr + p)
        q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        offs_r = (it % SLICES) * BLOCK_M_SUB + offs_sub  # rows within the query block
        rows = i * BLOCK_M + offs_r
        mask_m = rows < seqlen_q
        mask_mdv = mask_m[:, None] & mask_dv[None, :]  # [BLOCK_M_SUB, DV_PAD]
        q_tiles, q_read = _load_d_tiles(q_ptr, q_ids, both, offs_r, mask_m, offs_bd, q_nb, stride_q_ta,
                                        stride_q_tb, stride_q_r, stride_q_c, head_dim, BLOCK_D,
                                        NUM_D_TILES)  # tuple of [BLOCK_M_SUB, BLOCK_D]
        do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=mask_mdv, other=0.0)  # [BLOCK_M_SUB, DV_PAD]
        lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=float("inf")) * LOG2E  # [BLOCK_M_SUB], base 2
        delta = tl.load(delta_ptr + rows, mask=mask_m, other=0.0)  # [BLOCK_M_SUB]
        # transposed scores S^T = A2 Q^T: every product has the key block's rows as its M
        st = _scores(a2_tiles, q_tiles, both, tl.zeros([BLOCK_N, BLOCK_M_SUB], dtype=tl.float32), DOT_DTYPE,
                     NUM_D_TILES)
        st = st * qk_scale  # [BLOCK_N, BLOCK_M_SUB]
        pt = tl.where(mask_n[:, None] & mask_m[None, :], tl.math.exp2(st - lse2[None, :]), 0.0)
        dh = dot(pt.to(do.dtype), do, dh, DOT_DTYPE)  # [BLOCK_N, DV_PAD]
        dpt = dot(h, tl.trans(do), None, DOT_DTYPE)  # [BLOCK_N, BLOCK_M_SUB]
        dst = pt * (dpt - delta[None, :]) * sm_scale  # [BLOCK_N, BLOCK_M_SUB]
        da2 = _acc_d_tiles(da2, dst.to(q_ptr.dtype.element_ty), q_tiles, both, DOT_DTYPE, NUM_D_TILES)
        if COUNT_IO:
            q_bytes += q_read
            do_bytes += nbytes(mask_mdv, do_ptr)
            lse_bytes += nbytes(mask_m, lse_ptr)
            delta_bytes += nbytes(mask_m, delta_ptr)
    if HAS_ZERO:
        zs = tl.load(zero_ccol_ptr + j)
        ze = tl.load(zero_ccol_ptr + j + 1)
        wz = tl.zeros([DV_PAD], dtype=tl.float32)
        for p in range(zs, ze):
            i = tl.load(zero_row_ptr + p)
            wz += tl.load(w_ptr + i * stride_w_blk + offs_dv, mask=mask_dv, other=0.0)  # [DV_PAD]
        dh += wz[None, :]
        layout_bytes += 8 + 4 * (ze - zs).to(tl.int64)
    tl.store(dh_ptr + keys[:, None] * stride_dhn + offs_dv[None, :] * stride_dhd, dh.to(dh_ptr.dtype.element_ty),
             mask=mask_ndv)
    da2_bytes = _store_d_tiles(da2_ptr, a2_ids, da2, offs_n, mask_n, offs_bd, a2_nb, stride_a2_ta, stride_a2_tb,
                               stride_a2_r, stride_a2_c, head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        io_add(io_ptr, DKV_Q, q_bytes, 0)
        io_add(io_ptr, DKV_A2, a2_bytes, 0)
        io_add(io_ptr, DKV_H, nbytes(mask_ndv, h_ptr), 0)
        io_add(io_ptr, DKV_DO, do_bytes, 0)
        io_add(io_ptr, DKV_LSE, lse_bytes, 0)
        io_add(io_ptr, DKV_DELTA, delta_bytes, 0)
        if HAS_ZERO:
            io_add(io_ptr, DKV_W, (ze - zs).to(tl.int64) * nbytes(mask_dv, w_ptr), 0)
        io_add(io_ptr, DKV_DA2, 0, da2_bytes)
        io_add(io_ptr, DKV_DH, 0, nbytes(mask_ndv, dh_ptr))
        n_slices = (ke - ks).to(tl.int64) * SLICES  # each slice reads its block's row id and Q block-map row
        io_add(io_ptr, DKV_Q_MAP, n_slices * 4 * NUM_D_TILES, 0)
        io_add(io_ptr, DKV_A2_MAP, tl.full([], 4 * NUM_D_TILES, dtype=tl.int64), 0)
        io_add(io_ptr, DKV_LAYOUT, layout_bytes + 4 * n_slices, 0)


@triton.jit
def _paper_attn_bwd_dq_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    kept_crow_ptr, kept_col_ptr, plan_ids_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
    stride_a2map_gh,
    stride_hg, stride_hn, stride_hd, stride_dog, stride_dom, stride_dod, stride_lse_g,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale, num_heads,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program per query block ``i``: ``dQ[i] = sum_j dS_ij A2_j`` on Q's stored tiles (``dq`` has
    Q's addressing). Structurally zero score blocks add nothing to dQ on Q's pattern. Q's stored
    d-tiles and their dQ accumulators are held per d-tile; per kept block only the A2 d-tiles stored
    in both rows are read, and only they enter ``S`` and ``dQ``. Probabilities are recomputed in
    base 2 from ``lse`` (natural log, converted with ``LOG2E``).
    Grid ``(query blocks, B * H)``: see :func:`_attention_group`; ``dq`` has Q's group strides.
    Counter slots: ``DQ_TENSORS`` (q, a2, h, do, lse, delta, dq, q_map, a2_map, layout)."""
    i = tl.program_id(0)
    zb, zh, g = _group(num_heads)
    dq_ptr += zb * stride_q_gb + zh * stride_q_gh
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, part = _attention_group(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, zb, zh, g, stride_q_gb, stride_q_gh,
        stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb, stride_a2map_gh, stride_hg)
    gl = g.to(tl.int64)
    do_ptr += gl * stride_dog
    lse_ptr += gl * stride_lse_g
    delta_ptr += gl * stride_lse_g
    kept_crow_ptr += part * (tl.cdiv(seqlen_q, BLOCK_M) + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    mask_m = rows < seqlen_q
    mask_dv = offs_dv < head_dim_v
    mask_mdv = mask_m[:, None] & mask_dv[None, :]  # [BLOCK_M, DV_PAD]
    q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
    q_tiles, q_bytes = _load_d_tiles(q_ptr, q_ids, _shared(q_ids, q_ids, NUM_D_TILES), offs_m, mask_m, offs_bd, q_nb,
                                     stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim, BLOCK_D,
                                     NUM_D_TILES)  # tuple of [BLOCK_M, BLOCK_D]
    do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=mask_mdv, other=0.0)  # [BLOCK_M, DV_PAD]
    lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=float("inf")) * LOG2E  # [BLOCK_M], base 2
    delta = tl.load(delta_ptr + rows, mask=mask_m, other=0.0)  # [BLOCK_M]
    dq = _zero_d_tiles(BLOCK_M, BLOCK_D, NUM_D_TILES)  # tuple of [BLOCK_M, BLOCK_D]
    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    a2_bytes = tl.zeros([], dtype=tl.int64)
    h_bytes = tl.zeros([], dtype=tl.int64)
    n_kept = tl.zeros([], dtype=tl.int64)
    ks = tl.load(kept_crow_ptr + i)
    ke = tl.load(kept_crow_ptr + i + 1)
    for p in tl.range(ks, ke, num_stages=LOOP_STAGES):
        j = tl.load(kept_col_ptr + p)
        keys = j * BLOCK_N + offs_n
        mask_n = keys < seqlen_k
        mask_ndv = mask_n[:, None] & mask_dv[None, :]  # [BLOCK_N, DV_PAD]
        a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        a2_tiles, a2_read = _load_d_tiles(a2_ptr, a2_ids, both, offs_n, mask_n, offs_bd, a2_nb, stride_a2_ta,
                                          stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D,
                                          NUM_D_TILES)  # tuple of [BLOCK_N, BLOCK_D]
        h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                    mask=mask_ndv, other=0.0)  # [BLOCK_N, DV_PAD]
        s = _scores(q_tiles, a2_tiles, both, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_DTYPE, NUM_D_TILES)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        pr = tl.where(mask_m[:, None] & mask_n[None, :], tl.math.exp2(s - lse2[:, None]), 0.0)  # [BLOCK_M, BLOCK_N]
        dp = dot(do, tl.trans(h), None, DOT_DTYPE)  # [BLOCK_M, BLOCK_N]
        ds = pr * (dp - delta[:, None]) * sm_scale  # [BLOCK_M, BLOCK_N]
        dq = _acc_d_tiles(dq, ds.to(a2_ptr.dtype.element_ty), a2_tiles, both, DOT_DTYPE, NUM_D_TILES)
        if COUNT_IO:
            a2_bytes += a2_read
            h_bytes += nbytes(mask_ndv, h_ptr)
            n_kept += 1
    dq_bytes = _store_d_tiles(dq_ptr, q_ids, dq, offs_m, mask_m, offs_bd, q_nb, stride_q_ta, stride_q_tb, stride_q_r,
                              stride_q_c, head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        io_add(io_ptr, DQ_Q, q_bytes, 0)
        io_add(io_ptr, DQ_A2, a2_bytes, 0)
        io_add(io_ptr, DQ_H, h_bytes, 0)
        io_add(io_ptr, DQ_DO, nbytes(mask_mdv, do_ptr), 0)
        io_add(io_ptr, DQ_LSE, nbytes(mask_m, lse_ptr), 0)
        io_add(io_ptr, DQ_DELTA, nbytes(mask_m, delta_ptr), 0)
        io_add(io_ptr, DQ_DQ, 0, dq_bytes)
        io_add(io_ptr, DQ_Q_MAP, tl.full([], 4 * NUM_D_TILES, dtype=tl.int64), 0)
        io_add(io_ptr, DQ_A2_MAP, n_kept * 4 * NUM_D_TILES, 0)
        io_add(io_ptr, DQ_LAYOUT, 12 + 4 * (ke - ks).to(tl.int64), 0)
