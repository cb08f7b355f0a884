"""Which backward to run: the paper's dividing point ``M = d^2`` (Theorem 1.1).

``M`` is the fast memory per program in words of the input dtype. By default it is the current
GPU's shared memory per block (:func:`sparse_io_attn.bounds.device_fast_memory_words`); without a
GPU, :data:`sparse_io_attn.bounds.DEFAULT_CPU_FAST_MEMORY_BYTES` (an H100's 227 KiB) divided by the
element size.
"""
from __future__ import annotations

import functools

import torch

from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.dense.tiling import min_large_cache_M

REGIMES = ("auto", "small", "large")


def default_M(dtype: torch.dtype, device=None) -> int:
    """Fast memory ``M`` in words of ``dtype`` for ``device`` (see the module docstring)."""
    from sparse_io_attn.bounds import DEFAULT_CPU_FAST_MEMORY_BYTES, device_fast_memory_words
    if device is not None and torch.device(device).type == "cuda":
        words = device_fast_memory_words(dtype, torch.device(device))
    else:
        words = None
    if words is None:
        words = DEFAULT_CPU_FAST_MEMORY_BYTES // itemsize(dtype)
    return int(words)


@functools.lru_cache(maxsize=None)
def _min_large(d: int, variant: str) -> int:
    return min_large_cache_M(d, variant)


def choose_regime(d: int, M: int, regime: str = "auto", variant: str = "faithful") -> str:
    """``"small"`` or ``"large"``.

    ``"auto"``: small-cache kernel when ``M < d^2``, large-cache kernel otherwise -- except when the
    large-cache ``variant`` cannot fit its tiles (and, for ``"faithful"``, the resident ``d x d``
    gradient) in ``M`` (``M < min_large_cache_M(d, variant)``, a small multiple of ``d^2`` for small
    ``d``), where the small-cache kernel runs instead.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if regime != "auto":
        return regime
    if M < d * d:
        return "small"
    return "large" if M >= _min_large(d, variant) else "small"
