"""The I/O sweeps of ``sparse-io-attn sweep``: ``cache`` (the paper's Figure 1), ``dim`` (the
threshold sweep over d) and ``sparsity`` (the Theorem 4.5 stress test), with their plots.

The numbers come from the library (:mod:`sparse_io_attn.dense.figure1` for ``cache`` and ``dim``,
:func:`sparse_io_attn.experiments.sparsity_stress.sparsity_sweep` for ``sparsity``); this module parses
the flags, words the findings and draws the plots. Sources of each number (a column says which):

* ``executor``: closed-form word counts of the paper's Algorithm 6 (small cache) and Algorithm 9
  (large cache; ``faithful`` as the appendix writes it, ``fa2`` the FlashAttention-2 loop order)
  from :mod:`sparse_io_attn.bounds.pebble`, whose tests check them against the exact
  two-level-memory executor.
* ``kernel predicted``: the dense kernels' traffic model (:mod:`sparse_io_attn.dense.traffic`) at
  the requested ``n`` on the paper's ``g = dL/dX`` path, fp32: bytes / 4 = words.
* ``kernel counted``: the dense Triton kernels' own ``COUNT_IO`` counters (through the interpreter
  on a CPU, so only at a small ``--count-n``), next to the model at that same ``n``.
* ``bound``: Theorem 1.1's two terms with unit constants (:func:`sparse_io_attn.bounds.dense_backward`).

The dense kernels (and so Triton) are imported only when a sweep runs, not to build the parser.
"""
from __future__ import annotations

import torch

from sparse_io_attn.cli import _common as common
from sparse_io_attn.cli.bounds import default_cache_words
from sparse_io_attn.experiments import sparsity_stress

# ============================================================================== cache
CACHE_DOC = """Figure 1 of the paper with measured points: backward I/O vs fast-memory size M at fixed
n, d for the small-cache (Algorithm 6) and large-cache (Algorithm 9, as written and in the FA2 loop
order) algorithms -- the exact executor's closed forms and the Triton kernels' traffic model at n,
and the kernels' counted traffic at a small --count-n through the interpreter -- with both bound
terms of Theorem 1.1 and their crossover M = d^2 marked; next to them the forward (Table 1): the
small-cache forward (Saha & Ye; executor and kernel) and the large-cache forward (kernel) with
Saha & Ye's bound. The crossings of the small- and large-cache backwards are computed by
bisection on the model (kernels with the tiles they can run, and the algorithms as written)."""


def add_cache_args(p) -> None:
    p.add_argument("--seq-len", type=common.parse_count, default=2048, help="n (default 2048)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--m-min", type=common.parse_count, default=None, help="smallest M in words (default d^2/16)")
    p.add_argument("--m-max", type=common.parse_count, default=None, help="largest M in words (default 16 d^2)")
    p.add_argument("--per-octave", type=int, default=2, help="M points per doubling (default 2)")
    p.add_argument("--count-n", type=common.parse_count, default=128,
                   help="n of the counted kernel runs (interpreter; 0 = none; default 128)")
    p.add_argument("--count-m-min", type=common.parse_count, default=4096,
                   help="counted runs only at M >= this (default 4096: 32 x 32 tiles; 16 x 16 tiles take "
                        "minutes in the interpreter), at the powers of 4 in the range")


def run_cache(args):
    n, d = args.seq_len, args.head_dim
    if not 16 <= d <= 256:
        raise ValueError(f"--head-dim must be in 16..256, got {d}")
    m_min = args.m_min or max(16, d * d // 16)
    m_max = args.m_max or 16 * d * d
    if m_min >= m_max:
        raise ValueError(f"--m-min {m_min} must be below --m-max {m_max}")
    if args.per_octave < 1:
        raise ValueError(f"--per-octave must be >= 1, got {args.per_octave}")
    if args.count_n and args.count_n > 1024:
        raise ValueError(f"--count-n {args.count_n} is too large for the Triton interpreter (at most 1024)")
    header = common.machine_header(torch.float32)  # kernel bytes / 4 = words: the dense kernels' intermediates are fp32
    header.update({"n": n, "d": d, "count_n": args.count_n, "units": "words (elements); kernel fp32 bytes / 4; dX path only"})
    # after the header, which records the environment as the command found it (importing the
    # dense kernels sets TRITON_INTERPRET=1 on a machine without CUDA)
    from sparse_io_attn.dense import figure1

    Ms = figure1.cache_grid(d, m_min, m_max, args.per_octave)
    count_Ms = figure1.counted_points(Ms, args.count_m_min) if args.count_n else []
    total = len(Ms) * (2 if args.count_n else 1) + len(count_Ms)
    with common.progress(total, "sweep cache", enabled=not args.no_progress) as bar:
        rows = figure1.cache_rows(n, d, Ms, count_n=args.count_n, count_Ms=count_Ms,
                                  progress=lambda note: bar.update(note=note))
    cross = figure1.crossings(n, d)
    header["crossing_kernel_fa2_M"] = cross["kernel_fa2"]["M"]
    header["crossing_executor_faithful_M"] = cross["executor_faithful"]["always_from_M"]
    notes = _cache_notes(figure1.cache_findings(rows), d) + figure1.crossing_lines(cross, d)
    columns = [("M", "M words"), ("M_over_d2", "M/d^2"), ("bound", "bound (unit c.)"),
               ("executor_small", "exec Alg6"), ("executor_large_faithful", "exec Alg9"),
               ("executor_large_fa2", "exec Alg9-FA2"), ("kernel_small_predicted", "kernel small (pred)"),
               ("kernel_large_faithful_predicted", "kernel large (pred)"),
               ("kernel_large_fa2_predicted", "kernel FA2 (pred)"), ("bound_fwd", "fwd bound"),
               ("executor_fwd_small", "exec fwd small"), ("kernel_fwd_small_predicted", "kernel fwd small (pred)"),
               ("kernel_fwd_large_predicted", "kernel fwd large (pred)")]
    if count_Ms:
        columns += [("kernel_small_counted_at_count_n", f"small counted n={args.count_n}"),
                    ("kernel_small_predicted_at_count_n", f"small pred n={args.count_n}"),
                    ("kernel_fwd_small_counted_at_count_n", f"fwd small counted n={args.count_n}"),
                    ("kernel_fwd_small_predicted_at_count_n", f"fwd small pred n={args.count_n}")]
    return "cache", header, rows, columns, notes, lambda path: plot_cache(rows, header, path)


def _cache_notes(f: dict, d: int) -> list[str]:
    """:func:`sparse_io_attn.dense.figure1.cache_findings` in words."""
    out = []
    s = f["executor_small_m_dependent_slope"]
    if s is not None:
        out.append(f"executor Alg. 6 less its M-independent 9n^2+3nd+d^2 words: slope {s:+.2f} for M < d^2 "
                   f"(bound: -0.5)")
    for src in ("executor", "kernel"):
        g = f[src]
        bits = []
        if g["small_slope"] is not None:
            bits.append(f"small-cache slope {g['small_slope']:+.2f} for M < d^2")
        if g["large_slope"] is not None:
            bits.append(f"large-cache slope {g['large_slope']:+.2f} for d^2 <= M <= 4d^2")
        if g["fa2_slope"] is not None:
            bits.append(f"FA2-order slope {g['fa2_slope']:+.2f} for d^2 <= M <= 16d^2")
        if bits:
            out.append(f"{src}: " + "; ".join(bits) + " (log-log slopes include the M-independent parts)")
    fs = f["executor_fwd_small_m_dependent_slope"]
    if fs is not None:
        out.append(f"forward: executor small-cache forward less its M-independent 3n^2+3nd+n words: slope {fs:+.2f} "
                   f"for M < d^2 (Saha & Ye: -0.5)")
    ks = f["kernel_fwd_small_tiled_slope"]
    if ks is not None:
        out.append(f"forward: small-cache forward kernel (model), tiled-product reads at M = "
                   f"{', '.join(f'{M:,}' for M in f['kernel_fwd_small_tile_Ms'])} (M = 4B^2 < d^2): slope {ks:+.3f}; "
                   f"total {f['kernel_fwd_small_total_slope']:+.3f}")
    same, runs = f["executor_runs"]
    if runs:
        out.append(f"executor run (two-level memory, float64) == closed form exactly at {same} "
                   f"of {runs} (algorithm, M) points at --count-n")
    same, pairs = f["kernel_counts"]
    if pairs:
        out.append(f"kernels counted (COUNT_IO, Triton interpreter) == traffic model exactly at {same} of "
                   f"{pairs} (kernel, M) points at --count-n (backward kernels and the small-cache forward)")
    return out


def plot_cache(rows, header, path) -> None:
    plt = common.pyplot()
    n, d, cn = header["n"], header["d"], header["count_n"]
    has_counted = any(r.get("kernel_small_counted_at_count_n") for r in rows)
    fig, axes = plt.subplots(1, 2 if has_counted else 1, figsize=(15 if has_counted else 10, 5.5), squeeze=False,
                             gridspec_kw={"width_ratios": [1.6, 1]} if has_counted else None)
    ax = axes[0][0]
    M = [r["M"] for r in rows]
    colors = {"small": "tab:red", "large_faithful": "tab:blue", "large_fa2": "tab:green"}
    labels = {"small": "Alg. 6 small-cache", "large_faithful": "Alg. 9 large-cache (as written)",
              "large_fa2": "Alg. 9 FA2 loop order"}
    for key, c in colors.items():
        _line(ax, M, rows, f"executor_{key}", c, "-", None, f"executor: {labels[key]}")
        _line(ax, M, rows, f"kernel_{key}_predicted", c, "none", "o", f"kernel (model at n): {labels[key]}")
    ax.plot(M, [r["bound_large_cache"] for r in rows], color="0.3", ls="--", lw=1, label="bound (n²d²+nd³)/M")
    ax.plot(M, [r["bound_small_cache"] for r in rows], color="0.3", ls=":", lw=1.2, label="bound (n²d+nd²)/√M")
    ax.plot(M, [r["compulsory"] for r in rows], color="0.6", ls="-.", lw=1, label="compulsory (8nd+n)")
    _line(ax, M, rows, "executor_fwd_small", "tab:orange", "--", None, "forward, executor: small-cache (Saha & Ye)")
    _line(ax, M, rows, "kernel_fwd_small_predicted", "tab:orange", "none", "s", "forward, kernel (model): small-cache")
    _line(ax, M, rows, "kernel_fwd_large_predicted", "tab:cyan", "none", "s", "forward, kernel (model): large-cache")
    ax.plot(M, [r["bound_fwd"] for r in rows], color="tab:orange", ls=":", lw=1, label="forward bound (Saha & Ye)")
    ax.axvline(d * d, color="k", lw=0.8)
    ax.text(d * d, 0.98, " M = d² (bound crossover)", fontsize=8, va="top", transform=ax.get_xaxis_transform())
    for key, label, color, y in (("crossing_executor_faithful_M", "Alg 9 < Alg 6 from", "tab:purple", 0.93),
                                 ("crossing_kernel_fa2_M", "FA2 kernel < small from", "tab:green", 0.83)):
        cross = header.get(key)
        if cross:
            ax.axvline(cross, color=color, lw=0.8, ls="--")
            ax.text(cross, y, f" {label}\n M={cross:,} (bisection)", fontsize=7, color=color, va="top",
                    transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fast memory M (words)")
    ax.set_ylabel("I/O (words): backward; forward in orange/cyan")
    ax.set_title(f"Figure 1 reproduction: n={n}, d={d} (backward, and forward of Table 1)", fontsize=10)
    ax.legend(fontsize=7, loc="lower left", ncol=2, framealpha=0.9)
    ax.grid(True, which="both", alpha=0.25)
    if has_counted:
        ax2 = axes[0][1]
        for key, c in colors.items():
            _line(ax2, M, rows, f"kernel_{key}_predicted_at_count_n", c, "-", None, f"kernel model: {labels[key]}")
            _line(ax2, M, rows, f"kernel_{key}_counted_at_count_n", c, "none", "x", f"kernel counted: {labels[key]}")
            _line(ax2, M, rows, f"executor_{key}_run_at_count_n", c, ":", "+", f"executor run: {labels[key]}")
        _line(ax2, M, rows, "kernel_fwd_small_predicted_at_count_n", "tab:orange", "--", None,
              "kernel model: small-cache forward")
        _line(ax2, M, rows, "kernel_fwd_small_counted_at_count_n", "tab:orange", "none", "x",
              "kernel counted: small-cache forward")
        ax2.axvline(d * d, color="k", lw=0.8)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("fast memory M (words)")
        ax2.set_ylabel("traffic (words): backward; forward in orange")
        ax2.set_title(f"n={cn}, d={d}: kernels counted (interpreter) vs model; executor run", fontsize=10)
        ax2.legend(fontsize=7, loc="upper right", framealpha=0.9)
        ax2.grid(True, which="both", alpha=0.25)
    common.save_figure(fig, path, header)


def _line(ax, M, rows, key, color, ls, marker, label):
    pts = [(m, r[key]) for m, r in zip(M, rows) if r.get(key)]
    if pts:
        ax.plot(*zip(*pts), color=color, ls=ls, marker=marker, ms=4, lw=1.3, label=label,
                mfc="none" if marker == "o" else color)


# ============================================================================== dim
DIM_DOC = """Threshold sweep over d (default 64, 128, 256) at a device's fast memory M: for each d,
the paper's regime M vs d^2, the bound, and the small-cache and large-cache kernels' traffic (model;
next to it the executor's closed forms, which also cover the M the kernels cannot tile) at the
device's M and over M/d^2 from 1/8 to 8, showing where the small-cache algorithm stops paying; the
kernel dense.backward(regime="auto") runs there (fewest predicted bytes among the kernels that fit);
and the crossings, by bisection on the model. On a CPU no timings are taken."""


def add_dim_args(p) -> None:
    p.add_argument("--dims", default="64,128,256", help="comma list of d (default 64,128,256)")
    p.add_argument("--seq-len", type=common.parse_count, default=8192, help="n (default 8192)")
    p.add_argument("--device", default="h100", help="device table entry giving M (default h100)")
    p.add_argument("--cache", default=None, help="M in words or bytes (overrides --device)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")


def run_dim(args):
    dtype = common.parse_dtype(args.dtype)
    dims = common.parse_list(args.dims, item=int, what="--dims") if all(
        s.strip().isdigit() for s in args.dims.split(",") if s.strip()) else None
    if not dims or any(x < 16 or x > 256 for x in dims):
        raise ValueError(f"--dims must be integers in 16..256, got {args.dims!r}")
    M_dev = default_cache_words(args.cache, dtype, None if args.cache else args.device)
    n = args.seq_len
    header = common.machine_header(dtype)
    header.update({"n": n, "device_M_words": M_dev, "M_from": args.cache or args.device})
    # after the header, which records the environment as the command found it (importing the
    # dense kernels sets TRITON_INTERPRET=1 on a machine without CUDA)
    from sparse_io_attn.dense import figure1

    header["units"] = "words; small/large columns: dX path (fp32 bytes / 4); auto: all five gradients"
    with common.progress(len(dims) * (len(figure1.THRESHOLD_GRID) + 1), "sweep dim", enabled=not args.no_progress) as bar:
        rows = figure1.threshold_rows(n, dims, M_dev, progress=bar.update)
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
        cross = figure1.crossings(n, d)
        notes += [f"d={d}: {line}" for line in figure1.crossing_lines(cross, d)]
    columns = [("d", "d"), ("M", "M words"), ("M_over_d2", "M/d^2"), ("regime", "paper regime"), ("bound", "bound"),
               ("kernel_small", "small (pred)"), ("kernel_large_faithful", "large (pred)"),
               ("kernel_large_fa2", "FA2 order (pred)"), ("small_over_large", "small/large"),
               ("large_variant", "vs"), ("cheaper", "cheaper"), ("source", "source"),
               ("auto_label", "auto runs (all grads)"), ("auto_ratio", "x fewer B")]
    table_rows = [r for r in rows if r["at_device_M"]]
    return "dim", header, rows, columns, notes, lambda path: plot_dim(rows, header, path), table_rows


def plot_dim(rows, header, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    dims = sorted({r["d"] for r in rows})
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, d in enumerate(dims):
        for src, ls, what in (("kernel", "-", "kernels (model)"), ("executor", ":", "executor")):
            pts = [(r["M_over_d2"], r[f"{src}_ratio"]) for r in rows
                   if r["d"] == d and not r["at_device_M"] and r.get(f"{src}_ratio")]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, ls=ls, color=palette[i % 5], label=f"d={d}, {what}")
        dev = next(r for r in rows if r["d"] == d and r["at_device_M"])
        if dev["small_over_large"]:
            ax.plot([dev["M_over_d2"]], [dev["small_over_large"]], marker="*", ms=14, color=palette[i % 5],
                    mec="k", ls="none", label=f"d={d} at {header['M_from']} M (M/d²={dev['M_over_d2']:.2g})")
    ax.axhline(1, color="k", lw=0.8)
    ax.axvline(1, color="0.4", lw=0.8, ls="--")
    ax.text(1, 0.98, " M = d²", va="top", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M / d²")
    ax.set_ylabel("small-cache I/O / best large-cache I/O  (<1: small wins)")
    ax.set_title(f"threshold sweep, n={header['n']}, dtype {header['dtype']}", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.25)
    common.save_figure(fig, path, header)


# ============================================================================== sparsity
SPARSITY_DOC = """Theorem 4.5 stress test: sweeps the block density of A1/A2, of X and of the QK pattern
independently (the other operands full) and tabulates the sparse-operand kernels' traffic (forward and
backward, matrix elements; the exact traffic model, or --count to run the kernels through Triton's
interpreter at small n), Z_A, Z_X, Z_AX, Z_AXA, the Theorem 4.5 bound with unit constants at M = the
kernels' per-program fast memory, and measured/bound (sparse_io_attn.experiments.sparsity_stress.sparsity_sweep)."""


def add_sparsity_args(p) -> None:
    p.add_argument("--seq-len", type=common.parse_count, default=4096, help="n (default 4096)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0", help="block densities (default 0.05,...,1.0)")
    p.add_argument("--axes", default="A,X,QK", help="operands to sweep: A (A1 and A2), X, QK (default all)")
    p.add_argument("--block-n", type=int, default=64, help="block rows of A1/A2 and the QK pattern (default 64)")
    p.add_argument("--block-d", type=int, default=16, help="block columns of A1/A2, blocks of X (default 16)")
    p.add_argument("--count", action="store_true", help="count with the kernels (interpreter; n <= 512)")


def run_sparsity(args):
    densities = [_density(x) for x in common.parse_list(args.densities, what="--densities")]
    axes = common.parse_list(args.axes, allowed=sparsity_stress.AXES, what="--axes")
    if args.count and args.seq_len > 512:
        raise ValueError(f"--count runs the kernels through the Triton interpreter; use --seq-len <= 512, "
                         f"got {args.seq_len}")
    if args.count:
        import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter set-up before triton is imported)
    header = common.machine_header(torch.float32)
    header.update({"n": args.seq_len, "d": args.head_dim, "block_n": args.block_n, "block_d": args.block_d,
                   "M": "kernel per-program fast memory (paper.traffic.kernel_fast_memory_words)"})
    with common.progress(len(axes) * len(densities), "sweep sparsity", enabled=not args.no_progress) as bar:
        rows = sparsity_stress.sparsity_sweep(args.seq_len, args.head_dim, densities=densities, axes=tuple(axes),
                                     block_n=args.block_n, block_d=args.block_d, count=args.count,
                                     progress=lambda r: bar.update(note=f"{r['axis']} {r['density']}"))
    notes = sparsity_findings(rows)
    columns = [(k, k) for k in ("axis", "density", "Z_A", "Z_X", "Z_AX", "Z_AXA", "M_words", "bound_words",
                                "binding", "fwd_words", "bwd_words", "fwd_ratio", "bwd_ratio", "total_ratio_floor")]
    return "sparsity", header, rows, columns, notes, lambda path: plot_sparsity(rows, header, path)


def lemma_f2_kept_term(r: dict) -> float:
    """``(Z_AX + Z_A)^2 / M``: the large-cache bound of the product (A1 X) A2^T that the proof of
    Lemma F.2 has before it drops nnz(A1 X) (Lemma F.1 with R1 = nnz(A1 X) + nnz(A2) >= Z_AX + Z_A)."""
    return (r["Z_AX"] + r["Z_A"]) ** 2 / r["M_words"]


def sparsity_findings(rows) -> list[str]:
    """The stress test in words, leading with traffic / max(compulsory, bound) (the library's floor),
    per axis from the sparsest to the densest point; for the sparsest A1/A2 point, the two causes of
    its large traffic / bound ratio: the unit-constant bound falls below the compulsory traffic
    (reading the operands once), and the proof of Lemma F.2 drops nnz(A1 X)."""
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


def _density(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"--densities must be numbers in (0, 1], got {text!r}") from None
    if not 0 < x <= 1:
        raise ValueError(f"--densities must be in (0, 1], got {x}")
    return x


def plot_sparsity(rows, header, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    palette = {"A": "tab:blue", "X": "tab:orange", "QK": "tab:green"}
    for axis in dict.fromkeys(r["axis"] for r in rows):
        pts = sorted((r["density"], r["fwd_ratio"], r["bwd_ratio"]) for r in rows if r["axis"] == axis)
        c = palette.get(axis, "tab:gray")
        name = "A1, A2" if axis == "A" else axis
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", color=c, label=f"{name} swept: backward")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", ls="--", color=c, label=f"{name} swept: forward")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("block density of the swept operand (others full)")
    ax.set_ylabel("kernel traffic / Theorem 4.5 bound (unit constants)")
    ax.set_title(f"Theorem 4.5 stress test, n={header['n']}, d={header['d']}", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.25)
    common.save_figure(fig, path, header)
