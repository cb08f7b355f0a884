"""On-chip memory of common GPUs, and the fast-memory size ``M`` the bounds should use.

The two-level model's fast memory is one program's on-chip storage, so ``M`` = the shared memory
one thread block may use (the opt-in maximum per block). Figures are bytes, sizes in KB/MB are
powers of 1024. Sources: NVIDIA CUDA C++ Programming Guide, table "Technical Specifications per
Compute Capability" (shared memory per SM / per block), and each part's datasheet or whitepaper
(L2 size, HBM/GDDR bandwidth) as cited per row.

Nothing here touches CUDA at import time; :func:`device_fast_memory_words` queries the current
device only when called with ``device=None`` (or a ``torch.device("cuda", i)``) on a CUDA machine.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sparse_io_attn._memory import available_memory_bytes  # noqa: F401  (re-exported)
from sparse_io_attn.bounds.units import dtype_name, itemsize

KiB = 1024
MiB = 1024 ** 2

_GUIDE = "NVIDIA CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability'"


@dataclass(frozen=True)
class DeviceSpec:
    """On-chip memory of one GPU (bytes; bandwidth in bytes/s)."""
    name: str
    compute_capability: tuple
    smem_per_sm_bytes: int
    smem_per_block_bytes: int   # opt-in maximum for one thread block: the model's M
    l2_bytes: int
    hbm_bytes_per_s: float
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("NVIDIA H100 SXM5", (9, 0), 228 * KiB, 227 * KiB, 50 * MiB, 3.35e12,
                       f"{_GUIDE} (CC 9.0); NVIDIA H100 Tensor Core GPU datasheet (50 MB L2, 3.35 TB/s HBM3)"),
    "h200": DeviceSpec("NVIDIA H200 SXM", (9, 0), 228 * KiB, 227 * KiB, 50 * MiB, 4.8e12,
                       f"{_GUIDE} (CC 9.0); NVIDIA H200 datasheet (4.8 TB/s HBM3e; L2 as H100)"),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", (8, 0), 164 * KiB, 163 * KiB, 40 * MiB, 2.039e12,
                       f"{_GUIDE} (CC 8.0); NVIDIA A100 datasheet (40 MB L2, 2,039 GB/s HBM2e on 80GB SXM)"),
    "l4": DeviceSpec("NVIDIA L4", (8, 9), 100 * KiB, 99 * KiB, 48 * MiB, 300e9,
                     f"{_GUIDE} (CC 8.9); NVIDIA L4 datasheet (48 MB L2, 300 GB/s GDDR6)"),
    "rtx4090": DeviceSpec("NVIDIA GeForce RTX 4090", (8, 9), 100 * KiB, 99 * KiB, 72 * MiB, 1008e9,
                          f"{_GUIDE} (CC 8.9); NVIDIA Ada Lovelace architecture whitepaper (72 MB L2, 1,008 GB/s GDDR6X)"),
    "v100": DeviceSpec("NVIDIA V100 SXM2", (7, 0), 96 * KiB, 96 * KiB, 6 * MiB, 900e9,
                       f"{_GUIDE} (CC 7.0); NVIDIA Tesla V100 datasheet / Volta whitepaper (6 MB L2, 900 GB/s HBM2)"),
    "t4": DeviceSpec("NVIDIA T4", (7, 5), 64 * KiB, 64 * KiB, 4 * MiB, 320e9,
                     f"{_GUIDE} (CC 7.5); NVIDIA T4 datasheet / Turing whitepaper (4 MB L2, 320 GB/s GDDR6)"),
    "gtx1060": DeviceSpec("NVIDIA GeForce GTX 1060 6GB", (6, 1), 96 * KiB, 48 * KiB, 1536 * KiB, 192e9,
                          f"{_GUIDE} (CC 6.1); GeForce GTX 1060 specifications (1.5 MB L2, 192 GB/s GDDR5)"),
}

#: Fast memory assumed when no GPU is present: the H100's opt-in shared memory per block
#: (227 KiB = 232,448 bytes), so CPU runs (Triton interpreter, traffic model) model an H100.
DEFAULT_CPU_FAST_MEMORY_BYTES = 227 * KiB

_ALIASES = {"h100sxm": "h100", "h100-sxm": "h100", "h200sxm": "h200", "a100-80gb": "a100",
            "4090": "rtx4090", "rtx-4090": "rtx4090", "gtx-1060": "gtx1060", "1060": "gtx1060"}


def get_device(name: str) -> DeviceSpec:
    """The table row for ``name`` (case-insensitive: ``"h100"``, ``"RTX4090"``, ``"gtx1060"``, ...)."""
    key = name.lower().replace(" ", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known devices: {sorted(DEVICES)}")
    return DEVICES[key]


def _cuda_smem_per_block_bytes(index: int | None) -> int | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    for attr in ("shared_memory_per_block_optin", "shared_memory_per_block"):
        value = getattr(props, attr, None)
        if value:
            return int(value)
    return None


def device_fast_memory_bytes(device=None) -> int | None:
    """Shared memory one thread block may use, in bytes.

    ``device=None``: the current CUDA device (``torch.cuda.get_device_properties``; the opt-in
    per-block maximum when PyTorch exposes it), or ``None`` when there is no CUDA device.
    ``device="h100"`` etc.: from :data:`DEVICES`. A ``torch.device("cuda", i)`` queries GPU ``i``.
    """
    if device is None:
        return _cuda_smem_per_block_bytes(None)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        return _cuda_smem_per_block_bytes(device.index)
    if isinstance(device, DeviceSpec):
        return device.smem_per_block_bytes
    if isinstance(device, str):
        if device.startswith("cuda"):
            return device_fast_memory_bytes(torch.device(device))
        return get_device(device).smem_per_block_bytes
    raise TypeError(f"device must be None, a name like 'h100', a DeviceSpec or a torch.device, "
                    f"got {type(device).__name__}")


def device_fast_memory_words(dtype, device=None) -> int | None:
    """:func:`device_fast_memory_bytes` in words of ``dtype`` (``None`` when there is no CUDA device
    and ``device`` is ``None``)."""
    nbytes = device_fast_memory_bytes(device)
    return None if nbytes is None else nbytes // itemsize(dtype)


@dataclass(frozen=True)
class Regime:
    """Which side of the paper's dividing point ``M = d^2`` a head dimension falls on."""
    d: int
    dtype: str
    device: str
    M_words: int
    d_squared: int
    regime: str          # "small" (M < d^2) or "large"
    source: str

    @property
    def ratio(self) -> float:
        """``M / d^2`` (> 1: large cache, FlashAttention-style kernels are optimal)."""
        return self.M_words / self.d_squared

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}

    def __str__(self) -> str:
        return (f"d={self.d} {self.dtype} on {self.device}: M = {self.M_words:,} words, d^2 = "
                f"{self.d_squared:,}, M/d^2 = {self.ratio:.2f} -> {self.regime} cache ({self.source})")


def regime_for(d: int, dtype, device=None) -> Regime:
    """Answer "which regime am I in for head dimension ``d`` in ``dtype`` on this GPU?".

    ``device=None`` uses the current CUDA device, or :data:`DEFAULT_CPU_FAST_MEMORY_BYTES` (an
    H100's per-block shared memory) when there is none; ``device="a100"`` etc. uses the table.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ValueError(f"d must be a positive int, got {d!r}")
    nbytes = device_fast_memory_bytes(device)
    if device is None:
        if nbytes is None:
            nbytes, label, source = DEFAULT_CPU_FAST_MEMORY_BYTES, "cpu (modelled as H100)", \
                "DEFAULT_CPU_FAST_MEMORY_BYTES"
        else:
            label, source = torch.cuda.get_device_name(), "torch.cuda.get_device_properties"
    elif isinstance(device, str) and not device.startswith("cuda"):
        spec = get_device(device)
        label, source = spec.name, "DEVICES table"
    else:
        label, source = str(device), "device query"
        if nbytes is None:
            raise ValueError(f"cannot read the shared memory of {device!r} (no CUDA device)")
    words = nbytes // itemsize(dtype)
    return Regime(d=d, dtype=dtype_name(dtype), device=label, M_words=words, d_squared=d * d,
                  regime="small" if words < d * d else "large", source=source)
