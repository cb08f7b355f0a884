"""The paper's Figure 1: backward traffic against the fast memory ``M`` at fixed ``n, d``, for the
small-cache algorithm (Algorithm 6) and the large-cache algorithm (Algorithm 9, as written and in
the FlashAttention-2 loop order), from three sources:

* the dense kernels' exact traffic model (:mod:`sparse_io_attn.dense.traffic`; bytes, equal to the kernels' counters),
* the dense kernels' own ``COUNT_IO`` counters (:func:`kernel_counted_bytes`; Triton's interpreter
  on a CPU, so small ``n`` only),
* the two-level-memory executor's closed forms and runs (:mod:`sparse_io_attn.experiments.pebble`;
  words, independent of the machine).

This module is the one implementation of the analysis; ``sparse-io-attn sweep cache|dim``,
``benchmarks/dense_figure1.py`` and ``benchmarks/pebble_figure1.py`` only format its results.
Log-log slopes come from :func:`sparse_io_attn.experiments.slopes.loglog_slope`.

Algorithms are named by ``kind``: ``"small"``, ``"large_faithful"``, ``"large_fa2"`` (:data:`KINDS`).

Kernel traffic model (:func:`sweep`, :func:`summarize`). Per ``M``, the bytes each backward moves:

* ``small``: the small-cache kernels (Algorithm 6), ``B = sqrt(M/4)``.
* ``faithful``: the large-cache kernels as the paper writes them (Algorithm 9), where they fit.
* ``fa2``: the FlashAttention-2-style large-cache variant (dQ then ``g = A1^T dQ``) with tiles sized
  for ``M``; ``fa2_model`` extends its schedule below the 16-row tiles ``tl.dot`` needs (model only)
  so it can be set against the small-cache kernel over the whole small-cache range.

``g path`` columns count only the kernels that compute ``dX = g`` (the paper's quantity); ``all``
columns the full backward (all five gradients). Two derived quantities isolate the ``M``-dependent
traffic the bounds are about:

* :func:`small_tiled_reads`: the small-cache traffic less its ``M``-independent part (every write,
  and the element-wise sweeps over ``f, q`` in phases 1 and 3): the operand reads of the tiled
  products, which fall as ``1/B ~ M^(-1/2)``.
* :func:`reread_bytes`: bytes read beyond one pass over each tensor per kernel (the re-reads a larger
  ``M`` saves), used for the large-cache kernels.

Crossings (:func:`kernel_crossing`, :func:`executor_crossing`, :func:`crossings`): the smallest ``M``
from which a large-cache backward moves no more than the small-cache one, by bisection on the exact
model over integer ``M`` -- for the kernels with the tiles they can run (``>= 16``, powers of two;
a kernel that cannot tile ``M`` does not win there), for the algorithms as the paper writes them
(executor closed forms, any integer tile), and, for the record, for the FA2 schedule with tiles
below 16 (``min_block=1``, a model-only extension the kernels cannot run). Bisection assumes one
crossing; each result says whether a geometric grid (kernels) or every integer ``M`` (closed
forms) agrees, and the closed forms also give the ``M`` from which the large-cache algorithm wins
at every integer ``M`` up to ``4d^2`` (``always_from_M``).

Forward (Table 1, Saha & Ye): :func:`cache_rows` also carries the small-cache forward (executor
closed form and kernel model) and the large-cache forward (kernel model), and
:func:`cache_findings` their ``M^(-1/2)`` slope.

The ``sweep cache`` / ``sweep dim`` tables (:func:`cache_rows`, :func:`cache_findings`,
:func:`threshold_rows`, :func:`threshold_findings`) put all three sources side by side in words
(kernel fp32 bytes / 4, ``g`` path). The executor report (:func:`executor_table`,
:func:`executor_summary`, :func:`equal_capacity_crossover`) works on the closed forms alone.
"""
from __future__ import annotations

import bisect
import math

import torch

from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.tally.report import TrafficReport
from sparse_io_attn.bounds import dense_backward, dense_forward
from sparse_io_attn.experiments.pebble import (large_cache_io, large_cache_peak, run_large_cache, run_small_cache,
                                          small_cache_io, small_cache_m_independent,
                                          small_forward_io, small_forward_m_independent)
from sparse_io_attn.experiments.slopes import loglog_slope
from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.dense import forward
from sparse_io_attn.dense import backward_large_cache, backward_small_cache
from sparse_io_attn.dense.regime import choose_backward
from sparse_io_attn.dense.tiles import min_large_cache_M, small_cache_block
from sparse_io_attn.dense.traffic import (LARGE_G_PATH, SMALL_G_PATH, large_cache_traffic, large_forward_traffic,
                                          small_cache_traffic,
                                          small_forward_traffic)

#: Algorithm 6 (small cache); Algorithm 9 as written; Algorithm 9 in FlashAttention-2 loop order
KINDS = ("small", "large_faithful", "large_fa2")

#: Words per kernel byte in the sweep tables: the dense kernels' intermediates are fp32
_WORD_BYTES = 4


def _variant(kind: str) -> str | None:
    """The large-cache variant of ``kind`` (``"large_fa2"`` -> ``"fa2"``); ``None`` for ``"small"``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return None if kind == "small" else kind.split("_", 1)[1]


# ============================================================================== kernel traffic model
def tensor_bytes(n: int, d: int, dtype=torch.float32) -> dict:
    """Size in bytes of every tensor the dense backward kernels name (batch 1)."""
    I, F = itemsize(dtype), 4
    sizes = {t: n * d * I for t in ("A1", "A2", "A3", "dO", "O", "dA1", "dA2", "dA3")}
    sizes.update({t: n * d * F for t in ("S", "h", "dS", "dh", "T")})
    sizes.update({t: n * n * F for t in ("f", "q", "p")})
    sizes.update({t: d * d * I for t in ("X", "Y")})
    sizes.update({t: d * d * F for t in ("dX", "dY")})
    sizes.update({t: n * F for t in ("lse", "v")})
    return sizes


def small_tiled_reads(report: TrafficReport) -> int:
    """Small-cache traffic less its ``M``-independent part (see the module docstring)."""
    total = 0
    for kt in report.kernels.values():
        if kt.name == "small.phase3.p":
            continue
        total += sum(b for t, b in kt.reads.items() if not (kt.name == "small.phase1.f" and t == "f"))
    return total


def reread_bytes(report: TrafficReport, sizes: dict) -> int:
    """Bytes read beyond one pass over each tensor, per kernel (launches of one kernel name that
    read different tensors are fine: each tensor is charged once per kernel name and launch)."""
    out = 0
    for kt in report.kernels.values():
        for t, b in kt.reads.items():
            out += max(0, b - sizes[t])
    return out


def kernel_traffic(kind: str, n: int, d: int, M: int, dtype=torch.float32, *, g_only: bool = True,
                   min_block: int | None = None) -> TrafficReport | None:
    """The traffic model's report of the dense backward kernels of ``kind`` (``g_only``: the ``dX``
    path only), or ``None`` where the kernels cannot tile ``M``. ``min_block`` (large-cache only)
    lets the schedule use tiles below the 16 rows ``tl.dot`` needs (a model-only extension)."""
    variant = _variant(kind)
    extra = {} if min_block is None else {"min_block": min_block}
    try:
        if variant is None:
            return small_cache_traffic(n, d, M, dtype=dtype, g_only=g_only)
        return large_cache_traffic(n, d, M, dtype=dtype, variant=variant, g_only=g_only, **extra)
    except ValueError:  # M too small for this kernel's tiles
        return None


def kernel_bytes(kind: str, n: int, d: int, M: int, dtype=torch.float32) -> int | None:
    """Predicted bytes of the dense backward kernels of ``kind`` on the ``dX`` path; ``None`` where
    the kernels cannot tile ``M``."""
    rep = kernel_traffic(kind, n, d, M, dtype)
    return None if rep is None else rep.total_bytes


def kernel_counted_bytes(kind: str, n: int, d: int, M: int) -> int | None:
    """Bytes the dense backward kernels of ``kind`` count (``COUNT_IO``) on the ``dX`` path, on fp32
    random inputs of size ``n x d`` (Triton's interpreter on a CPU); ``None`` where they cannot tile
    ``M``."""
    variant = _variant(kind)
    g = torch.Generator().manual_seed(0)
    A1, A2, A3, dO = (torch.randn(n, d, generator=g) for _ in range(4))
    X, Y = (torch.randn(d, d, generator=g) / d for _ in range(2))
    try:
        if variant is None:
            with IOCounter() as io:
                backward_small_cache(A1, A2, A3, X, Y, dO, M=M)
            path = SMALL_G_PATH
        else:
            O, lse = forward(A1, A2, A3, X, Y, M=M)
            with IOCounter() as io:
                backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, variant=variant)
            path = LARGE_G_PATH[variant]
    except ValueError:  # M too small for this kernel's tiles
        return None
    return sum(k.total for name, k in io.report.kernels.items() if name in path)


def sweep(n: int, d: int, Ms, dtype=torch.float32) -> list[dict]:
    """One row per ``M``: bytes of every backward (``None`` where a kernel cannot run)."""
    sizes = tensor_bytes(n, d, dtype)
    rows = []
    for M in Ms:
        r = {"M": M, "M_over_d2": M / (d * d)}
        small_g = kernel_traffic("small", n, d, M, dtype)
        small_all = kernel_traffic("small", n, d, M, dtype, g_only=False)
        r["B"] = small_cache_block(M) if small_g else None
        r["small_g"] = small_g.total_bytes if small_g else None
        r["small_all"] = small_all.total_bytes if small_all else None
        r["small_g_tiled_reads"] = small_tiled_reads(small_g) if small_g else None
        for name, kind, min_block in (("faithful", "large_faithful", None), ("fa2", "large_fa2", None),
                                      ("fa2_model", "large_fa2", 1)):
            g = kernel_traffic(kind, n, d, M, dtype, min_block=min_block)
            a = kernel_traffic(kind, n, d, M, dtype, g_only=False, min_block=min_block)
            r[f"{name}_g"] = g.total_bytes if g else None
            r[f"{name}_all"] = a.total_bytes if a else None
            r[f"{name}_g_rereads"] = reread_bytes(g, sizes) if g else None
        b = dense_backward(n, d, M, form="paper")
        r["bound_bytes"] = b.value_words * itemsize(dtype)
        r["bound_small_term_bytes"] = b.terms["small_cache"] * itemsize(dtype)
        r["bound_large_term_bytes"] = b.terms["large_cache"] * itemsize(dtype)
        rows.append(r)
    return rows


def summarize(n: int, d: int, dtype=torch.float32) -> dict:
    """The Figure-1 numbers: slopes, the faithful kernel's plateau, and the crossings.

    * small: ``M = 4 B^2`` for ``B = 16, 32, ...`` below ``d^2`` (one point per tile size); the same
      points give the small-cache forward's slopes (``fwd_small_tiled_slope``, ``fwd_small_total_slope``).
    * large (faithful, fa2): powers of two from the smallest ``M`` that runs up to ``n d``.
    * ``crossings``: :func:`crossings` (bisection on the model, kernels and algorithms).
    """
    d2 = d * d
    small_Ms = [4 * b * b for b in (16, 32, 64, 128, 256, 512, 1024) if 4 * b * b < d2]
    top = n * d
    pow2 = [1 << k for k in range(10, int(math.log2(top)) + 1)]
    rows = {r["M"]: r for r in sweep(n, d, sorted(set(small_Ms + pow2)), dtype)}
    out = {"n": n, "d": d, "dtype": str(dtype).replace("torch.", ""), "d2": d2}
    out["small_Ms"] = small_Ms
    if len(small_Ms) < 2:
        raise ValueError(f"d = {d} leaves fewer than two small-cache tile sizes below d^2 = {d2} "
                         f"(B >= 16 needs M >= 1024); use d >= 128")
    out["small_tiled_slope"] = loglog_slope(small_Ms, [rows[M]["small_g_tiled_reads"] for M in small_Ms])
    out["small_total_slope"] = loglog_slope(small_Ms, [rows[M]["small_g"] for M in small_Ms])
    for name in ("faithful", "fa2"):
        Ms = [M for M in pow2 if rows[M][f"{name}_g"] is not None and M >= d2]
        out[f"{name}_Ms"] = Ms
        out[f"{name}_min_M"] = Ms[0] if Ms else None
        # where the paper's analysis applies: d^2 <= M, until the traffic stops falling
        falling = [Ms[0]] if Ms else []
        for M in Ms[1:]:
            if rows[M][f"{name}_g"] < rows[falling[-1]][f"{name}_g"] * 0.99:
                falling.append(M)
            else:
                break
        out[f"{name}_falling_Ms"] = falling
        if len(falling) >= 2:
            out[f"{name}_slope"] = loglog_slope(falling, [rows[M][f"{name}_g"] for M in falling])
            out[f"{name}_reread_slope"] = loglog_slope(falling, [rows[M][f"{name}_g_rereads"] for M in falling])
        plateau = [M for M in Ms if M > falling[-1]] if falling else []
        out[f"{name}_plateau_from_M"] = falling[-1] if plateau else None
        out[f"{name}_plateau_bytes"] = rows[falling[-1]][f"{name}_g"] if plateau else None
    out["crossings"] = crossings(n, d, dtype)
    fwd_Ms = [M for M in small_Ms]
    fwd = [small_forward_tiled_reads(small_forward_traffic(n, d, M, dtype=dtype)) for M in fwd_Ms]
    out["fwd_small_tiled_slope"] = loglog_slope(fwd_Ms, fwd)
    out["fwd_small_total_slope"] = loglog_slope(fwd_Ms, [small_forward_traffic(n, d, M, dtype=dtype).total_bytes
                                                         for M in fwd_Ms])
    out["rows"] = [rows[M] for M in sorted(rows)]
    return out


# ============================================================================== crossings
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


def _kernel_total(kind: str, n, d, M, dtype, g_only, min_block):
    rep = kernel_traffic(kind, n, d, M, dtype, g_only=g_only, min_block=None if kind == "small" else min_block)
    return None if rep is None else rep.total_bytes


def kernel_crossing(n: int, d: int, variant: str, dtype=torch.float32, *, g_only: bool = False,
                    min_block: int = 16, lo: int = 1024, hi: int | None = None) -> dict:
    """Where the large-cache kernels (``variant``) start moving no more bytes than the small-cache
    kernels (model, ``g_only``: the dX path, else all five gradients), by bisection over integer
    ``M`` in ``[lo, hi]`` (default ``hi = 16 d^2``). A kernel that cannot tile ``M`` does not win.
    ``min_block=16``: the tiles the kernels can run; ``1``: the model-only extension.

    Returns ``M``, ``over_d2``, ``min_feasible_M`` (smallest ``M`` the large-cache kernels run at;
    ``None`` for the extension), ``grid_agrees`` (the predicate flips once on a 2^(1/8) grid) and the
    parameters."""
    hi = 16 * d * d if hi is None else hi
    kind = f"large_{variant}"

    def pred(M):
        large = _kernel_total(kind, n, d, M, dtype, g_only, min_block)
        small = _kernel_total("small", n, d, M, dtype, g_only, min_block)
        return large is not None and small is not None and large <= small

    M = bisect_crossing(pred, lo, hi)
    grid = sorted({int(round(lo * 2 ** (k / 8))) for k in range(int(8 * math.log2(hi / lo)) + 1)})
    agrees = M is not None and all(pred(x) == (x >= M) for x in grid)
    return {"M": M, "over_d2": None if M is None else M / (d * d), "variant": variant, "g_only": g_only,
            "min_block": min_block, "min_feasible_M": min_large_cache_M(d, variant) if min_block == 16 else None,
            "grid_agrees": agrees, "n": n, "d": d}


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


def crossings(n: int, d: int, dtype=torch.float32) -> dict:
    """Every crossing of :func:`kernel_crossing` / :func:`executor_crossing` at ``(n, d)``:
    ``executor_<variant>``, ``kernel_<variant>`` (all gradients), ``kernel_<variant>_g`` (dX path)
    and ``model_fa2_g_min_block_1`` (FA2 schedule with tiles below 16, dX path: the comparison behind
    the library's earlier "0.354 d^2", which came from a 2^(1/4) grid)."""
    out = {}
    for v in ("faithful", "fa2"):
        out[f"executor_{v}"] = executor_crossing(n, d, v)
        out[f"kernel_{v}"] = kernel_crossing(n, d, v, dtype)
        out[f"kernel_{v}_g"] = kernel_crossing(n, d, v, dtype, g_only=True)
    out["model_fa2_g_min_block_1"] = kernel_crossing(n, d, "fa2", dtype, g_only=True, min_block=1)
    return out


def crossing_lines(c: dict, d: int) -> list[str]:
    """:func:`crossings` in words (one line per comparison)."""
    f = lambda x: "never up to 16 d^2" if x is None else f"{x:,} ({x / d / d:.3f} d^2)"  # noqa: E731
    lines = []
    for v, name in (("faithful", "as written"), ("fa2", "FA2 order")):
        e = c[f"executor_{v}"]
        lines.append(f"algorithms (executor closed forms, words): Alg 9 {name} moves no more than Alg 6 from M = "
                     f"{f(e['M'])} by bisection; at every integer M from {f(e['always_from_M'])} on "
                     f"({e['flips_below']} integer M below that where it already does)")
    for v, name in (("faithful", "as written"), ("fa2", "FA2 order")):
        k, g = c[f"kernel_{v}"], c[f"kernel_{v}_g"]
        edge = k["min_feasible_M"]
        lines.append(f"kernels (model, tiles >= 16): large-cache {name} moves no more than small-cache from M = "
                     f"{f(k['M'])} (all gradients) / {f(g['M'])} (dX path); it runs from M = {f(edge)}"
                     + ("" if k["grid_agrees"] and g["grid_agrees"] else " (not a single crossing on the grid)"))
    x = c["model_fa2_g_min_block_1"]
    lines.append(f"model only, FA2 schedule with tiles below 16 (the kernels cannot run them), dX path: "
                 f"crossing at M = {f(x['M'])}")
    return lines


# ============================================================================== forward
def kernel_forward_traffic(kind: str, n: int, d: int, M: int, dtype=torch.float32) -> TrafficReport | None:
    """The forward's traffic model: ``kind`` ``"small"`` (small-cache forward) or ``"large"``
    (FlashAttention order, tiles fitted to ``M``); ``None`` where it cannot tile ``M``."""
    try:
        if kind == "small":
            return small_forward_traffic(n, d, M, dtype=dtype)
        return large_forward_traffic(n, d, M, dtype=dtype, fit=True)
    except ValueError:
        return None


def small_forward_tiled_reads(report: TrafficReport) -> int:
    """The small-cache forward's traffic less its ``M``-independent part (every write and the
    element-wise sweep over ``f`` in ``fwd.small.f``): the operand reads of the tiled products,
    which fall as ``1/B ~ M^(-1/2)``."""
    return sum(b for kt in report.kernels.values() for t, b in kt.reads.items()
               if not (kt.name == "fwd.small.f" and t == "f"))


def kernel_forward_counted_bytes(n: int, d: int, M: int, regime: str = "small") -> int | None:
    """Bytes :func:`~sparse_io_attn.dense.forward` counts (``COUNT_IO``) with ``regime`` on fp32
    random inputs (Triton's interpreter on a CPU); ``None`` where it cannot tile ``M``."""
    g = torch.Generator().manual_seed(0)
    A1, A2, A3 = (torch.randn(n, d, generator=g) for _ in range(3))
    X, Y = (torch.randn(d, d, generator=g) / d for _ in range(2))
    if kernel_forward_traffic(regime, n, d, M) is None:
        return None
    with IOCounter() as io:
        forward(A1, A2, A3, X, Y, M=M, regime=regime)
    return io.report.total_bytes


# ============================================================================== executor
def executor_words(kind: str, n: int, d: int, M: int) -> int | None:
    """Closed-form words the executor's algorithm ``kind`` moves; ``None`` where it cannot run at
    ``M``."""
    variant = _variant(kind)
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
    variant = _variant(kind)
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


# ============================================================================== sweep tables
def m_grid(lo: float, hi: float, per_octave: int) -> list[int]:
    """Geometric grid of integer M from ``lo`` to ``hi`` (inclusive), ``per_octave`` points per 2x."""
    k = max(1, round(math.log2(hi / lo) * per_octave))
    return sorted({max(1, round(lo * (hi / lo) ** (i / k))) for i in range(k + 1)})


def cache_grid(d: int, m_min: int, m_max: int, per_octave: int = 2) -> list[int]:
    """The ``M`` of ``sweep cache``: :func:`m_grid` from ``m_min`` to ``m_max``, plus ``d^2`` itself
    when it lies in the range."""
    Ms = m_grid(m_min, m_max, per_octave)
    if d * d not in Ms and m_min <= d * d <= m_max:
        Ms = sorted(Ms + [d * d])
    return Ms


def counted_points(Ms, count_m_min: int) -> list[int]:
    """The ``M`` of ``Ms`` at which ``sweep cache`` runs the kernels: powers of 4 from ``count_m_min``."""
    return [M for M in Ms if M >= count_m_min and M & (M - 1) == 0 and (M.bit_length() - 1) % 2 == 0]


def cache_rows(n: int, d: int, Ms, *, count_n: int = 0, count_Ms=(), progress=None) -> list[dict]:
    """The rows of ``sparse-io-attn sweep cache`` (words), one per ``M``:

    ``bound*`` / ``compulsory`` (Theorem 1.1 with unit constants), ``executor_<kind>`` (closed
    forms at ``n``), ``kernel_<kind>_predicted`` (traffic model at ``n``, fp32 bytes / 4); with
    ``count_n``, ``executor_<kind>_run_at_count_n`` / ``..._closed_form_at_count_n`` (the executor
    run against its closed form at ``n = count_n``) at every ``M``, and at ``count_Ms``
    ``kernel_<kind>_counted_at_count_n`` / ``..._predicted_at_count_n`` (:func:`kernel_counted_bytes`
    against the model); last ``executor_small_m_dependent`` (Algorithm 6 less ``9n^2+3nd+d^2``).

    Forward (Table 1): ``bound_fwd`` (Saha & Ye, unit constants), ``executor_fwd_small`` (the
    small-cache forward's closed form) and ``executor_fwd_small_m_dependent`` (less
    ``3n^2+3nd+n``), ``kernel_fwd_small_predicted`` / ``kernel_fwd_large_predicted`` and
    ``kernel_fwd_small_tiled_reads`` (model, words); at ``count_Ms``
    ``kernel_fwd_small_counted_at_count_n`` / ``kernel_fwd_small_predicted_at_count_n``.
    ``None`` where an algorithm cannot run at ``M``. ``progress(note)`` is called after each step.
    """
    progress = progress or (lambda note: None)
    rows = []
    for M in Ms:
        b = dense_backward(n, d, M)
        row = {"M": M, "M_over_d2": M / (d * d), "bound_large_cache": b.terms["large_cache"],
               "bound_small_cache": b.terms["small_cache"], "bound": b.value_words,
               "compulsory": b.compulsory_words}
        for kind in KINDS:
            row[f"executor_{kind}"] = executor_words(kind, n, d, M)
            kb = kernel_bytes(kind, n, d, M)
            row[f"kernel_{kind}_predicted"] = None if kb is None else kb / _WORD_BYTES
        row["bound_fwd"] = dense_forward(n, d, M).value_words
        row["executor_fwd_small"] = small_forward_io(n, d, M) if M >= 4 else None
        row["executor_fwd_small_m_dependent"] = (None if row["executor_fwd_small"] is None else
                                                 row["executor_fwd_small"] - small_forward_m_independent(n, d))
        for kind in ("small", "large"):
            rep = kernel_forward_traffic(kind, n, d, M)
            row[f"kernel_fwd_{kind}_predicted"] = None if rep is None else rep.total_bytes / _WORD_BYTES
            if kind == "small":
                row["kernel_fwd_small_tiled_reads"] = None if rep is None else small_forward_tiled_reads(rep) / _WORD_BYTES
        rows.append(row)
        progress(f"M={M}")
    for row in rows:
        M = row["M"]
        if count_n:
            for kind in KINDS:
                res = executor_run_words(kind, count_n, d, M)
                row[f"executor_{kind}_run_at_count_n"] = None if res is None else res[0]
                row[f"executor_{kind}_closed_form_at_count_n"] = None if res is None else res[1]
            progress(f"executor M={M}")
        if M not in count_Ms:
            continue
        for kind in KINDS:
            kp = kernel_bytes(kind, count_n, d, M)
            kc = None if kp is None else kernel_counted_bytes(kind, count_n, d, M)
            row[f"kernel_{kind}_counted_at_count_n"] = None if kc is None else kc / _WORD_BYTES
            row[f"kernel_{kind}_predicted_at_count_n"] = None if kp is None else kp / _WORD_BYTES
        fp = kernel_forward_traffic("small", count_n, d, M)
        fc = None if fp is None else kernel_forward_counted_bytes(count_n, d, M, "small")
        row["kernel_fwd_small_counted_at_count_n"] = None if fc is None else fc / _WORD_BYTES
        row["kernel_fwd_small_predicted_at_count_n"] = None if fp is None else fp.total_bytes / _WORD_BYTES
        progress(f"counted M={M}")
    fixed = small_cache_m_independent(n, d)
    for r in rows:
        if r.get("executor_small"):
            r["executor_small_m_dependent"] = r["executor_small"] - fixed
    return rows


def slope_between(rows, key: str, lo: float, hi: float) -> float | None:
    """Log-log slope of ``row[key]`` against ``M`` over the rows with ``lo <= M/d^2 <= hi`` where
    ``key`` is present; ``None`` with fewer than two such rows."""
    pts = [(r["M"], r[key]) for r in rows if r.get(key) and lo <= r["M_over_d2"] <= hi]
    if len(pts) < 2:
        return None
    return loglog_slope(*zip(*pts))


def crossover(rows, a: str, b: str) -> int | None:
    """Smallest M at which series ``b`` moves no more than series ``a`` (both present)."""
    for r in rows:
        if r.get(a) is not None and r.get(b) is not None and r[b] <= r[a]:
            return r["M"]
    return None


def cache_findings(rows) -> dict:
    """What :func:`cache_rows` shows, as numbers (``None`` where a series has too few points):

    * ``executor_small_m_dependent_slope``: Algorithm 6 less its ``M``-independent part, ``M < d^2``.
    * ``executor`` / ``kernel``: ``small_slope`` (``M < d^2``), ``large_slope`` (``d^2 <= M <= 4d^2``),
      ``fa2_slope`` (``d^2 <= M <= 16d^2``), all including the ``M``-independent parts. (The
      crossings are not read off this grid: :func:`crossings` bisects the model.)
    * forward: ``executor_fwd_small_m_dependent_slope`` (``M < d^2``, the closed form less its
      ``M``-independent part), ``kernel_fwd_small_tiled_slope`` (the kernel model's tiled-product
      reads at the grid's ``M = 4B^2``, one per tile size ``B``, ``M < d^2``) and
      ``kernel_fwd_small_total_slope`` (its total there).
    * ``executor_runs`` / ``kernel_counts``: ``(equal, compared)`` points where the executor run
      equals its closed form / the kernels' counters equal the model, at ``count_n`` (backward and
      forward kernels).
    """
    below = 1 - 1e-9
    out = {"executor_small_m_dependent_slope": slope_between(rows, "executor_small_m_dependent", 0, below)}
    for src in ("executor", "kernel"):
        suffix = "" if src == "executor" else "_predicted"
        small, faithful, fa2 = (f"{src}_{kind}{suffix}" for kind in KINDS)
        out[src] = {"small_slope": slope_between(rows, small, 0, below),
                    "large_slope": slope_between(rows, faithful, 1, 4),
                    "fa2_slope": slope_between(rows, fa2, 1, 16)}
    out["executor_fwd_small_m_dependent_slope"] = slope_between(rows, "executor_fwd_small_m_dependent", 0, below)
    tile_pts = [r for r in rows if r.get("kernel_fwd_small_tiled_reads") and r["M_over_d2"] < 1
                and r["M"] == 4 * small_cache_block(r["M"]) ** 2]
    out["kernel_fwd_small_tile_Ms"] = [r["M"] for r in tile_pts]
    out["kernel_fwd_small_tiled_slope"] = (loglog_slope([r["M"] for r in tile_pts],
                                                        [r["kernel_fwd_small_tiled_reads"] for r in tile_pts])
                                           if len(tile_pts) >= 2 else None)
    out["kernel_fwd_small_total_slope"] = (loglog_slope([r["M"] for r in tile_pts],
                                                        [r["kernel_fwd_small_predicted"] for r in tile_pts])
                                           if len(tile_pts) >= 2 else None)
    runs = [(r[f"executor_{k}_run_at_count_n"], r[f"executor_{k}_closed_form_at_count_n"]) for r in rows
            for k in KINDS if r.get(f"executor_{k}_run_at_count_n") is not None]
    out["executor_runs"] = (sum(a == b for a, b in runs), len(runs))
    pairs = [(r[f"kernel_{k}_counted_at_count_n"], r[f"kernel_{k}_predicted_at_count_n"]) for r in rows
             for k in KINDS + ("fwd_small",) if r.get(f"kernel_{k}_counted_at_count_n") is not None]
    out["kernel_counts"] = (sum(c == p for c, p in pairs), len(pairs))
    return out


#: ``M/d^2`` of ``sweep dim``: 1/8 to 8 in half octaves
THRESHOLD_GRID = tuple(2 ** (i / 2) for i in range(-6, 7))


def threshold_rows(n: int, dims, device_M: int, progress=None) -> list[dict]:
    """The rows of ``sparse-io-attn sweep dim``: for each ``d``, ``M/d^2`` over :data:`THRESHOLD_GRID`
    and then the device's ``M`` (``at_device_M``), with the regime, Theorem 1.1 (unit
    constants), ``kernel_<kind>`` (traffic model, fp32 bytes / 4) and ``executor_<kind>`` (closed
    forms), :func:`compare_small_large`'s columns, and what ``dense.backward(regime="auto")`` runs
    there (:func:`~.regime.choose_backward` on the full backward, fp32, forward outputs given):
    ``auto_kernel``, ``auto_label``, ``auto_bytes`` and ``auto_ratio`` (bytes of the best kernel of
    the other family, or of the paper's regime when auto left it, over the chosen kernel's).
    ``progress()`` is called after each row."""
    progress = progress or (lambda: None)
    rows = []
    for d in dims:
        for M, at_dev in [(round(f * d * d), False) for f in THRESHOLD_GRID] + [(device_M, True)]:
            b = dense_backward(n, d, M)
            row = {"d": d, "M": M, "M_over_d2": M / (d * d), "at_device_M": at_dev, "regime": b.regime,
                   "bound": b.value_words, "compulsory": b.compulsory_words}
            for kind in KINDS:
                kb = kernel_bytes(kind, n, d, M)
                row[f"kernel_{kind}"] = None if kb is None else kb / _WORD_BYTES
                row[f"executor_{kind}"] = executor_words(kind, n, d, M)
            compare_small_large(row)
            try:
                c = choose_backward(n, d, M, dtype=torch.float32)
                other = c.compared_with()
                row.update(paper_regime=c.paper_regime, auto_kernel=c.kernel, auto_label=c.label,
                           auto_bytes=c.predicted_bytes, auto_summary=c.summary(),
                           auto_ratio=None if other is None else c.candidates[other]["bytes"] / c.predicted_bytes)
            except ValueError:  # no kernel tiles M
                row.update(paper_regime="small" if M < d * d else "large", auto_kernel=None, auto_label=None,
                           auto_bytes=None, auto_summary=None, auto_ratio=None)
            rows.append(row)
            progress()
    return rows


def compare_small_large(row: dict) -> None:
    """small-cache I/O over the better large-cache variant's, per source (``kernel_ratio`` from the
    kernels' model, ``executor_ratio`` from the closed forms; ``None`` where one side cannot run at
    this M); ``small_over_large`` / ``source`` / ``cheaper`` take the kernel's where it exists."""
    row.update(source=None, large_variant=None, small_over_large=None, cheaper=None)
    for src in ("executor", "kernel"):
        small = row.get(f"{src}_small")
        larges = {v: row.get(f"{src}_large_{v}") for v in ("faithful", "fa2") if row.get(f"{src}_large_{v}")}
        row[f"{src}_ratio"] = None
        if small and larges:
            variant = min(larges, key=larges.get)
            row[f"{src}_ratio"] = small / larges[variant]
            row.update(source=src, large_variant=variant, small_over_large=small / larges[variant],
                       cheaper="small-cache" if small < larges[variant] else "large-cache")


def threshold_findings(rows, d: int) -> dict:
    """For one ``d`` of :func:`threshold_rows`: ``device`` (the row at the device's ``M``) and, per
    source (``kernel``, ``executor``) with points where both sides run, ``(small_wins, lo, hi)``: the
    grid ``M/d^2`` where the small-cache algorithm moves less than the better large-cache variant,
    out of the grid span ``[lo, hi]``."""
    out = {"device": next(r for r in rows if r["d"] == d and r["at_device_M"])}
    for src in ("kernel", "executor"):
        pts = []
        for r in rows:
            if r["d"] != d or r["at_device_M"]:
                continue
            small = r.get(f"{src}_small")
            large = [r[f"{src}_large_{v}"] for v in ("faithful", "fa2") if r.get(f"{src}_large_{v}")]
            if small and large:
                pts.append((r["M_over_d2"], small < min(large)))
        if pts:
            out[src] = ([x for x, w in pts if w], min(x for x, _ in pts), max(x for x, _ in pts))
    return out
