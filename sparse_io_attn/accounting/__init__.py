"""I/O accounting: kernels count the bytes they move (:class:`IOCounter`), the traffic model
predicts them (:mod:`.traffic`), :func:`compare` sets either against the paper's bounds, and
:mod:`.pebble` executes the paper's algorithms in an exact two-level memory."""
from sparse_io_attn.accounting.compare import Comparison, compare
from sparse_io_attn.accounting.counter import IOCounter, counting, kernel_io
from sparse_io_attn.accounting.report import KernelTraffic, TrafficReport

__all__ = ["IOCounter", "TrafficReport", "KernelTraffic", "Comparison", "compare", "counting",
           "kernel_io"]
