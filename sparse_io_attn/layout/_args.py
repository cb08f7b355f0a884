"""Argument parsing shared by the layout floor's constructors."""
from __future__ import annotations

from typing import Sequence


def as_pair(x, what: str) -> tuple[int, int]:
    """An int or an ``(int, int)`` pair of positive ints -> the pair; ``TypeError``/``ValueError``
    naming ``what`` otherwise."""
    if isinstance(x, bool) or x is None:
        raise TypeError(f"{what} must be an int or an (int, int) pair, got {x!r}")
    if isinstance(x, int):
        a = b = x
    elif isinstance(x, Sequence) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        a, b = x
    else:
        raise TypeError(f"{what} must be an int or an (int, int) pair, got {x!r}")
    if a <= 0 or b <= 0:
        raise ValueError(f"{what} must be positive, got {(a, b)}")
    return int(a), int(b)


def positive_int(x, what: str) -> int:
    """``x`` if it is a positive int (not a bool); ``ValueError`` naming ``what`` otherwise."""
    if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
        raise ValueError(f"{what} must be a positive int, got {x!r}")
    return x
