"""The experiments behind ``sparse-io-attn sweep``: ``cache`` (the paper's Figure 1), ``dim`` (the
threshold sweep over d), ``sparsity`` (the Theorem 4.5 stress test) and the memory need of
``seq-len``; each returns rows (one dict per point) and its findings as lines of text.

Sources of each number (a column says which):

* ``executor``: closed-form word counts of the paper's Algorithm 6 (small cache) and Algorithm 9
  (large cache; ``faithful`` as the appendix writes it, ``fa2`` the FlashAttention-2 loop order)
  from :mod:`sparse_io_attn.experiments.pebble`, whose tests check them against the exact
  two-level-memory executor.
* ``kernel predicted``: the dense kernels' traffic model (:mod:`sparse_io_attn.dense.traffic`) at
  the requested ``n`` on the paper's ``g = dL/dX`` path, fp32: bytes / 4 = words.
* ``kernel counted``: the dense Triton kernels' own ``COUNT_IO`` counters (through the interpreter
  on a CPU, so only at a small ``count_n``), next to the model at that same ``n``.
* ``bound``: Theorem 1.1's two terms with unit constants (:func:`sparse_io_attn.bounds.dense_backward`).

Importing this module imports the dense Triton kernels (on a machine without CUDA it switches on
Triton's interpreter).
"""
from __future__ import annotations

from sparse_io_attn.dense.buffers import nn_buffer_bytes
from sparse_io_attn.experiments import figure1
from sparse_io_attn.experiments import sparsity_stress


# ============================================================================== cache
def cache_plan(d: int, m_min: int, m_max: int, per_octave: int, count_n: int,
               count_m_min: int) -> tuple[list[int], list[int], int]:
    """``(Ms, count_Ms, steps)``: the fast-memory sizes of the cache sweep (``per_octave`` per
    doubling from ``m_min`` to ``m_max``), those also counted through the kernels at ``count_n``
    (none when ``count_n`` is 0), and how many progress steps :func:`cache_sweep` reports."""
    Ms = figure1.cache_grid(d, m_min, m_max, per_octave)
    count_Ms = figure1.counted_points(Ms, count_m_min) if count_n else []
    return Ms, count_Ms, len(Ms) * (2 if count_n else 1) + len(count_Ms)


def cache_sweep(n: int, d: int, Ms: list[int], count_n: int, count_Ms: list[int],
                progress=None) -> tuple[list[dict], dict, list[str]]:
    """``(rows, crossings, notes)``: :func:`sparse_io_attn.experiments.figure1.cache_rows` over ``Ms``,
    the crossings of the small- and large-cache backwards (bisection on the model) and the findings
    in words. ``progress(note)`` is called once per step of :func:`cache_plan`."""
    rows = figure1.cache_rows(n, d, Ms, count_n=count_n, count_Ms=count_Ms, progress=progress)
    crossings = figure1.crossings(n, d)
    notes = cache_notes(figure1.cache_findings(rows), d) + figure1.crossing_lines(crossings, d)
    return rows, crossings, notes


def cache_notes(findings: dict, d: int) -> list[str]:
    """:func:`sparse_io_attn.experiments.figure1.cache_findings` in words."""
    out = []
    s = findings["executor_small_m_dependent_slope"]
    if s is not None:
        out.append(f"executor Alg. 6 less its M-independent 9n^2+3nd+d^2 words: slope {s:+.2f} for M < d^2 "
                   f"(bound: -0.5)")
    for src in ("executor", "kernel"):
        g = findings[src]
        bits = []
        if g["small_slope"] is not None:
            bits.append(f"small-cache slope {g['small_slope']:+.2f} for M < d^2")
        if g["large_slope"] is not None:
            bits.append(f"large-cache slope {g['large_slope']:+.2f} for d^2 <= M <= 4d^2")
        if g["fa2_slope"] is not None:
            bits.append(f"FA2-order slope {g['fa2_slope']:+.2f} for d^2 <= M <= 16d^2")
        if bits:
            out.append(f"{src}: " + "; ".join(bits) + " (log-log slopes include the M-independent parts)")
    fs = findings["executor_fwd_small_m_dependent_slope"]
    if fs is not None:
        out.append(f"forward: executor small-cache forward less its M-independent 3n^2+3nd+n words: slope {fs:+.2f} "
                   f"for M < d^2 (Saha & Ye: -0.5)")
    ks = findings["kernel_fwd_small_tiled_slope"]
    if ks is not None:
        out.append(f"forward: small-cache forward kernel (model), tiled-product reads at M = "
                   f"{', '.join(f'{M:,}' for M in findings['kernel_fwd_small_tile_Ms'])} (M = 4B^2 < d^2): "
                   f"slope {ks:+.3f}; total {findings['kernel_fwd_small_total_slope']:+.3f}")
    same, runs = findings["executor_runs"]
    if runs:
        out.append(f"executor run (two-level memory, float64) == closed form exactly at {same} "
                   f"of {runs} (algorithm, M) points at --count-n")
    same, pairs = findings["kernel_counts"]
    if pairs:
        out.append(f"kernels counted (COUNT_IO, Triton interpreter) == traffic model exactly at {same} of "
                   f"{pairs} (kernel, M) points at --count-n (backward kernels and the small-cache forward)")
    return out


# ============================================================================== dim
def dim_steps(dims: list[int]) -> int:
    """How many progress steps :func:`dim_sweep` reports for these head dimensions."""
    return len(dims) * (len(figure1.THRESHOLD_GRID) + 1)


def dim_sweep(n: int, dims: list[int], device_M: int, progress=None) -> tuple[list[dict], list[str]]:
    """``(rows, notes)``: :func:`sparse_io_attn.experiments.figure1.threshold_rows` for each ``d`` at the
    device's fast memory ``device_M`` (rows with ``at_device_M``) and over ``M / d^2``, and per ``d``
    where the small-cache backward moves less, what ``regime="auto"`` runs and the crossings."""
    rows = figure1.threshold_rows(n, dims, device_M, progress=progress)
    notes = []
    for d in dims:
        f = figure1.threshold_findings(rows, d)
        dev = f["device"]
        parts = []
        for src in ("kernel", "executor"):
            if src not in f:
                continue
            wins, lo, hi = f[src]
            span = f"M/d^2 in [{lo:.3g}, {hi:.3g}]"
            parts.append(f"{src}: small-cache moves less at M/d^2 {', '.join(f'{x:.3g}' for x in wins)} of {span}"
                         if wins else f"{src}: small-cache never moves less over {span}")
        notes.append(f"d={d}: device M/d^2 = {dev['M_over_d2']:.3g} ({dev['regime']} cache); cheaper there: "
                     f"{dev['cheaper']} ({dev['source']}, dX path, small/large = "
                     f"{dev['small_over_large'] or float('nan'):.3g}); " + "; ".join(parts))
        if dev.get("auto_summary"):
            notes.append(f"d={d}: dense.backward(regime='auto') at the device's M (all five gradients): "
                         f"{dev['auto_summary']}")
        notes += [f"d={d}: {line}" for line in figure1.crossing_lines(figure1.crossings(n, d), d)]
    return rows, notes


# ============================================================================== sparsity
def sparsity_sweep(n: int, d: int, densities: list[float], axes: tuple[str, ...], block_n: int, block_d: int,
                   count: bool, progress=None) -> tuple[list[dict], list[str]]:
    """``(rows, notes)``: :func:`sparse_io_attn.experiments.sparsity_stress.sparsity_sweep` (rows
    passed through unchanged; ``progress(row)`` after each) and :func:`sparsity_findings`."""
    rows = sparsity_stress.sparsity_sweep(n, d, densities=densities, axes=axes, block_n=block_n,
                                          block_d=block_d, count=count, progress=progress)
    return rows, sparsity_findings(rows)


def lemma_f2_kept_term(r: dict) -> float:
    """``(Z_AX + Z_A)^2 / M``: the large-cache bound of the product (A1 X) A2^T that the proof of
    Lemma F.2 has before it drops nnz(A1 X) (Lemma F.1 with R1 = nnz(A1 X) + nnz(A2) >= Z_AX + Z_A)."""
    return (r["Z_AX"] + r["Z_A"]) ** 2 / r["M_words"]


def sparsity_findings(rows) -> list[str]:
    """The stress test in words, leading with traffic / max(compulsory, bound) (the library's floor),
    per axis from the sparsest to the densest point; for the sparsest A1/A2 point, the two causes of
    its traffic / bound ratio: the unit-constant bound against the compulsory traffic (reading the
    operands once), and the term the proof of Lemma F.2 drops (nnz(A1 X))."""
    out = []
    for n in sorted({r.get("n") for r in rows}, key=lambda x: -(x or 0)):
        for axis in dict.fromkeys(r["axis"] for r in rows):
            pts = sorted((r for r in rows if r["axis"] == axis and r.get("n") == n), key=lambda r: r["density"])
            if not pts:
                continue
            lo, hi = pts[0], pts[-1]
            at = f"n={n}, " if n is not None else ""
            out.append(f"{at}{axis}: (fwd + bwd) / max(compulsory, bound) {lo['total_ratio_floor']:.3g} at density "
                       f"{lo['density']:g} -> {hi['total_ratio_floor']:.3g} at {hi['density']:g} (floor set by "
                       f"{'compulsory' if lo['compulsory_words'] >= lo['bound_words'] else 'bound'} -> "
                       f"{'compulsory' if hi['compulsory_words'] >= hi['bound_words'] else 'bound'}); per pass "
                       f"against the bound alone: backward {lo['bwd_ratio']:.3g} -> {hi['bwd_ratio']:.3g}, forward "
                       f"{lo['fwd_ratio']:.3g} -> {hi['fwd_ratio']:.3g} (binding term {lo['binding']} -> {hi['binding']})")
            if axis == "A":
                kept = lemma_f2_kept_term(lo)
                out.append(
                    f"{at}A at density {lo['density']:g}, why traffic / bound reaches {lo['fwd_ratio']:.3g} (fwd) and "
                    f"{lo['bwd_ratio']:.3g} (bwd): (1) Z_A = {lo['Z_A']:,} {'<' if lo['Z_A'] < lo['M_words'] else '>='} "
                    f"M = {lo['M_words']:,}, so (Z_A^2 + Z_A Z_X)/M = {lo['bound_words']:,.0f} words falls below even "
                    f"reading the operands once (Z_A + Z_X = {lo['Z_A'] + lo['Z_X']:,} words; the compulsory traffic, "
                    f"operands read once and output written once, is {lo['compulsory_words']:,} words, "
                    f"{lo['compulsory_words'] / lo['bound_words']:.3g}x the bound); against max(compulsory, bound) "
                    f"the ratio is {lo['total_ratio_floor']:.3g}; (2) the proof of Lemma F.2 drops nnz(A1 X): keeping "
                    f"(Z_AX + Z_A)^2/M = {kept:,.0f} words would raise the bound {kept / lo['bound_words']:.3g}x there")
    out.append(f"traffic source: {rows[0]['source'] if rows else '-'}; words = matrix elements moved, index bytes "
               f"excluded; bound = Theorem 4.5 with unit constants; floor = max(compulsory, bound)")
    return out


# ============================================================================== seq-len
def small_cache_need(n: int, head_dim: int, heads: int) -> int:
    """Bytes the small-cache kernel (Algorithm 6) allocates for its n x n matrices f, q, p and the
    d x n matrix T (fp32), over ``heads`` (batch x head) problems: ``dense.buffers.nn_buffer_bytes``."""
    return int(nn_buffer_bytes(n, head_dim, heads))
