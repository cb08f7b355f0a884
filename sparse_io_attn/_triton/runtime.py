"""The Triton runtime layer: interpreter switch, device check and the one counted launch helper.

Importing this module prepares Triton for the machine: without CUDA, ``TRITON_INTERPRET=1`` is set
(unless the user set it) *before* Triton is imported, so the same kernels run on CPU tensors
through Triton's interpreter (slow; meant for tests and traffic counting). Every module that
defines ``@triton.jit`` kernels imports this module (or :mod:`.jit`, which does) first. This runs
on first use of a Triton backend, never at ``import sparse_io_attn``.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import torch

# Triton fixes interpreter mode when triton.language is imported: the switch must come first. On a
# CPU-only torch build `import sparse_io_attn` already set it (torch._dynamo imports triton too).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402  (after TRITON_INTERPRET is settled)
import triton.language as tl  # noqa: E402

from sparse_io_attn.tally.counter import counting, kernel_io  # noqa: E402

_DUMMY_IO: dict = {}   # device -> int64 buffer launched as io_ptr when nothing counts
_TUNED: dict = {}      # (kernel, key, configs, bucket) -> triton.autotune wrapper
_RECORDING: list = []  # stack of lists receiving the launches made under recording()


@dataclass(frozen=True)
class Recorded:
    """A launch :func:`launch` recorded instead of running: kernel, report name, grid and the exact
    keyword arguments (``io_ptr``/``COUNT_IO`` included, ``num_warps``/``num_stages`` among them)."""
    name: str
    kernel: object
    grid: object
    kwargs: dict


@contextlib.contextmanager
def recording():
    """Within the block, :func:`launch` records each launch (a :class:`Recorded`) into the yielded
    list instead of running it, and :func:`check_device` accepts tensors on any device: a launcher
    can then be driven on CPU tensors, without a GPU or the interpreter, to obtain the launches it
    would make (the compile report compiles them as a real launch would). Output buffers stay
    uninitialised."""
    calls: list = []
    _RECORDING.append(calls)
    try:
        yield calls
    finally:
        _RECORDING.pop()


def check_device(t: torch.Tensor, what: str = "Triton kernels") -> None:
    """Raise a clear error when a tensor cannot reach the kernels on this machine (nothing while
    :func:`recording`)."""
    if _RECORDING:
        return
    if t.device.type == "cuda" and INTERPRET:
        raise RuntimeError(f"{what}: TRITON_INTERPRET=1 is set but the tensors are on CUDA; unset it")
    if t.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{what}: tensors are on {t.device} but Triton was imported without its "
                           f"interpreter (something, e.g. torch.compile, imported triton before "
                           f"sparse_io_attn); set TRITON_INTERPRET=1 before importing triton (or import "
                           f"sparse_io_attn first), or move the tensors to CUDA")


def dot_dtype(dtype: torch.dtype):
    """The ``DOT_DTYPE`` constexpr of :func:`sparse_io_attn._triton.jit.dot` for inputs of ``dtype``:
    ``tl.float32`` (exact IEEE products) for fp32 inputs and under the interpreter, whose 16-bit
    ``tl.dot`` is wrong; the input's own 16-bit type on a GPU."""
    if INTERPRET or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def autotune_enabled() -> bool:
    """Autotuning runs on CUDA unless ``SPARSE_IO_ATTN_NO_AUTOTUNE=1``."""
    return not INTERPRET and os.environ.get("SPARSE_IO_ATTN_NO_AUTOTUNE", "0") != "1"


def dummy_io(device) -> torch.Tensor:
    """The ``io_ptr`` buffer launched when nothing counts (one per device, never read: ``COUNT_IO=False``)."""
    key = str(device)
    if key not in _DUMMY_IO:
        _DUMMY_IO[key] = torch.zeros(2, dtype=torch.int64, device=device)
    return _DUMMY_IO[key]


def uncounted() -> bool:
    """Whether launches run plainly now: no :class:`~sparse_io_attn.accounting.IOCounter` counting and
    no :func:`recording` (a launcher may then launch a call from its cached form, see
    :func:`sparse_io_attn._attention.triton.launch.run_calls`)."""
    return not _RECORDING and not counting()


def density_bucket(fraction: float) -> int:
    """The autotuning class of a kept fraction of blocks, in powers of two: 0 for more than half
    kept, 1 for (1/4, 1/2], ... up to 8 (1/256 or less; 8 also for nothing kept)."""
    if fraction <= 0:
        return 8
    return min(8, max(0, math.floor(-math.log2(fraction))))


def tuned(kernel, configs: Sequence, key: Sequence[str], bucket: int = 0):
    """``triton.autotune(configs, key)(kernel)``, built once per (kernel, configs, key, bucket): each
    ``bucket`` (a class of the work the key's shapes do not show, e.g. :func:`density_bucket`) has its
    own autotuner, so a configuration tuned for one bucket is never reused for another."""
    k = (kernel, tuple(key), tuple(map(str, configs)), bucket)
    if k not in _TUNED:
        _TUNED[k] = triton.autotune(configs=list(configs), key=[a for a in key if a in kernel.arg_names])(kernel)
    return _TUNED[k]


def launch(kernel, grid, name: str, tensors: Sequence[str], device, *, configs=None, key: Sequence[str] = (),
           bucket: int = 0, **kwargs):
    """Launch ``kernel[grid](**kwargs)`` with an I/O counter slot (see :mod:`sparse_io_attn.tally.counter`);
    returns the ``triton.Config`` used (or ``None``).

    ``name``/``tensors``: the kernel's name in a :class:`~sparse_io_attn.accounting.TrafficReport`
    and its tensor names in slot order. When an :class:`~sparse_io_attn.accounting.IOCounter` is
    active the kernel gets ``COUNT_IO=True`` and a fresh ``io_ptr`` buffer, committed after the
    launch; otherwise ``COUNT_IO=False`` (the tally is compiled out) and a cached dummy buffer.
    ``configs``: ``triton.Config`` candidates (their ``kwargs`` hold constexprs such as tile sizes,
    so ``grid`` is then a function of the meta-parameters). The first is launched under the
    interpreter, while counting and with ``SPARSE_IO_ATTN_NO_AUTOTUNE=1``; on CUDA the kernel is
    autotuned over all of them, keyed on ``key``'s values and ``bucket`` (:func:`tuned`).
    """
    if _RECORDING:
        kwargs.update(io_ptr=dummy_io(device), COUNT_IO=False)
        _RECORDING[-1].append(Recorded(name, kernel, grid, kwargs))
        return configs[0] if configs else None
    io = kernel_io(name, tensors, device)
    kwargs.update(io_ptr=io.buffer if io is not None else dummy_io(device), COUNT_IO=io is not None)
    used = None
    if not configs:
        kernel[grid](**kwargs)
    elif io is None and len(configs) > 1 and autotune_enabled():
        fn = tuned(kernel, configs, key, bucket)
        fn[grid](**kwargs)
        used = fn.best_config
    else:
        used = configs[0]
        meta = dict(kwargs, **used.kwargs)
        kernel[grid(meta) if callable(grid) else grid](**kwargs, **used.kwargs, num_warps=used.num_warps,
                                                       num_stages=used.num_stages)
    if io is not None:
        io.commit()
    return used
