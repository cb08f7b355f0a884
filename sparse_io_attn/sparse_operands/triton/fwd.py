"""The sparse-operand attention forward kernel (``@triton.jit`` only; shared helpers in :mod:`.common`,
the launcher is :func:`.launch.forward`): ``O = softmax(Q A2^T * scale) H`` over the kept and the
structurally zero score blocks (kernel ``paper_attn_fwd`` of the I/O report).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import LN2, LOG2E, dot, io_add, nbytes  # (sets TRITON_INTERPRET first)
from sparse_io_attn.sparse_operands.triton.common import (_attention_program, _entries, _io_operands, _kept_rows,
                                                          _own_rows, _scores)
from sparse_io_attn.sparse_operands.triton.slots import (FWD_A2, FWD_A2_MAP, FWD_H, FWD_HSUM, FWD_LAYOUT, FWD_LSE,
                                                         FWD_O, FWD_Q, FWD_Q_MAP)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


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
    ``-inf`` on rows with no key). Grid ``(query blocks, B * H)``: see :func:`.common._attention_program`.
    Counter slots: ``FWD_TENSORS`` (q, a2, h, hsum, o, lse, q_map, a2_map, layout)."""
    i, q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_start, zb, zh, gl, offs_dv, mask_dv = _attention_program(
        q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, head_dim_v, num_heads, tl.cdiv(seqlen_q, BLOCK_M),
        stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
        stride_a2map_gh, stride_hg, DV_PAD)
    hsum_ptr += gl * stride_hsum_g
    o_ptr += gl * stride_og
    lse_ptr += gl * stride_lse_g
    kept_crow_ptr += plan_start
    zero_crow_ptr += plan_start
    offs_m, rows, mask_m, mask_mdv, q_ids, q_tiles, q_bytes = _own_rows(
        q_ptr, qmap_ptr, i, seqlen_q, mask_dv, q_nb, stride_q_ta, stride_q_tb, stride_q_r, stride_q_c, head_dim,
        BLOCK_M, BLOCK_D, NUM_D_TILES)  # Q's d-tiles: tuple of [BLOCK_M, BLOCK_D]
    a2_bytes = tl.zeros([], dtype=tl.int64)
    h_bytes = tl.zeros([], dtype=tl.int64)
    n_kept = tl.zeros([], dtype=tl.int64)
    layout_bytes = tl.full([], 12, dtype=tl.int64)  # plan id, kept_crow[i], kept_crow[i + 1]
    qk_scale = sm_scale * LOG2E  # scores in base-2 units
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    if HAS_ZERO:
        zs, ze = _entries(zero_crow_ptr, i)
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
    ks, ke = _entries(kept_crow_ptr, i)
    for p in tl.range(ks, ke, num_stages=LOOP_STAGES):
        keys, mask_n, mask_ndv, both, a2_tiles, a2_read = _kept_rows(  # key block kept_col[p]; [BLOCK_N, BLOCK_D] tiles
            a2_ptr, a2map_ptr, tl.load(kept_col_ptr + p), 0, q_ids, seqlen_k, mask_dv, a2_nb, stride_a2_ta,
            stride_a2_tb, stride_a2_r, stride_a2_c, head_dim, BLOCK_N, BLOCK_N, BLOCK_D, NUM_D_TILES)
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
        _io_operands(io_ptr, FWD_Q, FWD_A2, FWD_H, FWD_Q_MAP, FWD_A2_MAP, FWD_LAYOUT, q_bytes, a2_bytes, h_bytes,
                     tl.full([], 1, dtype=tl.int64), n_kept, layout_bytes + 4 * (ke - ks).to(tl.int64), NUM_D_TILES)
        if HAS_ZERO:
            io_add(io_ptr, FWD_HSUM, (ze - zs).to(tl.int64) * nbytes(mask_dv, hsum_ptr), 0)
        io_add(io_ptr, FWD_O, 0, nbytes(mask_mdv, o_ptr))
        io_add(io_ptr, FWD_LSE, 0, nbytes(mask_m, lse_ptr))
