"""Block-sparse attention forward kernel (``@triton.jit`` only; the launcher is :mod:`.block_sparse`).

One program per (query tile of ``BLOCK_M`` rows, batch x query head). It walks the CSR list of kept
key blocks of its layout row and, inside each kept block of ``BLOCK_SIZE_KV`` keys, the key tiles of
``BLOCK_N`` keys (the kernel tile divides the layout block). Online softmax in base 2 with
``sm_scale * log2(e)`` folded into the scores; fp32 accumulators. Writes ``o`` (input dtype) and
``lse`` (fp32, natural log, ``-inf`` on rows with no allowed key, whose output is 0).

With ``COUNT_IO`` each program tallies the bytes it loads/stores per tensor (in-range lanes only)
and adds them to ``io_ptr`` once at its end; the tally is compiled out when ``COUNT_IO`` is off.
"""
from __future__ import annotations

from sparse_io_attn._triton.runtime import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _mm(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``DOT_FP32``: exact fp32 products (fp32 inputs, or the
    interpreter, whose bf16 ``tl.dot`` is wrong)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _causal_key_end(hi, m_start, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """End of the key range a query tile starting at ``m_start`` may see: with top-left causal
    masking, key tiles starting at or after ``m_start + BLOCK_M`` are fully masked and skipped."""
    if IS_CAUSAL:
        hi = tl.minimum(hi, m_start + BLOCK_M)
    return hi


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, crow_ptr, col_ptr, io_ptr,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
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
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seqlen_q
    mask_d = offs_d < head_dim

    q_base = q_ptr + off_z * stride_qz + off_h.to(tl.int64) * stride_qh
    k_base = k_ptr + off_z * stride_kz + off_hkv * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hkv * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM]

    # CSR row of this tile's layout mask (absolute offsets into col_indices)
    layout_id = off_z * stride_lb + off_h * stride_lh
    crow = crow_ptr + layout_id * (num_q_blocks + 1) + m_start // BLOCK_SIZE_Q
    start = tl.load(crow)
    end = tl.load(crow + 1)

    qk_scale = sm_scale * 1.4426950408889634  # scores in log2 units
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    keys_loaded = tl.full([], 0, tl.int64)

    for idx in range(start, end):
        lo = tl.load(col_ptr + idx) * BLOCK_SIZE_KV
        hi = _causal_key_end(tl.minimum(lo + BLOCK_SIZE_KV, seqlen_k), m_start, BLOCK_M, IS_CAUSAL)
        for n_start in range(lo, hi, BLOCK_N):
            cols = n_start + offs_n
            mask_n = cols < seqlen_k
            kT = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                         mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [HEAD_DIM, BLOCK_N]
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM]
            s = _mm(q, kT, DOT_FP32) * qk_scale  # [BLOCK_M, BLOCK_N]
            valid = mask_n[None, :]
            if IS_CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, DOT_FP32)  # [BLOCK_M, HEAD_DIM]
            m_i = m_new
            if COUNT_IO:
                keys_loaded += tl.minimum(seqlen_k - n_start, BLOCK_N)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_base = o_ptr + off_z * stride_oz + off_h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    tl.store(lse_ptr + pid_zh.to(tl.int64) * seqlen_q + offs_m, lse, mask=mask_m)

    if COUNT_IO:  # slots: q, k, v, o, lse, layout  (x2: read, write)
        rows = tl.minimum(seqlen_q - m_start, BLOCK_M).to(tl.int64)
        row_bytes = head_dim * ELEM_BYTES
        tl.atomic_add(io_ptr + 0, rows * row_bytes)
        tl.atomic_add(io_ptr + 2, keys_loaded * row_bytes)
        tl.atomic_add(io_ptr + 4, keys_loaded * row_bytes)
        tl.atomic_add(io_ptr + 7, rows * row_bytes)
        tl.atomic_add(io_ptr + 9, rows * 4)
        tl.atomic_add(io_ptr + 10, (2 + end - start).to(tl.int64) * 4)
