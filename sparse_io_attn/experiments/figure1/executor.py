"""Figure 1 from the two-level-memory executor's closed forms and runs (words)."""
from __future__ import annotations

import bisect
import math

import torch

from sparse_io_attn.bounds import dense_backward
from sparse_io_attn.experiments.figure1.common import variant_of, bisect_crossing
from sparse_io_attn.experiments.pebble import (large_cache_io, large_cache_peak, run_large_cache, run_small_cache,
                                               small_cache_io, small_cache_m_independent)
from sparse_io_attn.experiments.slopes import loglog_slope


def executor_crossing(n: int, d: int, variant: str) -> dict:
    """Algorithm 6 against Algorithm 9 (``variant``: as written, or the FA2 order) on the executor's
    closed forms (words): ``M`` by bisection over ``[d^2/64, 4d^2]``, and ``always_from_M``, the
    smallest ``M`` from which Algorithm 9 moves no more words at *every* integer ``M`` up to ``4d^2``
    (the predicate is not monotone: Algorithm 9's blocks of ``ceil(M/4d)`` rows and Algorithm 6's
    ``floor(sqrt(M/4))`` change at different ``M``), with ``flips`` counting the integer ``M`` below
    it where Algorithm 9 still wins."""
    d2 = d * d
    lo, hi = max(4, d2 // 64), 4 * d2

    def pred(M):
        return large_cache_io(n, d, M, variant) <= small_cache_io(n, d, M)

    M = bisect_crossing(pred, lo, hi)
    bad = [x for x in range(lo, hi + 1) if not pred(x)]
    always = bad[-1] + 1 if bad else lo
    flips = sum(1 for x in range(lo, always) if pred(x))
    return {"M": M, "over_d2": None if M is None else M / d2, "always_from_M": always,
            "always_from_over_d2": always / d2, "flips_below": flips, "variant": variant, "n": n, "d": d}


def executor_words(kind: str, n: int, d: int, M: int) -> int | None:
    """Closed-form words the executor's algorithm ``kind`` moves; ``None`` where it cannot run at
    ``M``."""
    variant = variant_of(kind)
    try:
        if variant is None:
            return int(small_cache_io(n, d, M))
        return int(large_cache_io(n, d, M, variant=variant))
    except ValueError:  # M too small for the algorithm's blocks
        return None


def executor_run_words(kind: str, n: int, d: int, M: int) -> tuple[int, int] | None:
    """``(words moved by actually running the executor, closed form)`` for ``kind`` on random float64
    inputs of size ``n x d`` (the counts do not depend on the values); ``None`` where the algorithm
    cannot run at ``M``."""
    variant = variant_of(kind)
    g = torch.Generator().manual_seed(0)
    A1, A2, A3, dO = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4))
    X, Y = (torch.randn(d, d, generator=g, dtype=torch.float64) / d for _ in range(2))
    try:
        if variant is None:
            run = run_small_cache(A1, A2, A3, X, Y, dO, M)
        else:
            run = run_large_cache(A1, A2, A3, X, Y, dO, M, variant=variant)
    except ValueError:  # M too small for the algorithm's blocks
        return None
    return run.total, executor_words(kind, n, d, M)


def executor_points(d: int) -> list[int]:
    """The ``M`` of the executor report's table: ``d^2/64`` to ``64 d^2`` (factors of 2 and 4)."""
    return [d * d // 64, d * d // 16, d * d // 4, d * d // 2, d * d, 2 * d * d, 4 * d * d, 8 * d * d,
            16 * d * d, 32 * d * d, 64 * d * d]


def executor_table(n: int, d: int) -> list[dict]:
    """One row per :func:`executor_points` ``M``: words of Algorithm 6 (also less its
    ``M``-independent ``9n^2 + 3nd + d^2``), of Algorithm 9 as written and in FA2 order, their peak
    fast memory over ``M``, Theorem 1.1 with unit constants and the best algorithm over the bound."""
    rows = []
    fixed = small_cache_m_independent(n, d)
    for M in executor_points(d):
        a6 = small_cache_io(n, d, M)
        a9, f2 = large_cache_io(n, d, M), large_cache_io(n, d, M, "fa2")
        b = dense_backward(n, d, M).value_words
        rows.append({"M": M, "small": a6, "small_m_dependent": a6 - fixed, "large_faithful": a9, "large_fa2": f2,
                     "peak_over_M_faithful": large_cache_peak(n, d, M) / M,
                     "peak_over_M_fa2": large_cache_peak(n, d, M, "fa2") / M,
                     "bound": b, "best_over_bound": min(a6, a9, f2) / b})
    return rows


def executor_summary(n: int, d: int) -> dict:
    """Figure 1 from the closed forms: the slopes of each regime, Algorithm 9's plateau, where the
    FA2 order overtakes the written order and Algorithm 9 overtakes Algorithm 6.

    * ``small_m_dependent_slope``: Algorithm 6 less its ``M``-independent part at ``M = 4B^2 < d^2``
      with ``B | d`` (``small_Ms``).
    * ``faithful_slope`` / ``faithful_m_dependent_slope``: Algorithm 9 as written over ``d^2 <= M
      <= 4d^2`` (``faithful_Ms``), total and total less ``8nd + n + d^2``.
    * ``faithful_plateau_totals``: the distinct totals at every multiple of ``4d`` in ``[4d^2, 64d^2]``.
    * ``fa2_slope`` / ``fa2_m_dependent_slope``: FA2 order over ``4d^2 .. 64d^2`` with ``M <= 4nd``
      (``fa2_Ms``), total and the ``ceil(n/B_c)(3nd + 2n)`` part; ``fa2_beats_faithful_from_M``.
    * ``faithful_beats_small_from_M``: the smallest ``M`` from which Algorithm 9 (as written) moves
      fewer words than Algorithm 6 at every ``M`` up to ``4d^2`` (``faithful_worse_count``: the ``M``
      in ``[4, 4d^2]`` where it moves more), its peak over ``M`` there, the
      :func:`equal_capacity_crossover`, and whether both variants beat Algorithm 6 at every sampled
      ``M >= d^2`` (``large_beats_small_above_d2``).
    """
    d2 = d * d
    small_Ms = [4 * b * b for b in (1, 2, 4, 8, 16, 32) if 4 * b * b < d2 and d % b == 0]
    fixed = small_cache_m_independent(n, d)
    mid = [d2 * k // 4 for k in (4, 5, 6, 8, 10, 12, 16)]
    const9 = 8 * n * d + n + d2
    big = [d2 * k for k in (4, 8, 16, 32, 64) if d2 * k <= 4 * n * d]
    fa2 = [large_cache_io(n, d, M, "fa2") for M in big]
    constf = const9 + 2 * d2 * math.ceil(n / d)
    worse = [M for M in range(4, 4 * d2 + 1) if large_cache_io(n, d, M) >= small_cache_io(n, d, M)]
    cross = worse[-1] + 1
    return {
        "n": n, "d": d, "d2": d2,
        "small_Ms": small_Ms,
        "small_m_dependent_slope": loglog_slope(small_Ms, [small_cache_io(n, d, M) - fixed for M in small_Ms]),
        "faithful_Ms": mid,
        "faithful_slope": loglog_slope(mid, [large_cache_io(n, d, M) for M in mid]),
        "faithful_m_dependent_slope": loglog_slope(mid, [large_cache_io(n, d, M) - const9 for M in mid]),
        "faithful_plateau_totals": sorted({large_cache_io(n, d, M) for M in range(4 * d2, 64 * d2 + 1, 4 * d)}),
        "fa2_Ms": big,
        "fa2_slope": loglog_slope(big, fa2),
        "fa2_m_dependent_slope": loglog_slope(big, [y - constf for y in fa2]),
        "fa2_beats_faithful_from_M": next(M for M in range(4 * d2, 64 * d2)
                                          if large_cache_io(n, d, M, "fa2") < large_cache_io(n, d, M)),
        "faithful_beats_small_from_M": cross,
        "faithful_worse_count": len(worse),
        "faithful_peak_over_M_at_crossing": large_cache_peak(n, d, cross) / cross,
        "equal_capacity_crossover": equal_capacity_crossover(n, d),
        "large_beats_small_above_d2": all(large_cache_io(n, d, M, v) < small_cache_io(n, d, M)
                                          for M in range(d2, 64 * d2 + 1, 17) for v in ("faithful", "fa2")),
    }


def equal_capacity_crossover(n: int, d: int) -> int:
    """Smallest capacity C from which Algorithm 9 (as written, with the M whose peak fits C and
    moves fewest words) always beats Algorithm 6 run with M = C (which fits C)."""
    best, caps, low = [], [], None
    for peak, io in sorted((large_cache_peak(n, d, M), large_cache_io(n, d, M)) for M in range(1, 4 * d * d + 1)):
        low = io if low is None else min(low, io)
        caps.append(peak)
        best.append(low)
    worse = []
    for C in range(4, 4 * d * d + 1):
        i = bisect.bisect_right(caps, C) - 1
        if i < 0 or best[i] >= small_cache_io(n, d, C):
            worse.append(C)
    return worse[-1] + 1
