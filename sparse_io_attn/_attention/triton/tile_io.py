"""``@triton.jit`` helpers that move the ``[rows, HEAD_DIM]`` and ``[rows, HEAD_DIM_V]`` tiles every attention
kernel reads and writes, one per mechanism:

* :func:`load_row_pair`: two tiles at the same rows of two tensors (``k`` and ``v`` of a key tile, ``q``
  and ``do`` of a query tile: the first of Q/K's head dim, the second of V's), masked or not;
* :func:`store_dkdv`: a dK/dV program's ``dk * sm_scale`` (Q/K's head dim) and ``dv`` (V's) at its key rows;
* :func:`value_lanes`: V's head-dim lanes and their mask (Q/K's where its head dim is theirs)."""
from __future__ import annotations

import sparse_io_attn._triton.jit  # noqa: F401  (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def value_lanes(offs_d, mask_d, head_dim_v, HEAD_DIM_V: tl.constexpr, DV_IS_D: tl.constexpr):
    """``(offs_dv, mask_dv)``: V's ``HEAD_DIM_V`` head-dim lanes and those inside ``head_dim_v``; ``DV_IS_D`` (V's
    head dim is Q/K's): Q/K's ``(offs_d, mask_d)`` themselves, one mask for both as before V had a head dim of
    its own (a second mask live beside the tiles spills sm_90 compiles: the key-major forward at head dim 80,
    the block-sparse dK/dV's 128 x 128 tiles at 64)."""
    if DV_IS_D:
        offs_dv, mask_dv = offs_d, mask_d
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V)
        mask_dv = offs_dv < head_dim_v
    return offs_dv, mask_dv


@triton.jit
def load_row_pair(a_base, b_base, rows, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_an, stride_ad, stride_bn,
                  stride_bd, MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """``(a, b)``: rows ``rows`` of two tensors (``a [len(rows), HEAD_DIM]`` over the head-dim lanes ``offs_d``,
    ``b [len(rows), HEAD_DIM_V]`` over ``offs_dv``; ``a_base`` / ``b_base`` the program's slice, ``stride_*n`` /
    ``stride_*d`` their row and head-dim strides). ``MASK_N``: only the rows of ``mask_n`` are loaded (the
    others 0); otherwise every row, the head dims masked unless ``EVEN_D`` (both head dims unpadded: the
    unmasked loads of full blocks, no bounds checks)."""
    a_ptrs = a_base + rows[:, None] * stride_an + offs_d[None, :] * stride_ad
    b_ptrs = b_base + rows[:, None] * stride_bn + offs_dv[None, :] * stride_bd
    if MASK_N:
        a = tl.load(a_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
    elif EVEN_D:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=mask_d[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_dv[None, :], other=0.0)
    return a, b


@triton.jit
def store_dkdv(dk_base, dv_base, dk, dv, rows, mask_n, offs_d, mask_d, offs_dv, mask_dv, stride_dkn, stride_dkd,
               stride_dvn, stride_dvd, sm_scale):
    """A dK/dV program's results at key rows ``rows`` (``mask_n`` those inside the keys): ``dk * sm_scale``
    (``dk [rows, HEAD_DIM]`` accumulated from base-2 scores without the scale) and ``dv [rows, HEAD_DIM_V]``,
    in the tensors' dtypes."""
    tl.store(dk_base + rows[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * sm_scale).to(dk_base.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
    tl.store(dv_base + rows[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(dv_base.dtype.element_ty), mask=mask_n[:, None] & mask_dv[None, :])


__all__ = ["load_row_pair", "store_dkdv", "value_lanes"]
