"""Block-sparse attention backward kernels (``@triton.jit`` only; the launcher is :mod:`.block_sparse`).

FlashAttention-2 style and deterministic (no atomics on data):

* ``_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` (fp32 ``[B, Hq, Nq]``).
* ``_attn_bwd_dkdv_kernel``: one program per (key tile, batch x kv head). For every query head of
  the GQA group it walks the CSC list (``ccol_indices``/``row_indices``) of query blocks that keep
  its key block, so dK/dV are summed over the group inside one program.
* ``_attn_bwd_dq_kernel``: one program per (query tile, batch x query head), walking the CSR list.

Probabilities are recomputed from ``lse`` (natural log, converted to base 2); rows with ``lse = -inf``
(no allowed key) and padded rows get ``p = 0``, hence zero gradients. ``COUNT_IO`` as in the forward.
"""
from __future__ import annotations

from sparse_io_attn._triton.runtime import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import triton
import triton.language as tl

from sparse_io_attn.block_sparse.triton.fwd import _causal_key_end, _mm


@triton.jit
def _load_lse2(lse_ptr, offs_m, mask_m):
    """Row lse in base-2 score units; ``+inf`` for empty and padded rows so that ``p = 0`` there."""
    lse = tl.load(lse_ptr + offs_m, mask=mask_m, other=0.0)
    return tl.where(mask_m & (lse != float("-inf")), lse * 1.4426950408889634, float("inf"))


@triton.jit
def _causal_query_start(lo, n_start, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """First query tile (tiles start at ``lo + t * BLOCK_M``) that a key tile starting at
    ``n_start`` can see: tiles with ``m_start + BLOCK_M <= n_start`` are fully masked and skipped."""
    if IS_CAUSAL:
        lo = lo + (tl.maximum(n_start - lo, 0) // BLOCK_M) * BLOCK_M
    return lo


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr, io_ptr,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    seqlen_q, num_heads_q, head_dim,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = (pid_zh // num_heads_q).to(tl.int64)
    off_h = (pid_zh % num_heads_q).to(tl.int64)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seqlen_q
    mask = mask_m[:, None] & (offs_d < head_dim)[None, :]
    o = tl.load(o_ptr + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)  # [BLOCK_M, HEAD_DIM]
    do = tl.load(do_ptr + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)  # [BLOCK_M, HEAD_DIM]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(delta_ptr + pid_zh.to(tl.int64) * seqlen_q + offs_m, delta, mask=mask_m)
    if COUNT_IO:  # slots: o, do, delta
        rows = tl.minimum(seqlen_q - m_start, BLOCK_M).to(tl.int64)
        tl.atomic_add(io_ptr + 0, rows * head_dim * ELEM_BYTES)
        tl.atomic_add(io_ptr + 2, rows * head_dim * ELEM_BYTES)
        tl.atomic_add(io_ptr + 5, rows * 4)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, ccol_ptr, row_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, num_kv_blocks,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, sm_scale,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_zg = tl.program_id(1)
    off_z = (pid_zg // num_heads_kv).to(tl.int64)
    off_g = (pid_zg % num_heads_kv).to(tl.int64)
    group = num_heads_q // num_heads_kv
    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < seqlen_k
    mask_d = offs_d < head_dim
    mask_nd = mask_n[:, None] & mask_d[None, :]

    k = tl.load(k_ptr + off_z * stride_kz + off_g * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
    v = tl.load(v_ptr + off_z * stride_vz + off_g * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    block_col = n_start // BLOCK_SIZE_KV
    queries_loaded = tl.full([], 0, tl.int64)
    index_entries = tl.full([], 0, tl.int64)

    for j in range(0, group):
        off_h = off_g * group + j
        q_base = q_ptr + off_z * stride_qz + off_h * stride_qh
        do_base = do_ptr + off_z * stride_doz + off_h * stride_doh
        row_base = (off_z * num_heads_q + off_h) * seqlen_q  # lse / delta are contiguous [B, Hq, Nq]
        ccol = ccol_ptr + (off_z * stride_lb + off_h * stride_lh) * (num_kv_blocks + 1) + block_col
        start = tl.load(ccol)
        end = tl.load(ccol + 1)
        for idx in range(start, end):
            lo = tl.load(row_ptr + idx) * BLOCK_SIZE_Q
            hi = tl.minimum(lo + BLOCK_SIZE_Q, seqlen_q)
            lo = _causal_query_start(lo, n_start, BLOCK_M, IS_CAUSAL)
            for m_start in range(lo, hi, BLOCK_M):
                offs_m = m_start + offs_m0
                mask_m = offs_m < seqlen_q
                mask_md = mask_m[:, None] & mask_d[None, :]
                q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                            mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
                do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                             mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
                lse2 = _load_lse2(lse_ptr + row_base, offs_m, mask_m)  # [BLOCK_M]
                delta = tl.load(delta_ptr + row_base + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
                sT = _mm(k, tl.trans(q), DOT_FP32) * qk_scale  # [BLOCK_N, BLOCK_M]
                valid = mask_m[None, :]
                if IS_CAUSAL:
                    valid = valid & (offs_m[None, :] >= offs_n[:, None])
                pT = tl.where(valid, tl.math.exp2(sT - lse2[None, :]), 0.0)  # [BLOCK_N, BLOCK_M]
                dv += _mm(pT.to(do.dtype), do, DOT_FP32)  # [BLOCK_N, HEAD_DIM]
                dpT = _mm(v, tl.trans(do), DOT_FP32)  # [BLOCK_N, BLOCK_M]
                dsT = pT * (dpT - delta[None, :])  # [BLOCK_N, BLOCK_M]
                dk += _mm(dsT.to(q.dtype), q, DOT_FP32)  # [BLOCK_N, HEAD_DIM]
                if COUNT_IO:
                    queries_loaded += tl.minimum(seqlen_q - m_start, BLOCK_M)
        if COUNT_IO:
            index_entries += 2 + end - start

    tl.store(dk_ptr + off_z * stride_dkz + off_g * stride_dkh + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask_nd)
    tl.store(dv_ptr + off_z * stride_dvz + off_g * stride_dvh + offs_n[:, None] * stride_dvn
             + offs_d[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty), mask=mask_nd)

    if COUNT_IO:  # slots: q, k, v, do, lse, delta, dk, dv, layout
        rows = tl.minimum(seqlen_k - n_start, BLOCK_N).to(tl.int64)
        row_bytes = head_dim * ELEM_BYTES
        tl.atomic_add(io_ptr + 0, queries_loaded * row_bytes)
        tl.atomic_add(io_ptr + 2, rows * row_bytes)
        tl.atomic_add(io_ptr + 4, rows * row_bytes)
        tl.atomic_add(io_ptr + 6, queries_loaded * row_bytes)
        tl.atomic_add(io_ptr + 8, queries_loaded * 4)
        tl.atomic_add(io_ptr + 10, queries_loaded * 4)
        tl.atomic_add(io_ptr + 13, rows * row_bytes)
        tl.atomic_add(io_ptr + 15, rows * row_bytes)
        tl.atomic_add(io_ptr + 16, index_entries * 4)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, crow_ptr, col_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, num_q_blocks,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim, sm_scale,
    BLOCK_SIZE_Q: tl.constexpr, BLOCK_SIZE_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, ELEM_BYTES: tl.constexpr, COUNT_IO: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = (pid_zh // num_heads_q).to(tl.int64)
    off_h = pid_zh % num_heads_q
    off_hkv = (off_h // (num_heads_q // num_heads_kv)).to(tl.int64)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seqlen_q
    mask_d = offs_d < head_dim
    mask_md = mask_m[:, None] & mask_d[None, :]

    q = tl.load(q_ptr + off_z * stride_qz + off_h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
    do = tl.load(do_ptr + off_z * stride_doz + off_h.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
    row_base = pid_zh.to(tl.int64) * seqlen_q
    lse2 = _load_lse2(lse_ptr + row_base, offs_m, mask_m)  # [BLOCK_M]
    delta = tl.load(delta_ptr + row_base + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh

    layout_id = off_z * stride_lb + off_h * stride_lh
    crow = crow_ptr + layout_id * (num_q_blocks + 1) + m_start // BLOCK_SIZE_Q
    start = tl.load(crow)
    end = tl.load(crow + 1)
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    keys_loaded = tl.full([], 0, tl.int64)

    for idx in range(start, end):
        lo = tl.load(col_ptr + idx) * BLOCK_SIZE_KV
        hi = _causal_key_end(tl.minimum(lo + BLOCK_SIZE_KV, seqlen_k), m_start, BLOCK_M, IS_CAUSAL)
        for n_start in range(lo, hi, BLOCK_N):
            cols = n_start + offs_n0
            mask_n = cols < seqlen_k
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
            s = _mm(q, tl.trans(k), DOT_FP32) * qk_scale  # [BLOCK_M, BLOCK_N]
            valid = mask_n[None, :]
            if IS_CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, tl.math.exp2(s - lse2[:, None]), 0.0)  # [BLOCK_M, BLOCK_N]
            dp = _mm(do, tl.trans(v), DOT_FP32)  # [BLOCK_M, BLOCK_N]
            ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
            dq += _mm(ds.to(k.dtype), k, DOT_FP32)  # [BLOCK_M, HEAD_DIM]
            if COUNT_IO:
                keys_loaded += tl.minimum(seqlen_k - n_start, BLOCK_N)

    tl.store(dq_ptr + off_z * stride_dqz + off_h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_md)

    if COUNT_IO:  # slots: q, k, v, do, lse, delta, dq, layout
        rows = tl.minimum(seqlen_q - m_start, BLOCK_M).to(tl.int64)
        row_bytes = head_dim * ELEM_BYTES
        tl.atomic_add(io_ptr + 0, rows * row_bytes)
        tl.atomic_add(io_ptr + 2, keys_loaded * row_bytes)
        tl.atomic_add(io_ptr + 4, keys_loaded * row_bytes)
        tl.atomic_add(io_ptr + 6, rows * row_bytes)
        tl.atomic_add(io_ptr + 8, rows * 4)
        tl.atomic_add(io_ptr + 10, rows * 4)
        tl.atomic_add(io_ptr + 13, rows * row_bytes)
        tl.atomic_add(io_ptr + 14, (2 + end - start).to(tl.int64) * 4)
