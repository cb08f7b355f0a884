"""Triton kernels. Importing this package prepares Triton for the machine:

On a machine without CUDA, ``TRITON_INTERPRET=1`` is set (unless the user set it) *before* Triton
is imported, so the same kernels run on CPU tensors through Triton's interpreter (slow; meant for
tests and traffic counting). Every module that defines ``@triton.jit`` kernels imports this package
first. This runs on first use of a Triton backend, never at ``import sparse_io_attn``.
"""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(t: torch.Tensor, what: str = "Triton kernels") -> None:
    """Raise a clear error when a tensor cannot reach the kernels on this machine."""
    if t.device.type == "cuda" and INTERPRET:
        raise RuntimeError(f"{what}: TRITON_INTERPRET=1 is set but the tensors are on CUDA; unset it")
    if t.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{what}: tensors are on {t.device} but Triton was imported without its "
                           f"interpreter; set TRITON_INTERPRET=1 before importing triton (or "
                           f"sparse_io_attn._triton.runtime first), or move the tensors to CUDA")


def dot_dtype(dtype: torch.dtype):
    """Operand dtype for ``tl.dot``: the interpreter's bf16 ``tl.dot`` is wrong, so fp32 there."""
    return torch.float32 if INTERPRET else dtype
