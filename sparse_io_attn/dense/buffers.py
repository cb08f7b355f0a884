"""Global-memory buffers of the small-cache kernels: their sizes and the free-memory check."""
from __future__ import annotations

from sparse_io_attn.bounds.devices import available_memory_bytes

#: Host-memory budget for the ``n x n`` buffers when the free memory cannot be read (bytes).
CPU_MEMORY_CAP_BYTES = 16 * 1024 ** 3


def nn_buffer_bytes(n: int, d: int, batch: int = 1) -> int:
    """Global memory the small-cache backward allocates for ``f, q, p`` (``n x n`` each) and
    ``T`` (``d x n``), fp32, per call."""
    return batch * (3 * n * n + d * n) * 4


def free_memory_bytes(device) -> tuple[int, str]:
    """Memory free for the ``n x n`` buffers on ``device`` and where the figure comes from
    (:func:`~sparse_io_attn.bounds.devices.available_memory_bytes`, or
    :data:`CPU_MEMORY_CAP_BYTES` where it cannot be read)."""
    free, source = available_memory_bytes(device)
    if free is None:
        free, source = CPU_MEMORY_CAP_BYTES, "CPU_MEMORY_CAP_BYTES"
    return free, source


def check_buffers(need: int, device, what: str, instead: str) -> None:
    """Raise ``ValueError`` when ``need`` bytes exceed :func:`free_memory_bytes`."""
    free, source = free_memory_bytes(device)
    if need > free:
        raise ValueError(f"{what}: {need:,} bytes, but only {free:,} bytes are free ({source}); {instead}")

def small_forward_buffer_bytes(n: int, d: int, batch: int = 1) -> int:
    """Global memory the small-cache forward allocates for ``f`` (``n x n``), ``S`` and ``h``
    (``n x d``), fp32, per call."""
    return batch * (n * n + 2 * n * d) * 4
