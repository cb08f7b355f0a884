"""Ground floor of the accounting: the kernels' byte counters (:mod:`.counter`) and the report they
fill (:mod:`.report`). Everything that counts or predicts bytes imports these; they import nothing of
the package but each other. The public names are re-exported by :mod:`sparse_io_attn.accounting`."""
from sparse_io_attn.tally.counter import IOCounter, count_network, counting, kernel_io
from sparse_io_attn.tally.report import KernelTraffic, TrafficReport

__all__ = ["IOCounter", "count_network", "counting", "kernel_io", "KernelTraffic", "TrafficReport"]
