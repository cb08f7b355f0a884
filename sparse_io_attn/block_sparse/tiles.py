"""Kernel tile sizes of the block-sparse Triton kernels, chosen from shapes and dtype only.

The launcher (:mod:`.triton.launch`) and the traffic model (:mod:`.traffic`) both call
:func:`choose_tiles`, so the model always describes the tiles actually launched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn._triton.shapes import MIN_TILE, padded_dim
from sparse_io_attn.bounds.units import itemsize

MAX_HEAD_DIM = 256
@dataclass(frozen=True)
class KernelTiles:
    """Kernel tile sizes (elements). Each tile divides the layout block along its axis."""
    fwd: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_fwd
    dq: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_bwd_dq
    dkdv: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_bwd_dkdv
    preprocess: int  # BLOCK_M of attn_bwd_preprocess (does not change the bytes)


def _pow2_divisor(n: int, cap: int) -> int:
    return min(n & -n, cap)


def padded_head_dim(head_dim: int) -> int:
    """``HEAD_DIM`` constexpr (:func:`~sparse_io_attn._triton.shapes.padded_dim`), after checking the
    kernels' head-dim range."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(f"backend 'triton' supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}; "
                                  f"use backend='torch'")
    return padded_dim(head_dim)


def choose_tiles(block_size, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> KernelTiles:
    """Kernel tiles for a layout block ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)``, head dim and input dtype.

    Each tile is the largest power of two that divides the layout block, capped by the bytes of a
    padded row (``HEAD_DIM * element size``) so that a program fits shared memory: <= 256 B (bf16/fp16
    up to head dim 128, fp32 up to 64): forward 128 x 64, backward 64 x 64; <= 512 B: forward 64 x 32,
    backward 32 x 32; above (fp32, head dim > 128): 32 x 32 everywhere.
    The choice depends on shapes and dtype only (not the device), so the traffic model and the
    launcher agree everywhere; autotuning on CUDA varies warps and stages only. Raises
    ``NotImplementedError`` when a layout block has no power-of-two divisor >= 16 (e.g. 8 or 24).
    """
    bq, bk = block_size
    wide = padded_head_dim(head_dim) * element_size(dtype)  # bytes per (padded) row
    if wide <= 256:
        caps = {"fwd": (128, 64), "dq": (64, 64), "dkdv": (64, 64)}
    elif wide <= 512:
        caps = {"fwd": (64, 32), "dq": (32, 32), "dkdv": (32, 32)}
    else:
        caps = {"fwd": (32, 32), "dq": (32, 32), "dkdv": (32, 32)}
    tiles = {}
    for kernel, (cap_m, cap_n) in caps.items():
        tm, tn = _pow2_divisor(bq, cap_m), _pow2_divisor(bk, cap_n)
        if min(tm, tn) < MIN_TILE:
            raise NotImplementedError(
                f"backend 'triton' needs layout block sizes with a power-of-two divisor >= {MIN_TILE} "
                f"(e.g. 16, 48, 64, 128), got block_size {(bq, bk)}; rebuild the layout or use backend='torch'")
        tiles[kernel] = (tm, tn)
    return KernelTiles(fwd=tiles["fwd"], dq=tiles["dq"], dkdv=tiles["dkdv"], preprocess=tiles["dq"][0])


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of a dtype the kernels take (float32, float16, bfloat16)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return itemsize(dtype)
