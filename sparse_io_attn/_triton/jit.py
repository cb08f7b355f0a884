"""``@triton.jit`` helpers shared by every kernel family (block-sparse, dense, sparse operands).

One helper per mechanism:

* :func:`dot`: ``acc + a @ b`` with fp32 accumulation and one precision flag, ``DOT_DTYPE``
  (``tl.float32``: exact IEEE products, for fp32 inputs and the interpreter; ``tl.bfloat16`` /
  ``tl.float16``: tensor-core products). The host picks it with
  :func:`sparse_io_attn._triton.runtime.dot_dtype`.
* :func:`nbytes`: bytes a masked load/store of any rank moves (in-range lanes only).
* :func:`io_add` and :func:`slot`: one program's tally added to its counter slot, slots named
  after the launcher's tensor tuple (the order is defined once, by that tuple).
* ``LOG2E``/``LN2`` as ``tl.constexpr``: scores are kept in base 2 (``exp2``) with
  ``sm_scale * LOG2E`` folded into one multiply.
"""
from __future__ import annotations

from typing import Sequence

from sparse_io_attn._triton.runtime import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): natural-log units -> base 2
LN2 = tl.constexpr(0.6931471805599453)     # ln(2): base 2 -> natural-log units
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32


def slot(tensors: Sequence[str], name: str) -> tl.constexpr:
    """The counter slot of tensor ``name``: its index in the launcher's ``tensors`` tuple."""
    if name not in tensors:
        raise ValueError(f"no tensor {name!r} in the counter's tensors {tuple(tensors)}")
    return tl.constexpr(tuple(tensors).index(name))


@triton.jit
def dot(a, b, acc, DOT_DTYPE: tl.constexpr):
    """``acc + a @ b`` in fp32 (``acc=None``: just ``a @ b``); operands cast to ``DOT_DTYPE``."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)


@triton.jit
def nbytes(mask, ptr):
    """Bytes a masked load/store of ``mask`` (any rank) through pointer ``ptr`` moves (int64)."""
    elem_bytes: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return tl.sum(mask.to(tl.int64)) * elem_bytes


@triton.jit
def io_add(io_ptr, SLOT: tl.constexpr, read, written):
    """Add one program's bytes read/written of tensor ``SLOT`` to the launch's counter."""
    tl.atomic_add(io_ptr + 2 * SLOT, read)
    tl.atomic_add(io_ptr + 2 * SLOT + 1, written)
