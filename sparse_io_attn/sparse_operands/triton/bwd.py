"""The sparse-operand attention backward kernels (``@triton.jit`` only; shared helpers in
:mod:`.common`, the launcher is :func:`.launch.backward`), kernels ``paper_attn_bwd_preprocess``,
``paper_attn_bwd_dkv`` and ``paper_attn_bwd_dq`` of the I/O report:

* ``_paper_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` and the weights ``w`` of the
  structurally zero score blocks;
* ``_paper_attn_bwd_dkv_kernel``: ``dH`` and ``dA2`` per key block (the transposed form
  ``S^T = A2 Q^T``, over slices of each kept query block);
* ``_paper_attn_bwd_dq_kernel``: ``dQ`` per query block.

Probabilities are recomputed in base 2 from the forward's ``lse`` (natural log, converted with
``LOG2E``).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import LOG2E, dot, io_add, nbytes  # (sets TRITON_INTERPRET first)
from sparse_io_attn.sparse_operands.triton.common import (_acc_d_tiles, _attention_program, _entries, _grad_group,
                                                          _grad_rows, _io_operands, _kept_rows, _own_rows, _rows,
                                                          _scores, _store_d_tiles, _zero_d_tiles)
from sparse_io_attn.sparse_operands.triton.slots import (DKV_A2, DKV_A2_MAP, DKV_DA2, DKV_DELTA, DKV_DH, DKV_DO,
                                                         DKV_H, DKV_LAYOUT, DKV_LSE, DKV_Q, DKV_Q_MAP, DKV_W,
                                                         DQ_A2, DQ_A2_MAP, DQ_DELTA, DQ_DO, DQ_DQ, DQ_H, DQ_LAYOUT,
                                                         DQ_LSE, DQ_Q, DQ_Q_MAP, PRE_DELTA, PRE_DO, PRE_LSE, PRE_O,
                                                         PRE_W)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


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
    do_ptr, lse_ptr, delta_ptr = _grad_group(do_ptr, lse_ptr, delta_ptr, gl, stride_dog, stride_lse_g)
    w_ptr += gl * stride_w_g
    offs_dv = tl.arange(0, DV_PAD)
    mask_dv = offs_dv < head_dim_v
    _, rows, mask_m, mask_mdv = _rows(i, 0, seqlen_q, mask_dv, BLOCK_M, BLOCK_M)
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
    stored in both rows are read, and only they enter ``S`` and ``dA2``.
    A kept query block is processed in ``BLOCK_M // BLOCK_M_SUB`` slices of ``BLOCK_M_SUB`` rows, one
    loop iteration each (the loop runs over (kept block, slice) pairs; each slice reads its block's
    row id and Q block-map row), in the transposed form ``S^T = A2 Q^T``, ``dP^T = h dO^T``, so the
    key block's rows are every product's ``M``: the working set shrinks with the slice, not the data
    read (each Q, dO, lse, delta row still read once per kept block).
    Grid ``(key blocks, B * H)``: see :func:`.common._attention_program`; ``dh`` shares h's addressing,
    ``da2`` A2's apart from its group strides. Counter slots: ``DKV_TENSORS`` (q, a2, h, do, lse,
    delta, w, da2, dh, q_map, a2_map, layout)."""
    j, q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_start, zb, zh, gl, offs_dv, mask_dv = _attention_program(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, head_dim_v, num_heads, tl.cdiv(seqlen_k, BLOCK_N),
        stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
        stride_a2map_gh, stride_hg, DV_PAD)
    da2_ptr += zb * stride_da2_gb + zh * stride_da2_gh
    dh_ptr += gl * stride_hg
    w_ptr += gl * stride_w_g
    do_ptr, lse_ptr, delta_ptr = _grad_group(do_ptr, lse_ptr, delta_ptr, gl, stride_dog, stride_lse_g)
    kept_ccol_ptr += plan_start
    zero_ccol_ptr += plan_start
    offs_n, keys, mask_n, mask_ndv, a2_ids, a2_tiles, a2_bytes = _own_rows(
        a2_ptr, a2map_ptr, j, seqlen_k, mask_dv, a2_nb, stride_a2_ta, stride_a2_tb, stride_a2_r, stride_a2_c, head_dim,
        BLOCK_N, BLOCK_D, NUM_D_TILES)  # A2's d-tiles: tuple of [BLOCK_N, BLOCK_D]
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
    ks, ke = _entries(kept_ccol_ptr, j)
    SLICES: tl.constexpr = BLOCK_M // BLOCK_M_SUB
    for it in tl.range(ks * SLICES, ke * SLICES, num_stages=LOOP_STAGES):  # (kept block, slice of its rows)
        p = it // SLICES
        i = tl.load(kept_row_ptr + p)
        rows, mask_m, mask_mdv, both, q_tiles, q_read = _kept_rows(
            q_ptr, qmap_ptr, i, (it % SLICES) * BLOCK_M_SUB, a2_ids, seqlen_q, mask_dv, q_nb, stride_q_ta, stride_q_tb,
            stride_q_r, stride_q_c, head_dim, BLOCK_M, BLOCK_M_SUB, BLOCK_D,
            NUM_D_TILES)  # this slice's rows of Q's d-tiles: tuple of [BLOCK_M_SUB, BLOCK_D]
        do, lse2, delta = _grad_rows(do_ptr, lse_ptr, delta_ptr, rows, mask_m, mask_mdv, offs_dv, stride_dom,
                                     stride_dod)  # [BLOCK_M_SUB, DV_PAD], [BLOCK_M_SUB] twice
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
        zs, ze = _entries(zero_ccol_ptr, j)
        wz = tl.zeros([DV_PAD], dtype=tl.float32)
        for p in range(zs, ze):
            i = tl.load(zero_row_ptr + p)
            wz += tl.load(w_ptr + i * stride_w_blk + offs_dv, mask=mask_dv, other=0.0)  # [DV_PAD]
        dh += wz[None, :]
        layout_bytes += 8 + 4 * (ze - zs).to(tl.int64)
    tl.store(dh_ptr + keys[:, None] * stride_dhn + offs_dv[None, :] * stride_dhd, dh.to(dh_ptr.dtype.element_ty),
             mask=mask_ndv)
    da2_bytes = _store_d_tiles(da2_ptr, a2_ids, da2, offs_n, mask_n, a2_nb, stride_a2_ta, stride_a2_tb,
                               stride_a2_r, stride_a2_c, head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        n_slices = (ke - ks).to(tl.int64) * SLICES  # each slice reads its block's row id and Q block-map row
        _io_operands(io_ptr, DKV_Q, DKV_A2, DKV_H, DKV_Q_MAP, DKV_A2_MAP, DKV_LAYOUT, q_bytes, a2_bytes,
                     nbytes(mask_ndv, h_ptr), n_slices, tl.full([], 1, dtype=tl.int64), layout_bytes + 4 * n_slices,
                     NUM_D_TILES)
        io_add(io_ptr, DKV_DO, do_bytes, 0)
        io_add(io_ptr, DKV_LSE, lse_bytes, 0)
        io_add(io_ptr, DKV_DELTA, delta_bytes, 0)
        if HAS_ZERO:
            io_add(io_ptr, DKV_W, (ze - zs).to(tl.int64) * nbytes(mask_dv, w_ptr), 0)
        io_add(io_ptr, DKV_DA2, 0, da2_bytes)
        io_add(io_ptr, DKV_DH, 0, nbytes(mask_ndv, dh_ptr))


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
    in both rows are read, and only they enter ``S`` and ``dQ``.
    Grid ``(query blocks, B * H)``: see :func:`.common._attention_program`; ``dq`` has Q's group strides.
    Counter slots: ``DQ_TENSORS`` (q, a2, h, do, lse, delta, dq, q_map, a2_map, layout)."""
    i, q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_start, zb, zh, gl, offs_dv, mask_dv = _attention_program(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, head_dim_v, num_heads, tl.cdiv(seqlen_q, BLOCK_M),
        stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
        stride_a2map_gh, stride_hg, DV_PAD)
    dq_ptr += zb * stride_q_gb + zh * stride_q_gh
    do_ptr, lse_ptr, delta_ptr = _grad_group(do_ptr, lse_ptr, delta_ptr, gl, stride_dog, stride_lse_g)
    kept_crow_ptr += plan_start
    offs_m, rows, mask_m, mask_mdv, q_ids, q_tiles, q_bytes = _own_rows(
        q_ptr, qmap_ptr, i, seqlen_q, mask_dv, q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim,
        BLOCK_M, BLOCK_D, NUM_D_TILES)  # Q's d-tiles: tuple of [BLOCK_M, BLOCK_D]
    do, lse2, delta = _grad_rows(do_ptr, lse_ptr, delta_ptr, rows, mask_m, mask_mdv, offs_dv, stride_dom,
                                 stride_dod)  # [BLOCK_M, DV_PAD], [BLOCK_M] twice
    dq = _zero_d_tiles(BLOCK_M, BLOCK_D, NUM_D_TILES)  # tuple of [BLOCK_M, BLOCK_D]
    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    a2_bytes = tl.zeros([], dtype=tl.int64)
    h_bytes = tl.zeros([], dtype=tl.int64)
    n_kept = tl.zeros([], dtype=tl.int64)
    ks, ke = _entries(kept_crow_ptr, i)
    for p in tl.range(ks, ke, num_stages=LOOP_STAGES):
        keys, mask_n, mask_ndv, both, a2_tiles, a2_read = _kept_rows(  # key block kept_col[p]; [BLOCK_N, BLOCK_D] tiles
            a2_ptr, a2map_ptr, tl.load(kept_col_ptr + p), 0, q_ids, seqlen_k, mask_dv, a2_nb, stride_a2_ta,
            stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_N, BLOCK_N, BLOCK_D, NUM_D_TILES)
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
    dq_bytes = _store_d_tiles(dq_ptr, q_ids, dq, offs_m, mask_m, q_nb, stride_q_ta, stride_q_tb, stride_q_r,
                              stride_q_c, head_dim, BLOCK_D, NUM_D_TILES)
    if COUNT_IO:
        _io_operands(io_ptr, DQ_Q, DQ_A2, DQ_H, DQ_Q_MAP, DQ_A2_MAP, DQ_LAYOUT, q_bytes, a2_bytes, h_bytes,
                     tl.full([], 1, dtype=tl.int64), n_kept, 12 + 4 * (ke - ks).to(tl.int64), NUM_D_TILES)
        io_add(io_ptr, DQ_DO, nbytes(mask_mdv, do_ptr), 0)
        io_add(io_ptr, DQ_LSE, nbytes(mask_m, lse_ptr), 0)
        io_add(io_ptr, DQ_DELTA, nbytes(mask_m, delta_ptr), 0)
        io_add(io_ptr, DQ_DQ, 0, dq_bytes)
