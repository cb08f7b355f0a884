"""How much memory is free for new allocations: the one probe that builders, the CLI and the kernels'
memory checks share (ground floor: imports nothing of the package)."""
from __future__ import annotations

import torch


def available_memory_bytes(device=None) -> tuple[int | None, str]:
    """Memory free for new allocations on ``device`` (default CPU) and where the figure comes from:
    ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of ``/proc/meminfo`` on the host, or
    ``(None, "unknown")`` where neither can be read."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), "torch.cuda.mem_get_info"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    except OSError:
        pass
    return None, "unknown"
