"""The ``sweep cache`` / ``sweep dim`` tables: the three sources side by side in words, and their findings."""
from __future__ import annotations

import math

import torch

from sparse_io_attn.bounds import dense_backward, dense_forward
from sparse_io_attn.dense.regime import choose_backward
from sparse_io_attn.dense.tiles import small_cache_block
from sparse_io_attn.experiments.figure1.common import KINDS, WORD_BYTES
from sparse_io_attn.experiments.figure1.executor import executor_run_words, executor_words
from sparse_io_attn.experiments.figure1.kernels import (kernel_bytes, kernel_counted_bytes,
                                                        kernel_forward_counted_bytes, kernel_forward_traffic,
                                                        small_forward_tiled_reads)
from sparse_io_attn.experiments.pebble import small_cache_m_independent, small_forward_io, small_forward_m_independent
from sparse_io_attn.experiments.slopes import loglog_slope


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
            row[f"kernel_{kind}_predicted"] = None if kb is None else kb / WORD_BYTES
        row["bound_fwd"] = dense_forward(n, d, M).value_words
        row["executor_fwd_small"] = small_forward_io(n, d, M) if M >= 4 else None
        row["executor_fwd_small_m_dependent"] = (None if row["executor_fwd_small"] is None else
                                                 row["executor_fwd_small"] - small_forward_m_independent(n, d))
        for kind in ("small", "large"):
            rep = kernel_forward_traffic(kind, n, d, M)
            row[f"kernel_fwd_{kind}_predicted"] = None if rep is None else rep.total_bytes / WORD_BYTES
            if kind == "small":
                tiled = None if rep is None else small_forward_tiled_reads(rep) / WORD_BYTES
                row["kernel_fwd_small_tiled_reads"] = tiled
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
            row[f"kernel_{kind}_counted_at_count_n"] = None if kc is None else kc / WORD_BYTES
            row[f"kernel_{kind}_predicted_at_count_n"] = None if kp is None else kp / WORD_BYTES
        fp = kernel_forward_traffic("small", count_n, d, M)
        fc = None if fp is None else kernel_forward_counted_bytes(count_n, d, M, "small")
        row["kernel_fwd_small_counted_at_count_n"] = None if fc is None else fc / WORD_BYTES
        row["kernel_fwd_small_predicted_at_count_n"] = None if fp is None else fp.total_bytes / WORD_BYTES
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
                row[f"kernel_{kind}"] = None if kb is None else kb / WORD_BYTES
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
