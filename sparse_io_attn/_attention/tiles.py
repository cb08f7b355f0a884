"""Shape rules both attention ops' kernels share: the padded head dim, element sizes, and the
decode thresholds (one for every backend: the C++, Triton and torch forwards switch to their
split-K decode kernels at the same ``Nq``)."""
from __future__ import annotations

import torch

from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.bounds.units import itemsize

#: the largest head dim the Triton kernels take (Q/K's or V's): 576, the width of MLA's q/k rows
#: (DeepSeek's latent 512 + rope 64, FlashMLA's shapes), padded to 1024 lanes
MAX_HEAD_DIM = 576
#: padded row bytes (``HEAD_DIM * element bytes``) past which a row is *wide* (MLA's 576 in bf16, 512 and
#: up in fp32): the tiles that fit sm_90's shared memory there are the smallest (the block-sparse decode's
#: 32-key tiles, the selection op's query-major family)
WIDE_ROW_BYTES = 1024
#: query tokens up to which the forward runs the decode kernels (split-K over each row's keys)
DECODE_MAX_QUERIES = 16
DECODE_SPLIT_KEYS = 512     # keys a split holds at least (when the row has that many)
DECODE_MAX_SPLITS = 64
DECODE_TARGET_PROGRAMS = 264  # programs aimed at over all splits (two per SM of an H100)


def padded_head_dim(head_dim: int) -> int:
    """``HEAD_DIM`` (or ``HEAD_DIM_V``) constexpr (:func:`~sparse_io_attn._triton.shapes.padded_dim`), after
    checking the kernels' head-dim range."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(f"backend 'triton' supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}; "
                                  f"use backend='torch'")
    return padded_dim(head_dim)


def tile_head_dim(head_dim: int, head_dim_v: int | None = None) -> int:
    """The head dim the tiles are chosen for: the larger of Q/K's and V's (a row class holds both the
    ``[rows, HEAD_DIM]`` and ``[rows, HEAD_DIM_V]`` tiles; ``head_dim`` when V's is not given)."""
    return head_dim if head_dim_v is None else max(head_dim, head_dim_v)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of a dtype the kernels take (float32, float16, bfloat16)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return itemsize(dtype)


__all__ = ["DECODE_MAX_QUERIES", "DECODE_MAX_SPLITS", "DECODE_SPLIT_KEYS", "DECODE_TARGET_PROGRAMS",
           "MAX_HEAD_DIM", "WIDE_ROW_BYTES", "element_size", "padded_head_dim", "tile_head_dim"]
