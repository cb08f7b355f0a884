"""I/O accounting: kernels count the bytes they move (:class:`IOCounter`), the traffic model
predicts them (:mod:`.traffic`), and :func:`compare` sets either against the paper's bounds."""
from .counter import IOCounter, counting, kernel_io
from .report import KernelTraffic, TrafficReport

__all__ = ["IOCounter", "TrafficReport", "KernelTraffic", "counting", "kernel_io"]
