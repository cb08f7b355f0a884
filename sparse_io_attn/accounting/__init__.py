"""I/O accounting: kernels count the bytes they move (:class:`IOCounter`, :class:`TrafficReport`,
defined in :mod:`sparse_io_attn.tally`), the traffic models predict them (:mod:`.traffic`, one
facade over the three), :func:`compare` sets either against the paper's bounds, and
:mod:`.allocations` probes peak allocations."""
from sparse_io_attn.accounting.compare import Comparison, compare
from sparse_io_attn.tally import IOCounter, KernelTraffic, TrafficReport, counting, kernel_io

__all__ = ["IOCounter", "TrafficReport", "KernelTraffic", "Comparison", "compare", "counting",
           "kernel_io"]
