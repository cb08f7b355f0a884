"""Triton kernels for ``softmax(A1 X A2^T * scale) A3 Y`` with block-sparse operands (jit only).

Tiles are addressed as described in :mod:`sparse_io_attn.sparse_operands.operands`: tile id ``t`` from a block
map, element ``(r, c)`` at ``base + (t // nb) * stride_ta + (t % nb) * stride_tb + r * stride_r +
c * stride_c``.

Head dimension (attention kernels): the head dimension is cut into ``NUM_D_TILES`` d-tiles of
``BLOCK_D`` columns (a compile-time count). A program holds its own operand as a tuple of per-d-tile
register tensors (built in ``tl.static_range``, indexed by the static tile index) and, for each
kept score block, reads only the other operand's d-tiles stored in both block rows (a fully masked
load elsewhere: no traffic). Every product over the head dimension — ``S = Q A2^T`` in all three
kernels, ``dA2 += dS^T Q`` and ``dQ += dS A2`` — is a sum of per-tile ``tl.dot`` calls each behind a
runtime branch on the tile-presence flags, so d-tiles absent from either operand cost neither loads
nor FLOPs (:mod:`sparse_io_attn.sparse_operands.flops` models the issued multiply-adds exactly). The row-panel
product kernel ``_bsr_matmul_kernel`` treats its output columns the same way: one accumulator per
column tile of C, and per pair only the column tiles stored in both ``B[k, :]`` and ``C[i, :]`` are
loaded and multiplied.

I/O counting (``COUNT_IO``, see :mod:`sparse_io_attn.accounting.counter`): each program tallies the
in-bounds, unmasked elements it loads and stores, times the element size, per tensor, and adds them
once at its end. Slot order is the launcher's ``tensors`` tuple; the traffic model in
:mod:`sparse_io_attn.sparse_operands.traffic` reproduces every tally.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``; ``IEEE``: in fp32 with full precision (fp32 inputs, and every dtype under the
    interpreter, whose 16-bit ``tl.dot`` is wrong)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _nsum(mask):
    """Number of true lanes (int64)."""
    return tl.sum(mask.to(tl.int64))


@triton.jit
def _tile_ptrs(base, t, offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c):
    """Pointers ``[len(offs_r), len(offs_c)]`` of tile ``t`` (scalar)."""
    t = t.to(tl.int64)
    return base + (t // nb) * stride_ta + (t % nb) * stride_tb + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c


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
def _load_d_tiles(base, ids, keep, offs_r, r_ok, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                  BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Tuple of ``[len(offs_r), BLOCK_D]`` tiles of one block row, tile ``t`` read only where
    ``keep[t]`` (elsewhere the whole load is masked off: zeros, no traffic); and the number of
    in-bounds columns read (int32). ``n_cols``: the operand's width (head dimension, or the columns
    of a product's row panel)."""
    tiles = ()
    cols = 0
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(keep[t], tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        x = tl.load(_tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r,
                               stride_c), mask=r_ok[:, None] & (offs_c < width)[None, :], other=0.0)
        tiles = tiles + (x,)
        cols += width
    return tiles, cols


@triton.jit
def _store_d_tiles(base, ids, tiles, offs_r, r_ok, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                   BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Store a tuple of ``[len(offs_r), BLOCK_D]`` tiles on the stored d-tiles of one block row."""
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(ids[t] >= 0, tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        ptrs = _tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c)
        tl.store(ptrs, tiles[t].to(base.dtype.element_ty), mask=r_ok[:, None] & (offs_c < width)[None, :])


@triton.jit
def _scores(q_tiles, k_tiles, keep, s, IEEE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``s + sum_t q_t k_t^T`` over the d-tiles with ``keep[t]`` only: absent tiles issue no ``tl.dot``."""
    for t in tl.static_range(NUM_D_TILES):
        if keep[t]:
            s = _dot(q_tiles[t], tl.trans(k_tiles[t]), s, IEEE)
    return s


@triton.jit
def _acc_d_tiles(accs, a, b_tiles, keep, IEEE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``accs[t] + a @ b_t`` for the d-tiles with ``keep[t]``; other accumulators unchanged (no FLOPs)."""
    out = ()
    for t in tl.static_range(NUM_D_TILES):
        c = accs[t]
        if keep[t]:
            c = _dot(a, b_tiles[t], c, IEEE)
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
def _bsr_matmul_kernel(
    a_ptr, b_ptr, c_ptr, colsum_ptr, bmap_ptr, cmap_ptr, pair_ptr_ptr, pair_a_ptr, pair_k_ptr,
    a_nb, stride_a_ta, stride_a_tb, stride_a_r, stride_a_c,
    b_nb, stride_b_ta, stride_b_tb, stride_b_r, stride_b_c,
    c_nb, stride_c_ta, stride_c_tb, stride_c_r, stride_c_c,
    stride_colsum_blk,
    size_m, size_k, size_n,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, NUM_N_TILES: tl.constexpr,
    WRITE_COLSUM: tl.constexpr, IEEE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per row block ``i`` of ``C = A B``, computing the whole row panel ``C[i, :]``
    (``NUM_N_TILES`` column tiles, one fp32 accumulator each): for each listed pair ``(A tile of
    (i, k), k)`` it loads the A tile once and, of the row panel ``B[k, :]``, only the tiles stored in
    both ``B[k, :]`` and ``C[i, :]``, and multiplies only those (absent column tiles: no load, no
    FLOPs). The panel is stored on ``C[i, :]``'s stored tiles. With ``WRITE_COLSUM`` it also writes
    the panel's column sums (fp32) to ``colsum[i, :]``. Counter slots: a, b, c, colsum, plan
    (pair lists and block-map rows)."""
    i = tl.program_id(0)
    start = tl.load(pair_ptr_ptr + i)
    end = tl.load(pair_ptr_ptr + i + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = tl.arange(0, BLOCK_N)
    row_ok = i * BLOCK_M + offs_m < size_m
    n_rows = _nsum(row_ok)
    c_ids = _d_ids(cmap_ptr, i, NUM_N_TILES)
    acc = _zero_d_tiles(BLOCK_M, BLOCK_N, NUM_N_TILES)  # tuple of [BLOCK_M, BLOCK_N]
    n_ab = n_rows * 0  # elements of A loaded
    n_bb = n_rows * 0  # elements of B loaded
    for p in range(start, end):
        ta = tl.load(pair_a_ptr + p)
        k = tl.load(pair_k_ptr + p)
        k_ok = k * BLOCK_K + offs_k < size_k
        b_ids = _d_ids(bmap_ptr, k, NUM_N_TILES)
        both = _shared(c_ids, b_ids, NUM_N_TILES)
        a = tl.load(_tile_ptrs(a_ptr, ta, offs_m, offs_k, a_nb, stride_a_ta, stride_a_tb, stride_a_r, stride_a_c),
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b_tiles, b_cols = _load_d_tiles(b_ptr, b_ids, both, offs_k, k_ok, offs_bn, b_nb, stride_b_ta, stride_b_tb,
                                        stride_b_r, stride_b_c, size_n, BLOCK_N, NUM_N_TILES)
        acc = _acc_d_tiles(acc, a, b_tiles, both, IEEE, NUM_N_TILES)
        if COUNT_IO:
            n_k = _nsum(k_ok)
            n_ab += n_rows * n_k
            n_bb += n_k * b_cols
    _store_d_tiles(c_ptr, c_ids, acc, offs_m, row_ok, offs_bn, c_nb, stride_c_ta, stride_c_tb, stride_c_r, stride_c_c,
                   size_n, BLOCK_N, NUM_N_TILES)
    c_cols = 0
    for t in tl.static_range(NUM_N_TILES):
        width = tl.where(c_ids[t] >= 0, tl.minimum(BLOCK_N, size_n - t * BLOCK_N), 0)
        c_cols += width
        if WRITE_COLSUM:  # column sums of the stored (rounded) values; rows outside the matrix are 0
            colsum = tl.sum(acc[t].to(c_ptr.dtype.element_ty).to(tl.float32), axis=0)  # [BLOCK_N]
            tl.store(colsum_ptr + i * stride_colsum_blk + t * BLOCK_N + offs_bn, colsum, mask=offs_bn < width)
    if COUNT_IO:
        tl.atomic_add(io_ptr + 0, n_ab * (a_ptr.dtype.element_ty.primitive_bitwidth // 8))
        tl.atomic_add(io_ptr + 2, n_bb * (b_ptr.dtype.element_ty.primitive_bitwidth // 8))
        tl.atomic_add(io_ptr + 5, n_rows * c_cols * (c_ptr.dtype.element_ty.primitive_bitwidth // 8))
        if WRITE_COLSUM:
            tl.atomic_add(io_ptr + 7, c_cols.to(tl.int64) * 4)
        n_pairs = (end - start).to(tl.int64)
        tl.atomic_add(io_ptr + 8, (1 + n_pairs) * 4 * NUM_N_TILES + (2 + 2 * n_pairs) * 4)


@triton.jit
def _paper_attn_fwd_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, hsum_ptr, o_ptr, lse_ptr,
    kept_crow_ptr, kept_col_ptr, zero_crow_ptr, zero_col_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c,
    stride_hn, stride_hd, stride_hsum_blk, stride_om, stride_od,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per query block ``i``: online softmax over the kept score blocks of row ``i`` plus
    the structurally zero blocks (score 0, counted ``cnt`` times, values summed in ``hsum``). Q's
    stored d-tiles are held for the whole program; per kept block only the d-tiles of A2 stored in
    both rows are read and multiplied. Counter slots: q, a2, h, hsum, o, lse, q_map, a2_map, layout."""
    i = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    row_ok = rows < seqlen_q
    dv_ok = offs_dv < head_dim_v
    n_rows = _nsum(row_ok)
    n_dv = _nsum(dv_ok)
    q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
    q_tiles, q_cols = _load_d_tiles(q_ptr, q_ids, _shared(q_ids, q_ids, NUM_D_TILES), offs_m, row_ok, offs_bd, q_nb,
                                    stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim, BLOCK_D, NUM_D_TILES)
    n_a2 = n_rows * 0
    n_h = n_rows * 0
    n_kept = n_rows * 0
    b_layout = n_rows * 0 + 8
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
            hz += tl.load(hsum_ptr + j * stride_hsum_blk + offs_dv, mask=dv_ok, other=0.0)  # [DV_PAD]
            cnt += tl.minimum(BLOCK_N, seqlen_k - j * BLOCK_N).to(tl.float32)
        # a virtual key of score 0 with multiplicity cnt and summed value hz
        m_i = tl.where(cnt > 0, 0.0, m_i)
        l_i = l_i + cnt
        acc = acc + hz[None, :]
        b_layout += 8 + 4 * (ze - zs).to(tl.int64)
    ks = tl.load(kept_crow_ptr + i)
    ke = tl.load(kept_crow_ptr + i + 1)
    for p in range(ks, ke):
        j = tl.load(kept_col_ptr + p)
        keys = j * BLOCK_N + offs_n
        key_ok = keys < seqlen_k
        a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        a2_tiles, a2_cols = _load_d_tiles(a2_ptr, a2_ids, both, offs_n, key_ok, offs_bd, a2_nb, stride_a2_ta,
                                          stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D, NUM_D_TILES)
        s = _scores(q_tiles, a2_tiles, both, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE, NUM_D_TILES)
        s = s * sm_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                    mask=key_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
        acc = _dot(pr.to(h.dtype), h, acc * alpha[:, None], IEEE)  # [BLOCK_M, DV_PAD]
        m_i = m_new
        if COUNT_IO:
            n_k = _nsum(key_ok)
            n_a2 += n_k * a2_cols
            n_h += n_k * n_dv
            n_kept += 1
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + rows[:, None] * stride_om + offs_dv[None, :] * stride_od, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if COUNT_IO:
        es = q_ptr.dtype.element_ty.primitive_bitwidth // 8
        tl.atomic_add(io_ptr + 0, n_rows * q_cols * es)
        tl.atomic_add(io_ptr + 2, n_a2 * es)
        tl.atomic_add(io_ptr + 4, n_h * es)
        if HAS_ZERO:
            tl.atomic_add(io_ptr + 6, (ze - zs).to(tl.int64) * n_dv * 4)
        tl.atomic_add(io_ptr + 9, n_rows * n_dv * es)
        tl.atomic_add(io_ptr + 11, n_rows * 4)
        tl.atomic_add(io_ptr + 12, n_rows * 0 + 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 14, n_kept * 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 16, b_layout + 4 * (ke - ks).to(tl.int64))


@triton.jit
def _paper_attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, lse_ptr, delta_ptr, w_ptr,
    stride_om, stride_od, stride_dom, stride_dod, stride_w_blk,
    seqlen_q, head_dim_v,
    io_ptr,
    BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` (fp32 ``[seqlen_q]``); with ``HAS_ZERO`` also
    ``w[i] = sum_rows exp(-lse) dO`` (fp32 ``[nqb, DV]``), the weight a structurally zero score block
    of query block ``i`` sends to the value gradient. Counter slots: o, do, lse, delta, w."""
    i = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    row_ok = rows < seqlen_q
    dv_ok = offs_dv < head_dim_v
    msk = row_ok[:, None] & dv_ok[None, :]
    o = tl.load(o_ptr + rows[:, None] * stride_om + offs_dv[None, :] * stride_od, mask=msk, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod, mask=msk, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=row_ok)
    if HAS_ZERO:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))
        wr = tl.where(lse < float("inf"), tl.exp(-lse), 0.0)  # [BLOCK_M]; 0 on empty rows (lse = -inf)
        wr = tl.where(lse > float("-inf"), wr, 0.0)
        tl.store(w_ptr + i * stride_w_blk + offs_dv, tl.sum(wr[:, None] * do, axis=0), mask=dv_ok)
    if COUNT_IO:
        n = _nsum(row_ok) * _nsum(dv_ok)
        es = o_ptr.dtype.element_ty.primitive_bitwidth // 8
        tl.atomic_add(io_ptr + 0, n * es)
        tl.atomic_add(io_ptr + 2, n * (do_ptr.dtype.element_ty.primitive_bitwidth // 8))
        tl.atomic_add(io_ptr + 7, _nsum(row_ok) * 4)
        if HAS_ZERO:
            tl.atomic_add(io_ptr + 4, _nsum(row_ok) * 4)
            tl.atomic_add(io_ptr + 9, _nsum(dv_ok) * 4)


@triton.jit
def _paper_attn_bwd_dkv_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, do_ptr, lse_ptr, delta_ptr, w_ptr, da2_ptr, dh_ptr,
    kept_ccol_ptr, kept_row_ptr, zero_ccol_ptr, zero_row_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c,
    stride_hn, stride_hd, stride_dom, stride_dod, stride_w_blk, stride_dhn, stride_dhd,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per key block ``j``: ``dH[j] = sum_i P_ij^T dO_i`` (+ the structurally zero blocks'
    ``w``) and ``dA2[j] = sum_i dS_ij^T Q_i`` on A2's stored tiles (``da2`` has A2's addressing). A2's
    stored d-tiles and their dA2 accumulators are held per d-tile; per kept block only the Q d-tiles
    stored in both rows are read, and only they enter ``S`` and ``dA2``.
    Counter slots: q, a2, h, do, lse, delta, w, da2, dh, q_map, a2_map, layout."""
    j = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    keys = j * BLOCK_N + offs_n
    key_ok = keys < seqlen_k
    dv_ok = offs_dv < head_dim_v
    n_k = _nsum(key_ok)
    n_dv = _nsum(dv_ok)
    a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
    a2_tiles, a2_cols = _load_d_tiles(a2_ptr, a2_ids, _shared(a2_ids, a2_ids, NUM_D_TILES), offs_n, key_ok, offs_bd,
                                      a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D,
                                      NUM_D_TILES)
    h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                mask=key_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
    dh = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    da2 = _zero_d_tiles(BLOCK_N, BLOCK_D, NUM_D_TILES)  # tuple of [BLOCK_N, BLOCK_D]
    n_q = n_k * 0
    n_rows_all = n_k * 0
    n_kept = n_k * 0
    b_layout = n_k * 0 + 8
    ks = tl.load(kept_ccol_ptr + j)
    ke = tl.load(kept_ccol_ptr + j + 1)
    for p in range(ks, ke):
        i = tl.load(kept_row_ptr + p)
        rows = i * BLOCK_M + offs_m
        row_ok = rows < seqlen_q
        q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        q_tiles, q_cols = _load_d_tiles(q_ptr, q_ids, both, offs_m, row_ok, offs_bd, q_nb, stride_q_ta, stride_q_tb,
                                        stride_q_r, stride_q_c, head_dim, BLOCK_D, NUM_D_TILES)
        do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_M, DV_PAD]
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        s = _scores(q_tiles, a2_tiles, both, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE, NUM_D_TILES)
        s = s * sm_scale  # [BLOCK_M, BLOCK_N]
        pr = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(s - lse[:, None]), 0.0)
        dh = _dot(tl.trans(pr.to(do.dtype)), do, dh, IEEE)  # [BLOCK_N, DV_PAD]
        dp = _dot(do, tl.trans(h), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)  # [BLOCK_M, BLOCK_N]
        ds = pr * (dp - delta[:, None]) * sm_scale
        da2 = _acc_d_tiles(da2, tl.trans(ds.to(q_ptr.dtype.element_ty)), q_tiles, both, IEEE, NUM_D_TILES)
        if COUNT_IO:
            n_r = _nsum(row_ok)
            n_q += n_r * q_cols
            n_rows_all += n_r
            n_kept += 1
    if HAS_ZERO:
        zs = tl.load(zero_ccol_ptr + j)
        ze = tl.load(zero_ccol_ptr + j + 1)
        wz = tl.zeros([DV_PAD], dtype=tl.float32)
        for p in range(zs, ze):
            i = tl.load(zero_row_ptr + p)
            wz += tl.load(w_ptr + i * stride_w_blk + offs_dv, mask=dv_ok, other=0.0)
        dh += wz[None, :]
        b_layout += 8 + 4 * (ze - zs).to(tl.int64)
    tl.store(dh_ptr + keys[:, None] * stride_dhn + offs_dv[None, :] * stride_dhd, dh.to(dh_ptr.dtype.element_ty),
             mask=key_ok[:, None] & dv_ok[None, :])
    _store_d_tiles(da2_ptr, a2_ids, da2, offs_n, key_ok, offs_bd, a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r,
                   stride_a2_c, head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        es = q_ptr.dtype.element_ty.primitive_bitwidth // 8
        n_a2 = n_k * a2_cols
        tl.atomic_add(io_ptr + 0, n_q * es)
        tl.atomic_add(io_ptr + 2, n_a2 * es)
        tl.atomic_add(io_ptr + 4, n_k * n_dv * es)
        tl.atomic_add(io_ptr + 6, n_rows_all * n_dv * es)
        tl.atomic_add(io_ptr + 8, n_rows_all * 4)
        tl.atomic_add(io_ptr + 10, n_rows_all * 4)
        if HAS_ZERO:
            tl.atomic_add(io_ptr + 12, (ze - zs).to(tl.int64) * n_dv * 4)
        tl.atomic_add(io_ptr + 15, n_a2 * es)
        tl.atomic_add(io_ptr + 17, n_k * n_dv * es)
        tl.atomic_add(io_ptr + 18, n_kept * 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 20, n_k * 0 + 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 22, b_layout + 4 * (ke - ks).to(tl.int64))


@triton.jit
def _paper_attn_bwd_dq_kernel(
    q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    kept_crow_ptr, kept_col_ptr,
    q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c,
    a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c,
    stride_hn, stride_hd, stride_dom, stride_dod,
    seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    io_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    DV_PAD: tl.constexpr, IEEE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One program per query block ``i``: ``dQ[i] = sum_j dS_ij A2_j`` on Q's stored tiles (``dq`` has
    Q's addressing). Structurally zero score blocks add nothing to dQ on Q's pattern. Q's stored
    d-tiles and their dQ accumulators are held per d-tile; per kept block only the A2 d-tiles stored
    in both rows are read, and only they enter ``S`` and ``dQ``.
    Counter slots: q, a2, h, do, lse, delta, dq, q_map, a2_map, layout."""
    i = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV_PAD)
    rows = i * BLOCK_M + offs_m
    row_ok = rows < seqlen_q
    dv_ok = offs_dv < head_dim_v
    n_rows = _nsum(row_ok)
    n_dv = _nsum(dv_ok)
    q_ids = _d_ids(qmap_ptr, i, NUM_D_TILES)
    q_tiles, q_cols = _load_d_tiles(q_ptr, q_ids, _shared(q_ids, q_ids, NUM_D_TILES), offs_m, row_ok, offs_bd, q_nb,
                                    stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim, BLOCK_D, NUM_D_TILES)
    do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_M, DV_PAD]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    dq = _zero_d_tiles(BLOCK_M, BLOCK_D, NUM_D_TILES)  # tuple of [BLOCK_M, BLOCK_D]
    n_a2 = n_rows * 0
    n_h = n_rows * 0
    n_kept = n_rows * 0
    ks = tl.load(kept_crow_ptr + i)
    ke = tl.load(kept_crow_ptr + i + 1)
    for p in range(ks, ke):
        j = tl.load(kept_col_ptr + p)
        keys = j * BLOCK_N + offs_n
        key_ok = keys < seqlen_k
        a2_ids = _d_ids(a2map_ptr, j, NUM_D_TILES)
        both = _shared(q_ids, a2_ids, NUM_D_TILES)
        a2_tiles, a2_cols = _load_d_tiles(a2_ptr, a2_ids, both, offs_n, key_ok, offs_bd, a2_nb, stride_a2_ta,
                                          stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_D, NUM_D_TILES)
        h = tl.load(h_ptr + keys[:, None] * stride_hn + offs_dv[None, :] * stride_hd,
                    mask=key_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
        s = _scores(q_tiles, a2_tiles, both, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE, NUM_D_TILES)
        s = s * sm_scale  # [BLOCK_M, BLOCK_N]
        pr = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(h), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)  # [BLOCK_M, BLOCK_N]
        ds = pr * (dp - delta[:, None]) * sm_scale
        dq = _acc_d_tiles(dq, ds.to(a2_ptr.dtype.element_ty), a2_tiles, both, IEEE, NUM_D_TILES)
        if COUNT_IO:
            n_kk = _nsum(key_ok)
            n_a2 += n_kk * a2_cols
            n_h += n_kk * n_dv
            n_kept += 1
    _store_d_tiles(dq_ptr, q_ids, dq, offs_m, row_ok, offs_bd, q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c,
                   head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        es = q_ptr.dtype.element_ty.primitive_bitwidth // 8
        n_qe = n_rows * q_cols
        tl.atomic_add(io_ptr + 0, n_qe * es)
        tl.atomic_add(io_ptr + 2, n_a2 * es)
        tl.atomic_add(io_ptr + 4, n_h * es)
        tl.atomic_add(io_ptr + 6, n_rows * n_dv * es)
        tl.atomic_add(io_ptr + 8, n_rows * 4)
        tl.atomic_add(io_ptr + 10, n_rows * 4)
        tl.atomic_add(io_ptr + 13, n_qe * es)
        tl.atomic_add(io_ptr + 14, n_rows * 0 + 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 16, n_kept * 4 * NUM_D_TILES)
        tl.atomic_add(io_ptr + 18, 8 + 4 * (ke - ks).to(tl.int64))
