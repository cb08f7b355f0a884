"""Names shared by the Figure-1 analyses: the algorithm kinds, the word size, and bisection over integer ``M``."""
from __future__ import annotations


#: Algorithm 6 (small cache); Algorithm 9 as written; Algorithm 9 in FlashAttention-2 loop order
KINDS = ("small", "large_faithful", "large_fa2")


#: Words per kernel byte in the sweep tables: the dense kernels' intermediates are fp32
WORD_BYTES = 4


def variant_of(kind: str) -> str | None:
    """The large-cache variant of ``kind`` (``"large_fa2"`` -> ``"fa2"``); ``None`` for ``"small"``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return None if kind == "small" else kind.split("_", 1)[1]


def bisect_crossing(pred, lo: int, hi: int) -> int | None:
    """The integer ``M`` in ``[lo, hi]`` at which ``pred`` turns true, by bisection: ``None`` if
    not ``pred(hi)``; otherwise the bracket is found by halving down from ``hi`` to the first ``M``
    where ``pred`` fails (``lo`` if it holds all the way), then bisected. With one crossing this is
    the smallest ``M`` where ``pred`` holds; with several, the uppermost one."""
    if not pred(hi):
        return None
    top = hi
    while True:
        below = max(lo, top // 2)
        if below == top:          # pred holds down to lo
            return lo
        if not pred(below):
            break
        top = below
    lo, hi = below, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi
