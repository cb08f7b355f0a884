"""The host side both ops' C++ kernels share (backend ``"cpu"``; imports the C++ build module, so
each op's ``cpu`` package, itself loaded on first use, imports this): the device check of every
call's tensors and the decode work-buffer probe."""
from __future__ import annotations

import torch

from sparse_io_attn._cpu.build import load


def check_cpu(*tensors: torch.Tensor, plan_device: torch.device | None = None) -> None:
    """Backend ``"cpu"`` runs on CPU tensors (and a plan on the CPU)."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"backend 'cpu' runs on CPU tensors, got a tensor on {t.device}; use "
                             f"backend='auto' or 'triton' for CUDA tensors")
    if plan_device is not None and plan_device.type != "cpu":
        raise ValueError(f"backend 'cpu' needs a plan on the CPU, got one on {plan_device}")


def decode_work_bytes() -> int:
    """Bytes of work buffers the last decode call (block-sparse or selection) allocated: per worker a
    few tiles plus the splits' partial results, independent of the KV length (a check for tests)."""
    return int(load().decode_work_bytes())


__all__ = ["check_cpu", "decode_work_bytes"]
