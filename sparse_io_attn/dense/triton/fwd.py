"""Dense forward kernel (FlashAttention-style), ``@triton.jit`` only.

``O = softmax(scale * S A2^T) h`` with ``S = A1 X`` and ``h = A3 Y`` computed before by
:func:`~.common._proj_kernel`. One program per row block of ``BLOCK_M`` rows: it keeps
``S_i`` and the output accumulator, streams the key/value tiles ``A2_j, h_j`` of ``BLOCK_N`` rows,
and runs the online softmax (natural-log units). Writes ``O`` (output dtype) and
``lse = m + log(l)`` (fp32 ``[Z, n]``). Operands are contiguous ``[Z, n, d]``. Counter slots are
named by the roles :data:`~sparse_io_attn.dense.traffic.FWD_TENSORS` (see :mod:`.slots`).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import dot, io_add, nbytes

import triton
import triton.language as tl

from sparse_io_attn.dense.triton.common import _program, _rows
from sparse_io_attn.dense.triton.slots import FWD_A2, FWD_H, FWD_LSE, FWD_O, FWD_S


@triton.jit
def _dense_fwd_kernel(
    s_ptr, a2_ptr, h_ptr, o_ptr, lse_ptr, io_ptr,
    seqlen, head_dim, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, COUNT_IO: tl.constexpr,
):
    """One row block of ``O`` and ``lse``; counter slots :data:`~sparse_io_attn.dense.traffic.FWD_TENSORS`."""
    pid_m, off_z, base, offs_d, mask_d = _program(seqlen, head_dim, HEAD_DIM)
    offs_m, mask_m, mask_md, rows = _rows(base, pid_m * BLOCK_M, BLOCK_M, seqlen, head_dim, offs_d, mask_d)
    s = tl.load(s_ptr + rows, mask=mask_md, other=0.0)  # [BLOCK_M, HEAD_DIM]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rd_kv = tl.zeros([], dtype=tl.int64)
    rd_h = tl.zeros([], dtype=tl.int64)
    for n0 in range(0, seqlen, BLOCK_N):
        offs_n, mask_n, mask_nd, cols = _rows(base, n0, BLOCK_N, seqlen, head_dim, offs_d, mask_d)
        a2 = tl.load(a2_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
        h = tl.load(h_ptr + cols, mask=mask_nd, other=0.0)  # [BLOCK_N, HEAD_DIM]
        scores = dot(s, tl.trans(a2), None, DOT_DTYPE) * sm_scale  # [BLOCK_M, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(e, axis=1)
        acc = dot(e, h, acc * alpha[:, None], DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]
        m_i = m_new
        if COUNT_IO:
            rd_kv += nbytes(mask_nd, a2_ptr)
            rd_h += nbytes(mask_nd, h_ptr)
    o = acc / l_i[:, None]
    tl.store(o_ptr + rows, o.to(o_ptr.dtype.element_ty), mask=mask_md)
    tl.store(lse_ptr + off_z * seqlen + offs_m, m_i + tl.log(l_i), mask=mask_m)
    if COUNT_IO:
        io_add(io_ptr, FWD_S, nbytes(mask_md, s_ptr), 0)
        io_add(io_ptr, FWD_A2, rd_kv, 0)
        io_add(io_ptr, FWD_H, rd_h, 0)
        io_add(io_ptr, FWD_O, 0, nbytes(mask_md, o_ptr))
        io_add(io_ptr, FWD_LSE, 0, nbytes(mask_m, lse_ptr))
