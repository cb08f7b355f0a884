"""The executor's exact counts against the lower bounds: which bounds they must respect (proven,
with constant >= 1) and the measured ratios to the unit-constant bounds (the constants the paper
leaves open).

Algorithms (:data:`ALGORITHMS`): ``"alg6"`` (Algorithm 6, small-cache backward), ``"alg9"``
(Algorithm 9 as written), ``"alg9_fa2"`` (Algorithm 9 in FlashAttention-2 order) and
``"fwd_small"`` (the small-cache forward of Saha & Ye, :func:`~.algorithm6.small_cache_forward`).
Counts are the closed forms of :mod:`.closed_form` (equal to the executor's runs, tested).

Fast memory: Algorithm 6 and the forward fit in ``M`` words; Algorithm 9 with the paper's blocks
holds more (:func:`~.closed_form.large_cache_peak`), so its runs use ``capacity = peak``
(:func:`~.runner.run_large_cache`). A lower
bound holds for the memory a run actually had: :func:`capacity` is what the bounds are evaluated at.

Proven floor (:func:`proven_floor_words`, constant >= 1): every schedule here computes ``S = A1 X``
and the scores ``S A2^T`` by the classical sum of products, each product term exactly once (no
recomputation), in phases that start with an empty fast memory and ``S`` in slow memory. Kwasniewski
et al. 2019 (COSMA, Theorem 1) bound an ``m x k`` by ``k x n`` product by ``2mnk/sqrt(C) + mn`` I/Os
with ``C`` fast-memory words; restricting a schedule to a product's vertices keeps it a valid
schedule of that product, and adding one store per output entry (the reduction in the proof of the
paper's Theorem E.10) turns a schedule that never writes ``S A2^T`` into one that does. So each run
moves at least ``2nd^2/sqrt(C) + nd`` words for ``A1 X`` plus ``2n^2 d/sqrt(C)`` for the scores:
``2(n^2 d + n d^2)/sqrt(C) + nd`` -- twice Theorem 1.1's small-cache term, hence at least the
unit-constant Theorem 1.1 (backward) and Saha & Ye (forward) values at ``C`` -- and at least the
compulsory traffic of the problem (Definition 3.2's inputs read once, ``g`` written once: ``4nd +
3d^2``; forward: ``3nd + 2d^2`` read, ``O`` written ``nd``). :func:`check` tests both.
"""
from __future__ import annotations

import math

from sparse_io_attn.bounds.calculator import dense_backward, dense_forward
from sparse_io_attn.experiments.pebble.closed_form import large_cache_counts, small_cache_counts, small_forward_counts

ALGORITHMS = ("alg6", "alg9", "alg9_fa2", "fwd_small")
LABELS = {"alg6": "Alg 6 (small-cache backward)", "alg9": "Alg 9 as written (large-cache backward)",
          "alg9_fa2": "Alg 9, FA2 order (large-cache backward)", "fwd_small": "small-cache forward (Saha & Ye)"}

#: The hand-countable (n, d, M) the executor tests run: Algorithm 6's five, then Algorithm 9's five.
SMALL_TEST_CONFIGS = ((20, 6, 16), (23, 5, 36), (18, 8, 60), (7, 8, 300), (12, 3, 4))
LARGE_TEST_CONFIGS = ((30, 6, 36), (29, 6, 79), (25, 6, 144), (31, 4, 200), (9, 4, 400))


def counts(alg: str, n: int, d: int, M: int):
    """:class:`~.closed_form.IOCount` of ``alg`` (closed form = the executor's count)."""
    if alg == "alg6":
        return small_cache_counts(n, d, M)
    if alg == "alg9":
        return large_cache_counts(n, d, M, "faithful")
    if alg == "alg9_fa2":
        return large_cache_counts(n, d, M, "fa2")
    if alg == "fwd_small":
        return small_forward_counts(n, d, M)
    raise ValueError(f"alg must be one of {ALGORITHMS}, got {alg!r}")


def capacity(alg: str, n: int, d: int, M: int) -> int:
    """Fast-memory words the run has (the runners' default): ``M`` for Algorithm 6 and the forward,
    which fit in it; Algorithm 9's exact peak (above ``M`` with the paper's blocks, below it only
    when a block covers all ``n`` rows)."""
    return counts(alg, n, d, M).peak if alg in ("alg9", "alg9_fa2") else M


def _bound(alg, n, d, M):
    fn = dense_forward if alg == "fwd_small" else dense_backward
    return fn(n, d, M, form="paper")


def proven_floor_words(alg: str, n: int, d: int, C: int) -> float:
    """``max(compulsory, 2(n^2 d + n d^2)/sqrt(C) + nd)`` (module docstring): what a run with ``C``
    fast-memory words must move."""
    return max(float(_bound(alg, n, d, C).compulsory_words), 2 * (n * n * d + n * d * d) / math.sqrt(C) + n * d)


def row(alg: str, n: int, d: int, M: int) -> dict:
    """One run against the bounds: words moved, capacity, the paper's regime at ``M``, Theorem 1.1
    (or Saha & Ye) with unit constants at ``M`` and at the capacity, the proven floor, and ratios."""
    c = counts(alg, n, d, M)
    C = capacity(alg, n, d, M)
    at_M, at_C = _bound(alg, n, d, M), _bound(alg, n, d, C)
    floor = proven_floor_words(alg, n, d, C)
    return {"alg": alg, "n": n, "d": d, "M": M, "M_over_d2": M / (d * d), "capacity": C,
            "regime": "small" if M < d * d else "large", "words": c.total,
            "bound_at_M": at_M.value_words, "bound_at_capacity": at_C.value_words,
            "compulsory": at_C.compulsory_words, "proven_floor": floor,
            "ratio_at_M": c.total / at_M.value_words, "ratio_at_capacity": c.total / at_C.value_words,
            "ratio_to_floor": c.total / floor}


def check(r: dict) -> list[str]:
    """Violations of the bounds that are proven for ``r``'s run (empty: none)."""
    bad = []
    if r["words"] < r["proven_floor"]:
        bad.append(f"{r['alg']} n={r['n']} d={r['d']} M={r['M']}: {r['words']} < proven floor {r['proven_floor']:.1f}")
    if r["words"] < r["bound_at_capacity"]:
        bad.append(f"{r['alg']} n={r['n']} d={r['d']} M={r['M']}: {r['words']} < unit bound at capacity "
                   f"{r['bound_at_capacity']:.1f}")
    return bad


def rows(points, algorithms=ALGORITHMS) -> list[dict]:
    """:func:`row` for every algorithm at every ``(n, d, M)`` of ``points``."""
    return [row(a, n, d, M) for (n, d, M) in points for a in algorithms]


def regime_summary(rs) -> dict:
    """Per ``(alg, regime)`` and for ``("best", regime)`` (the backward algorithm moving fewest
    words at each point): ``min``/``max`` of ``ratio_at_capacity`` and ``ratio_at_M`` and the count."""
    out: dict = {}

    def add(key, r):
        s = out.setdefault(key, {"count": 0, "min_at_capacity": math.inf, "max_at_capacity": 0.0,
                                 "min_at_M": math.inf, "max_at_M": 0.0})
        s["count"] += 1
        s["min_at_capacity"] = min(s["min_at_capacity"], r["ratio_at_capacity"])
        s["max_at_capacity"] = max(s["max_at_capacity"], r["ratio_at_capacity"])
        s["min_at_M"] = min(s["min_at_M"], r["ratio_at_M"])
        s["max_at_M"] = max(s["max_at_M"], r["ratio_at_M"])

    for r in rs:
        add((r["alg"], r["regime"]), r)
    by_point: dict = {}
    for r in rs:
        if r["alg"] != "fwd_small":
            key = (r["n"], r["d"], r["M"])
            if key not in by_point or r["words"] < by_point[key]["words"]:
                by_point[key] = r
    for r in by_point.values():
        add(("best backward", r["regime"]), r)
    return out
