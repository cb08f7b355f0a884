"""Turning on the kernels' byte counters, and collecting what they counted.

Kernel side (the convention every ``COUNT_IO`` kernel follows): the launcher asks
:func:`kernel_io` for a slot before launching. When no :class:`IOCounter` is active it gets
``None`` and launches with ``COUNT_IO=False`` (the counting code is compiled out). Otherwise it
passes ``io.buffer`` (int64 ``[len(tensors), 2]``: bytes read, bytes written per tensor, row order
= the ``tensors`` tuple) as ``io_ptr`` with ``COUNT_IO=True``; each program tallies its loads and
stores in registers and adds them with one ``tl.atomic_add`` per entry at its end. After the
launch the launcher calls ``io.commit()``, which adds the buffer to every active counter.

A byte is counted when a program moves it between global memory and the program (masked-off lanes
are not counted; a tile re-read by the same program is counted again). This is the traffic of the
paper's two-level model with fast memory = one program's registers/shared memory.

Network level (collectives between ranks, e.g. context parallelism's K/V exchange): the code that
starts a collective calls :func:`count_network` with the bytes this rank sends and receives per
tensor; every active counter adds them to its ``network`` report (a :class:`TrafficReport` whose
"kernels" are collectives, bytes received counted as read into this rank, bytes sent as written
out of it). Kernel counts (``report``) are unchanged by it.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from sparse_io_attn.tally.report import TrafficReport

# One stack for the whole process, not per thread: the autograd engine runs a CUDA backward on its
# own device thread, so a thread-local stack would miss every backward launch on GPU (seen on an
# H200: only attn_fwd counted). Open counters count launches from any thread of the process.
_STACK: list = []
_LOCK = threading.Lock()


def _stack() -> list:
    return _STACK


class IOCounter:
    """``with IOCounter() as io: ...`` counts the bytes of every kernel launched inside the block.

    ``io.report`` is a :class:`TrafficReport` (per kernel, per tensor bytes read and written).
    Counters nest: an inner block's launches are also added to the outer counters. A counter counts
    the launches of every thread of the process while it is open (a CUDA backward runs on the
    autograd engine's own thread).
    ``io.network`` is the network level: bytes this process's collectives received (read) and sent
    (written), per collective and tensor (:func:`count_network`).
    """

    def __init__(self):
        self.report = TrafficReport(source="counted")
        self.network = TrafficReport(source="counted")

    def __enter__(self) -> "IOCounter":
        with _LOCK:
            _STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _STACK.remove(self)

    def reset(self) -> None:
        self.report = TrafficReport(source="counted")
        self.network = TrafficReport(source="counted")


def counting() -> bool:
    """True inside an :class:`IOCounter` block."""
    return bool(_stack())


class KernelIO:
    """The counter slot of one kernel launch (see the module docstring)."""

    def __init__(self, kernel: str, tensors: Sequence[str], device):
        self.kernel = kernel
        self.tensors = tuple(tensors)
        self.buffer = torch.zeros(len(self.tensors), 2, dtype=torch.int64, device=device)

    def commit(self) -> None:
        counts = self.buffer.cpu().tolist()
        reads = {t: int(c[0]) for t, c in zip(self.tensors, counts)}
        writes = {t: int(c[1]) for t, c in zip(self.tensors, counts)}
        for counter in tuple(_stack()):
            counter.report.add(self.kernel, reads, writes)


def kernel_io(kernel: str, tensors: Sequence[str], device) -> KernelIO | None:
    """A fresh counter slot for one launch of ``kernel``, or ``None`` when nothing is counting."""
    return KernelIO(kernel, tensors, device) if counting() else None


def count_network(collective: str, sent: dict, received: dict) -> None:
    """Add one collective's bytes (``{tensor: bytes}`` this rank sent and received) to the ``network``
    report of every active counter (nothing when none is active)."""
    for counter in tuple(_stack()):
        counter.network.add(collective, received, sent)
