"""Former name of :mod:`sparse_io_attn.experiments.pebble` (the two-level-memory executor), kept as a re-export.

The executor was renamed there; its block helpers are ``pebble_small_cache_block`` and
``pebble_large_cache_blocks`` (formerly ``small_cache_block`` / ``large_cache_blocks``), re-exported
here under both names.
"""
from sparse_io_attn.experiments.pebble import (
    TwoLevelMemory, CapacityError, NotResidentError, IOCount, PebbleRun, algorithm1, algorithm2, algorithm3,
    algorithm4, algorithm5, algorithm6, algorithm7, algorithm8, algorithm8_fa2, algorithm9,
    pebble_small_cache_block, pebble_large_cache_blocks, small_cache_io, large_cache_io, small_cache_counts,
    large_cache_counts, large_cache_peak, small_cache_m_independent, algorithm1_counts, algorithm7_counts,
    algorithm8_counts, run_small_cache, run_large_cache, run_no_cache, small_cache_forward,
    small_forward_counts, small_forward_io, small_forward_m_independent, run_small_cache_forward)
from sparse_io_attn.experiments.pebble import pebble_large_cache_blocks as large_cache_blocks
from sparse_io_attn.experiments.pebble import pebble_small_cache_block as small_cache_block

__all__ = ["TwoLevelMemory", "CapacityError", "NotResidentError", "IOCount", "PebbleRun", "algorithm1", "algorithm2",
           "algorithm3", "algorithm4", "algorithm5", "algorithm6", "algorithm7", "algorithm8",
           "algorithm8_fa2", "algorithm9", "pebble_small_cache_block", "pebble_large_cache_blocks",
           "small_cache_io", "large_cache_io", "small_cache_counts", "large_cache_counts", "large_cache_peak",
           "small_cache_m_independent", "algorithm1_counts", "algorithm7_counts", "algorithm8_counts",
           "run_small_cache", "run_large_cache", "run_no_cache", "small_cache_forward",
           "small_forward_counts", "small_forward_io", "small_forward_m_independent",
           "run_small_cache_forward", "small_cache_block", "large_cache_blocks"]
