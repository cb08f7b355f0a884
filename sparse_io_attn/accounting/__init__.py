"""I/O accounting: kernels count the bytes they move (:class:`IOCounter`), the traffic model
predicts them (:mod:`.traffic`), :func:`compare` sets either against the paper's bounds, and
:mod:`.pebble` executes the paper's algorithms in an exact two-level memory."""
from sparse_io_attn.accounting.compare import Comparison, compare
from sparse_io_attn.tally import IOCounter, KernelTraffic, TrafficReport, counting, kernel_io

__all__ = ["IOCounter", "TrafficReport", "KernelTraffic", "Comparison", "compare", "counting",
           "kernel_io"]
