"""Compile-time shape rules shared by the kernel families and their traffic models (pure Python,
no Triton import): ``tl.arange``/``tl.dot`` extents are powers of two of at least 16."""
from __future__ import annotations

MIN_TILE = 16  # tl.dot needs every tile extent >= 16


def next_pow2(x: int) -> int:
    """Smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, int(x) - 1).bit_length()


def padded_dim(d: int) -> int:
    """A ``HEAD_DIM``-style constexpr for a runtime extent ``d``: the next power of two, at least
    :data:`MIN_TILE`; lanes past ``d`` are masked in the kernels."""
    return max(MIN_TILE, next_pow2(d))
