"""Units for the bound calculator: words (matrix elements) and bytes.

The paper's model counts *words*: one word holds one matrix element, and the fast memory holds
``M`` words. A byte count needs a dtype: ``bytes = words * itemsize``. :func:`parse_memory` turns a
user's ``M`` (an int of words, a string of words such as ``"116224"``, or a byte size such as
``"228KiB"`` together with a dtype) into words.

Size suffixes follow the memory-chip (JEDEC) convention that NVIDIA's documentation uses:
``K``/``KB``/``KiB`` = 1024 bytes, ``M``/``MB``/``MiB`` = 1024**2, ``G``/``GB``/``GiB`` = 1024**3
(so the GTX 1060's "48 KB" per block is 49,152 bytes). A bare ``B`` means bytes.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

_ITEMSIZE_BY_NAME = {
    "float64": 8, "fp64": 8, "double": 8,
    "float32": 4, "fp32": 4, "float": 4, "tf32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
}

_UNIT_BYTES = {
    "b": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024 ** 2, "mb": 1024 ** 2, "mib": 1024 ** 2,
    "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype``, NumPy dtype, or a name such as ``"bf16"``)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        if key in _ITEMSIZE_BY_NAME:
            return _ITEMSIZE_BY_NAME[key]
        raise ValueError(f"unknown dtype name {dtype!r}; use one of {sorted(_ITEMSIZE_BY_NAME)} "
                         f"or a torch.dtype")
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        raise TypeError(f"dtype must be a torch.dtype, a NumPy dtype or a name like 'bf16', "
                        f"got {dtype!r}") from None


def dtype_name(dtype) -> str | None:
    """A short printable name for ``dtype`` (``None`` stays ``None``)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    if isinstance(dtype, str):
        return dtype.lower().replace("torch.", "")
    return str(np.dtype(dtype))


def finite_number(value, what: str, kind: str = "number"):
    """A real ``value`` (not an ``int``) as a finite ``float``, or an ``int`` where it is integral;
    ``ValueError`` naming ``what`` where it is past the float range or not finite."""
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{what} = {value!r} is beyond the float range (~1.8e308)") from None
    if not math.isfinite(v):
        raise ValueError(f"{what} must be a finite {kind}, got {value!r}")
    return int(v) if v.is_integer() else v


def parse_memory(M, dtype=None):
    """The fast-memory size ``M`` in words.

    ``M`` is a number of words (``int``, ``float`` or a NumPy scalar; integral values come back as
    ``int``, others as ``float``), a string of words (``"116224"``), or a byte size with a unit
    (``"228KiB"``, ``"48KB"``, ``"232448B"``), which needs ``dtype`` to convert to words
    (``words = bytes // itemsize``). Raises ``ValueError`` for ``M < 1`` word, a non-finite number or
    an unreadable string, ``TypeError`` for other types.
    """
    import numbers

    if isinstance(M, (bool, np.bool_)) or not isinstance(M, (numbers.Real, str)):
        raise TypeError(f"M must be a number of words or a size string like '228KiB', "
                        f"got {type(M).__name__} {M!r}")
    if isinstance(M, str):
        m = _SIZE_RE.match(M)
        if m is None:
            raise ValueError(f"cannot read memory size {M!r}; expected words like '116224' or "
                             f"bytes with a unit like '228KiB', '48KB', '1MiB'")
        number, unit = m.group(1), m.group(2).lower()
        if not unit:
            if "." in number:
                raise ValueError(f"a word count must be an integer, got {M!r}")
            words = int(number)
        else:
            if unit not in _UNIT_BYTES:
                raise ValueError(f"unknown size unit {m.group(2)!r} in {M!r}; use B, KiB/KB, "
                                 f"MiB/MB or GiB/GB (all powers of 1024)")
            if dtype is None:
                raise ValueError(f"M={M!r} is a byte size; pass dtype= (e.g. torch.bfloat16) to "
                                 f"convert it to words")
            nbytes = float(number) * _UNIT_BYTES[unit]
            if nbytes != int(nbytes):
                raise ValueError(f"{M!r} is not a whole number of bytes")
            words = int(nbytes) // itemsize(dtype)
    elif isinstance(M, numbers.Integral):
        words = int(M)
    else:
        words = finite_number(M, "M", "number of words")
    if words < 1:
        raise ValueError(f"the fast memory must hold at least one word, got M={M!r} "
                         f"({words} words)")
    return words
