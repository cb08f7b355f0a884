"""I/O accounting: kernels count the bytes they move (:class:`IOCounter`, :class:`TrafficReport`,
defined in :mod:`sparse_io_attn.tally`), the traffic models predict them (:mod:`.traffic`, one
facade over the models), :func:`compare` sets either against the paper's bounds (one report, or one
per ``(batch element, head)``: :class:`HeadComparison`; :func:`selection_bound` gives Theorem 1.2 for
a per-token selection), :func:`compare_heads` does that per head for the batched sparse-operand
attention in one call, and :mod:`.allocations` probes peak allocations."""
from sparse_io_attn.accounting.compare import Comparison, HeadComparison, HeadTotal, compare, selection_bound
from sparse_io_attn.accounting.heads import compare_heads
from sparse_io_attn.tally import IOCounter, KernelTraffic, TrafficReport, counting, kernel_io

__all__ = ["IOCounter", "TrafficReport", "KernelTraffic", "Comparison", "HeadComparison", "HeadTotal", "compare",
           "compare_heads", "counting", "kernel_io", "selection_bound"]
