"""An exact two-level-memory (red-blue pebble) executor and the paper's Algorithms 1-9 on it.

* :class:`TwoLevelMemory`: fast memory of ``capacity`` words with explicit load/store/alloc/free/
  compute; raises :class:`CapacityError` / :class:`NotResidentError`; counts every word moved.
* Algorithms (NumPy, line by line from Appendices C and D): :func:`algorithm1`,
  :func:`algorithm2`-:func:`algorithm6` (small cache), :func:`algorithm7`-:func:`algorithm9`
  (large cache; ``variant="fa2"`` is Algorithm 8 in FlashAttention-2's loop order).
* Closed forms (words): :func:`small_cache_io`, :func:`large_cache_io` and the ``*_counts``
  functions (reads, writes, peak), equal to the executor's counts exactly.
* The small-cache forward (Saha & Ye; Table 1): :func:`small_cache_forward`, closed form
  :func:`small_forward_counts` / :func:`small_forward_io`.
* Runners: :func:`run_small_cache`, :func:`run_large_cache` put the inputs in slow memory, run, and
  return g = dL/dX (Definition 3.2) with the counts; :func:`run_small_cache_forward` returns O.

The algorithms are transcribed from the appendices one function per algorithm, and stay parallel
on purpose (``duplicates`` lists Algorithms 3 and 5, which walk the same tiles over different
matrices): each is read line by line against the paper, and its counts must equal its own closed form, so they are not folded into shared helpers.
"""
from sparse_io_attn.experiments.pebble.closed_form import (IOCount, algorithm1_counts, algorithm7_counts, algorithm8_counts, large_cache_counts,
                          large_cache_io, large_cache_peak, small_cache_counts, small_cache_io,
                          small_cache_m_independent, small_forward_counts, small_forward_io,
                          small_forward_m_independent)
from sparse_io_attn.experiments.pebble.executor import CapacityError, NotResidentError, TwoLevelMemory
from sparse_io_attn.experiments.pebble.algorithm9 import algorithm7, algorithm8, algorithm8_fa2, algorithm9, pebble_large_cache_blocks
from sparse_io_attn.experiments.pebble.runner import (PebbleRun, run_no_cache, run_large_cache, run_small_cache,
                                                 run_small_cache_forward)
from sparse_io_attn.experiments.pebble.algorithm6 import (algorithm1, algorithm2, algorithm3, algorithm4, algorithm5, algorithm6,
                          pebble_small_cache_block, small_cache_forward)

__all__ = ["TwoLevelMemory", "CapacityError", "NotResidentError", "IOCount", "PebbleRun",
           "algorithm1", "algorithm2", "algorithm3", "algorithm4", "algorithm5", "algorithm6",
           "algorithm7", "algorithm8", "algorithm8_fa2", "algorithm9", "pebble_small_cache_block",
           "pebble_large_cache_blocks", "small_cache_io", "large_cache_io", "small_cache_counts",
           "large_cache_counts", "large_cache_peak", "small_cache_m_independent", "algorithm1_counts",
           "algorithm7_counts", "algorithm8_counts", "run_small_cache",
           "run_large_cache", "run_no_cache", "small_cache_forward", "small_forward_counts", "small_forward_io",
           "small_forward_m_independent", "run_small_cache_forward"]
