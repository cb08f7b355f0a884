"""The paper's I/O lower bounds as an API.

>>> import torch, sparse_io_attn.bounds as bounds
>>> b = bounds.dense_backward(8192, 128, "228KiB", dtype=torch.bfloat16)
>>> b.regime, b.binding
('large', 'large_cache')

``sparse`` is Theorem 4.5; ``sparse_informal`` is Theorem 1.2 / Table 1 (Z_input, Z_QK; dividing
point M = Z_input^2 / Z_QK). Inputs are finite reals (expected counts allowed); NumPy scalars work.

Every bound is the asymptotic (Θ/Ω) expression of its theorem evaluated with unit constants: the
paper states no constants. Compare measurements with ``max(compulsory, bound)`` (``Bound.floor_words``).
Units: words (matrix elements); ``Bound.bytes(dtype)`` converts.
"""
from sparse_io_attn.bounds.calculator import (LARGE_CACHE, SMALL_CACHE, Bound, dense_backward, dense_forward, sparse,
                         sparse_crossover, sparse_informal, sparse_informal_crossover)
from sparse_io_attn.bounds.devices import (DEFAULT_CPU_FAST_MEMORY_BYTES, DEVICES, DeviceSpec, Regime, device_fast_memory_bytes,
                      device_fast_memory_words, get_device, regime_for)
from sparse_io_attn.bounds.nnz import NnzStats, nnz_stats
from sparse_io_attn.bounds.units import dtype_name, itemsize, parse_memory

__all__ = ["Bound", "dense_backward", "dense_forward", "sparse", "sparse_crossover", "sparse_informal",
           "sparse_informal_crossover", "LARGE_CACHE",
           "SMALL_CACHE", "DEVICES", "DeviceSpec", "DEFAULT_CPU_FAST_MEMORY_BYTES", "Regime",
           "device_fast_memory_bytes", "device_fast_memory_words", "get_device", "regime_for",
           "NnzStats", "nnz_stats", "parse_memory", "itemsize", "dtype_name"]
