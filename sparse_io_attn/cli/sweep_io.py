"""The I/O sweeps of ``sparse-io-attn sweep``: ``cache`` (the paper's Figure 1), ``dim`` (the
threshold sweep over d) and ``sparsity`` (the Theorem 4.5 stress test), with their plots.

Sources of each number (a column says which):

* ``executor``: closed-form word counts of the paper's Algorithm 6 (small cache) and Algorithm 9
  (large cache; ``faithful`` as the appendix writes it, ``fa2`` the FlashAttention-2 loop order)
  from :mod:`sparse_io_attn.bounds.pebble`, whose tests check them against the exact
  two-level-memory executor.
* ``kernel predicted``: the dense kernels' traffic model (:mod:`sparse_io_attn.dense.traffic`) at
  the requested ``n`` on the paper's ``g = dL/dX`` path, fp32: bytes / 4 = words.
* ``kernel counted``: the dense Triton kernels' own ``COUNT_IO`` counters (through the interpreter
  on a CPU, so only at a small ``--count-n``), next to the model at that same ``n``.
* ``bound``: Theorem 1.1's two terms with unit constants (:func:`sparse_io_attn.bounds.dense_backward`).
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.cli import _common as C

# ============================================================================== adapters
# (the only places that know the other modules' function names)


def _pebble():
    return C.optional_module("sparse_io_attn.bounds.pebble", "the executor's closed forms")


def executor_io(kind: str, n: int, d: int, M: int) -> int | None:
    """Closed-form I/O (words) of the executor's algorithm; ``None`` where it cannot run at ``M``."""
    P = _pebble()
    try:
        if kind == "small":
            return int(P.small_cache_io(n, d, M))
        return int(P.large_cache_io(n, d, M, variant=kind.split(":")[1]))
    except ValueError:
        return None


def executor_run(kind: str, n: int, d: int, M: int) -> tuple[int, int] | None:
    """``(words moved by actually running the executor, closed form)`` for ``kind`` on random float64
    inputs of size ``n x d``; ``None`` where the algorithm cannot run at ``M``."""
    P = _pebble()
    g = torch.Generator().manual_seed(0)
    A1, A2, A3, dO = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4))
    X, Y = (torch.randn(d, d, generator=g, dtype=torch.float64) / d for _ in range(2))
    try:
        if kind == "small":
            run = P.run_small_cache(A1, A2, A3, X, Y, dO, M)
        else:
            run = P.run_large_cache(A1, A2, A3, X, Y, dO, M, variant=kind.split(":")[1])
    except ValueError:
        return None
    return run.total, executor_io(kind, n, d, M)


def _dense_traffic():
    return C.optional_module("sparse_io_attn.dense.traffic", "the dense kernels' traffic model")


def _g_path(kind: str) -> tuple:
    """The dense kernels on the paper's ``g = dL/dX`` path (what the executor and Figure 1 count)."""
    if kind == "small":
        return C.optional_module("sparse_io_attn.dense.small_cache", "the dense kernels").G_PATH
    return C.optional_module("sparse_io_attn.dense.large_cache", "the dense kernels").G_PATH[kind.split(":")[1]]


def kernel_predicted(kind: str, n: int, d: int, M: int) -> int | None:
    """Predicted fp32 bytes of the dense backward kernels of ``kind`` ("small" or
    "large:<variant>") on the ``dX`` path; ``None`` where the kernel cannot tile ``M``."""
    T = _dense_traffic()
    try:
        if kind == "small":
            rep = T.small_cache_traffic(n, d, M, dtype=torch.float32, g_only=True)
        else:
            rep = T.large_cache_traffic(n, d, M, dtype=torch.float32, variant=kind.split(":")[1], g_only=True)
    except ValueError:
        return None
    return rep.total_bytes


def kernel_counted(kind: str, n: int, d: int, M: int) -> int | None:
    """Bytes the dense backward kernels of ``kind`` count on the ``dX`` path (fp32 random inputs of
    size ``n x d``; Triton's interpreter on a CPU)."""
    import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter set-up before triton is imported)
    dense = C.optional_module("sparse_io_attn.dense", "counted kernel traffic")
    from sparse_io_attn.accounting import IOCounter
    g = torch.Generator().manual_seed(0)
    A1, A2, A3, dO = (torch.randn(n, d, generator=g) for _ in range(4))
    X, Y = (torch.randn(d, d, generator=g) / d for _ in range(2))
    try:
        if kind == "small":
            with IOCounter() as io:
                dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=M)
        else:
            O, lse = dense.forward(A1, A2, A3, X, Y, M=M)
            with IOCounter() as io:
                dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, variant=kind.split(":")[1])
    except ValueError:
        return None
    path = _g_path(kind)
    return sum(k.total for name, k in io.report.kernels.items() if name in path)


def _bound(n, d, M):
    B = C.optional_module("sparse_io_attn.bounds", "the bound curves")
    return B.dense_backward(n, d, M)


def _m_grid(lo: float, hi: float, per_octave: int) -> list[int]:
    """Geometric grid of integer M from ``lo`` to ``hi`` (inclusive), ``per_octave`` points per 2x."""
    k = max(1, round(math.log2(hi / lo) * per_octave))
    return sorted({max(1, round(lo * (hi / lo) ** (i / k))) for i in range(k + 1)})


KINDS = (("small", "Alg. 6 small-cache"), ("large:faithful", "Alg. 9 large-cache"),
         ("large:fa2", "Alg. 9, FA2 loop order"))

# ============================================================================== cache
CACHE_DOC = """Figure 1 of the paper with measured points: backward I/O vs fast-memory size M at fixed
n, d for the small-cache (Algorithm 6) and large-cache (Algorithm 9, as written and in the FA2 loop
order) algorithms -- the exact executor's closed forms and the Triton kernels' traffic model at n,
and the kernels' counted traffic at a small --count-n through the interpreter -- with both bound
terms of Theorem 1.1 and their crossover M = d^2 marked."""


def add_cache_args(p) -> None:
    p.add_argument("--seq-len", type=C.parse_count, default=2048, help="n (default 2048)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--m-min", type=C.parse_count, default=None, help="smallest M in words (default d^2/16)")
    p.add_argument("--m-max", type=C.parse_count, default=None, help="largest M in words (default 16 d^2)")
    p.add_argument("--per-octave", type=int, default=2, help="M points per doubling (default 2)")
    p.add_argument("--count-n", type=C.parse_count, default=128,
                   help="n of the counted kernel runs (interpreter; 0 = none; default 128)")
    p.add_argument("--count-m-min", type=C.parse_count, default=4096,
                   help="counted runs only at M >= this (default 4096: 32 x 32 tiles; 16 x 16 tiles take "
                        "minutes in the interpreter), at the powers of 4 in the range")


def run_cache(args):
    n, d = args.seq_len, args.head_dim
    dtype, es = torch.float32, 4  # kernel bytes / 4 = words: the dense kernels' intermediates are fp32
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
    Ms = _m_grid(m_min, m_max, args.per_octave)
    if d * d not in Ms and m_min <= d * d <= m_max:
        Ms = sorted(Ms + [d * d])
    header = C.machine_header(dtype)
    header.update({"n": n, "d": d, "count_n": args.count_n, "units": "words (elements); kernel fp32 bytes / 4; dX path only"})
    notes, unavailable = [], set()
    rows = []

    def attempt(fn, *a):
        try:
            return fn(*a)
        except C.Unavailable as e:
            unavailable.add(str(e))
            return None

    count_Ms = [M for M in Ms if args.count_n and M >= args.count_m_min and M & (M - 1) == 0
                and (M.bit_length() - 1) % 2 == 0]
    total = len(Ms) * (2 if args.count_n else 1) + len(count_Ms)
    with C.progress(total, "sweep cache", enabled=not args.no_progress) as bar:
        for M in Ms:
            b = _bound(n, d, M)
            row = {"M": M, "M_over_d2": M / (d * d), "bound_large_cache": b.terms["large_cache"],
                   "bound_small_cache": b.terms["small_cache"], "bound": b.value_words,
                   "compulsory": b.compulsory_words}
            for kind, _ in KINDS:
                key = kind.replace("large:", "large_")
                row[f"executor_{key}"] = attempt(executor_io, kind, n, d, M)
                kb = attempt(kernel_predicted, kind, n, d, M)
                row[f"kernel_{key}_predicted"] = None if kb is None else kb / es
            rows.append(row)
            bar.update(note=f"M={M}")
        for row in rows:
            M = row["M"]
            if args.count_n:
                for kind, _ in KINDS:
                    res = attempt(executor_run, kind, args.count_n, d, M)
                    key = kind.replace("large:", "large_")
                    row[f"executor_{key}_run_at_count_n"] = None if res is None else res[0]
                    row[f"executor_{key}_closed_form_at_count_n"] = None if res is None else res[1]
                bar.update(note=f"executor M={M}")
            if M not in count_Ms:
                continue
            for kind, _ in KINDS:
                key = kind.replace("large:", "large_")
                kp = attempt(kernel_predicted, kind, args.count_n, d, M)
                kc = None if kp is None else attempt(kernel_counted, kind, args.count_n, d, M)
                row[f"kernel_{key}_counted_at_count_n"] = None if kc is None else kc / es
                row[f"kernel_{key}_predicted_at_count_n"] = None if kp is None else kp / es
            bar.update(note=f"counted M={M}")
    for u in sorted(unavailable):
        notes.append(f"unavailable: {u}")
    notes += _cache_findings(rows, d, n)
    columns = [("M", "M words"), ("M_over_d2", "M/d^2"), ("bound", "bound (unit c.)"),
               ("executor_small", "exec Alg6"), ("executor_large_faithful", "exec Alg9"),
               ("executor_large_fa2", "exec Alg9-FA2"), ("kernel_small_predicted", "kernel small (pred)"),
               ("kernel_large_faithful_predicted", "kernel large (pred)"),
               ("kernel_large_fa2_predicted", "kernel FA2 (pred)")]
    if count_Ms:
        columns += [("kernel_small_counted_at_count_n", f"small counted n={args.count_n}"),
                    ("kernel_small_predicted_at_count_n", f"small pred n={args.count_n}")]
    return "cache", header, rows, columns, notes, lambda path: plot_cache(rows, header, path)


def _slope(rows, key, lo, hi):
    pts = [(math.log(r["M"]), math.log(r[key])) for r in rows
           if r.get(key) and lo <= r["M_over_d2"] <= hi]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def _crossover(rows, a, b):
    """Smallest M at which series ``b`` moves no more than series ``a`` (both present)."""
    for r in rows:
        if r.get(a) is not None and r.get(b) is not None and r[b] <= r[a]:
            return r["M"]
    return None


def _cache_findings(rows, d, n) -> list[str]:
    out = []
    try:
        fixed = _pebble().small_cache_m_independent(n, d)
        for r in rows:
            if r.get("executor_small"):
                r["executor_small_m_dependent"] = r["executor_small"] - fixed
        s = _slope(rows, "executor_small_m_dependent", 0, 1 - 1e-9)
        if s is not None:
            out.append(f"executor Alg. 6 less its M-independent 9n^2+3nd+d^2 words: slope {s:+.2f} for M < d^2 "
                       f"(bound: -0.5)")
    except (C.Unavailable, AttributeError):
        pass
    for src in ("executor", "kernel"):
        suffix = "" if src == "executor" else "_predicted"
        a, bf, b2 = f"{src}_small{suffix}", f"{src}_large_faithful{suffix}", f"{src}_large_fa2{suffix}"
        s_small = _slope(rows, a, 0, 1 - 1e-9)
        s_large = _slope(rows, bf, 1, 4)
        s_fa2 = _slope(rows, b2, 1, 16)
        cross = _crossover(rows, a, bf)
        bits = []
        if s_small is not None:
            bits.append(f"small-cache slope {s_small:+.2f} for M < d^2")
        if s_large is not None:
            bits.append(f"large-cache slope {s_large:+.2f} for d^2 <= M <= 4d^2")
        if s_fa2 is not None:
            bits.append(f"FA2-order slope {s_fa2:+.2f} for d^2 <= M <= 16d^2")
        if cross is not None:
            bits.append(f"large-cache moves no more than small-cache from M = {cross:,} ({cross / d / d:.3g} d^2)")
        if bits:
            out.append(f"{src}: " + "; ".join(bits) + " (log-log slopes include the M-independent parts)")
    runs = [(r[f"executor_{k}_run_at_count_n"], r[f"executor_{k}_closed_form_at_count_n"]) for r in rows
            for k in ("small", "large_faithful", "large_fa2") if r.get(f"executor_{k}_run_at_count_n") is not None]
    if runs:
        out.append(f"executor run (two-level memory, float64) == closed form exactly at {sum(a == b for a, b in runs)} "
                   f"of {len(runs)} (algorithm, M) points at --count-n")
    pairs = [(r[f"kernel_{k}_counted_at_count_n"], r[f"kernel_{k}_predicted_at_count_n"]) for r in rows
             for k in ("small", "large_faithful", "large_fa2") if r.get(f"kernel_{k}_counted_at_count_n") is not None]
    if pairs:
        same = sum(c == p for c, p in pairs)
        out.append(f"kernels counted (COUNT_IO, Triton interpreter) == traffic model exactly at {same} of "
                   f"{len(pairs)} (kernel, M) points at --count-n")
    return out


def plot_cache(rows, header, path) -> None:
    plt = C.pyplot()
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
    ax.axvline(d * d, color="k", lw=0.8)
    ax.text(d * d, 0.98, " M = d² (bound crossover)", fontsize=8, va="top", transform=ax.get_xaxis_transform())
    cross = _crossover(rows, "kernel_small_predicted", "kernel_large_faithful_predicted") or \
        _crossover(rows, "executor_small", "executor_large_faithful")
    if cross:
        ax.axvline(cross, color="tab:purple", lw=0.8, ls="--")
        ax.text(cross, 0.93, f" kernels cross (model)\n M={cross:,}", fontsize=8, color="tab:purple",
                va="top", transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fast memory M (words)")
    ax.set_ylabel("backward I/O (words)")
    ax.set_title(f"Figure 1 reproduction: n={n}, d={d}", fontsize=10)
    ax.legend(fontsize=7, loc="lower left", ncol=2, framealpha=0.9)
    ax.grid(True, which="both", alpha=0.25)
    if has_counted:
        ax2 = axes[0][1]
        for key, c in colors.items():
            _line(ax2, M, rows, f"kernel_{key}_predicted_at_count_n", c, "-", None, f"kernel model: {labels[key]}")
            _line(ax2, M, rows, f"kernel_{key}_counted_at_count_n", c, "none", "x", f"kernel counted: {labels[key]}")
            _line(ax2, M, rows, f"executor_{key}_run_at_count_n", c, ":", "+", f"executor run: {labels[key]}")
        ax2.axvline(d * d, color="k", lw=0.8)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("fast memory M (words)")
        ax2.set_ylabel("backward traffic (words)")
        ax2.set_title(f"n={cn}, d={d}: kernels counted (interpreter) vs model; executor run", fontsize=10)
        ax2.legend(fontsize=7, loc="upper right", framealpha=0.9)
        ax2.grid(True, which="both", alpha=0.25)
    C.save_figure(fig, path, header)


def _line(ax, M, rows, key, color, ls, marker, label):
    pts = [(m, r[key]) for m, r in zip(M, rows) if r.get(key)]
    if pts:
        ax.plot(*zip(*pts), color=color, ls=ls, marker=marker, ms=4, lw=1.3, label=label,
                mfc="none" if marker == "o" else color)


# ============================================================================== dim
DIM_DOC = """Threshold sweep over d (default 64, 128, 256) at a device's fast memory M: for each d,
the regime M vs d^2, the bound, and the small-cache and large-cache kernels' traffic (model; the
executor's closed forms when the dense kernels are absent) at the device's M and over M/d^2 from
1/8 to 8, showing where the small-cache algorithm stops paying. On a CPU no timings are taken."""


def add_dim_args(p) -> None:
    p.add_argument("--dims", default="64,128,256", help="comma list of d (default 64,128,256)")
    p.add_argument("--seq-len", type=C.parse_count, default=8192, help="n (default 8192)")
    p.add_argument("--device", default="h100", help="device table entry giving M (default h100)")
    p.add_argument("--cache", default=None, help="M in words or bytes (overrides --device)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")


def run_dim(args):
    dtype = C.parse_dtype(args.dtype)
    dims = C.parse_list(args.dims, item=int, what="--dims") if all(
        s.strip().isdigit() for s in args.dims.split(",") if s.strip()) else None
    if not dims or any(x < 16 or x > 256 for x in dims):
        raise ValueError(f"--dims must be integers in 16..256, got {args.dims!r}")
    from sparse_io_attn.cli.bounds import default_cache_words
    M_dev = default_cache_words(args.cache, dtype, None if args.cache else args.device)
    es = torch.empty((), dtype=dtype).element_size()
    n = args.seq_len
    header = C.machine_header(dtype)
    header.update({"n": n, "device_M_words": M_dev, "M_from": args.cache or args.device})
    rows, unavailable = [], set()

    def attempt(fn, *a):
        try:
            return fn(*a)
        except C.Unavailable as e:
            unavailable.add(str(e))
            return None

    grid = [2 ** (i / 2) for i in range(-6, 7)]  # M/d^2 from 1/8 to 8
    with C.progress(len(dims) * (len(grid) + 1), "sweep dim", enabled=not args.no_progress) as bar:
        for d in dims:
            Ms = [(round(f * d * d), False) for f in grid] + [(M_dev, True)]
            for M, at_dev in Ms:
                b = _bound(n, d, M)
                row = {"d": d, "M": M, "M_over_d2": M / (d * d), "at_device_M": at_dev, "regime": b.regime,
                       "bound": b.value_words, "compulsory": b.compulsory_words}
                for kind, _ in KINDS:
                    key = kind.replace("large:", "large_")
                    kb = attempt(kernel_predicted, kind, n, d, M)
                    row[f"kernel_{key}"] = None if kb is None else kb / 4
                    row[f"executor_{key}"] = attempt(executor_io, kind, n, d, M)
                _compare_small_large(row)
                rows.append(row)
                bar.update()
    notes = [f"unavailable: {u}" for u in sorted(unavailable)]
    for d in dims:
        dev = next(r for r in rows if r["d"] == d and r["at_device_M"])
        parts = []
        for src in ("kernel", "executor"):
            pts = []
            for r in rows:
                if r["d"] != d or r["at_device_M"]:
                    continue
                small = r.get(f"{src}_small")
                large = [r[f"{src}_large_{v}"] for v in ("faithful", "fa2") if r.get(f"{src}_large_{v}")]
                if small and large:
                    pts.append((r["M_over_d2"], small < min(large)))
            if not pts:
                continue
            wins = [x for x, w in pts if w]
            span = f"M/d^2 in [{min(x for x, _ in pts):.3g}, {max(x for x, _ in pts):.3g}]"
            parts.append(f"{src}: small-cache moves less at M/d^2 {', '.join(f'{x:.3g}' for x in wins)} of {span}"
                         if wins else f"{src}: small-cache never moves less over {span}")
        notes.append(f"d={d}: device M/d^2 = {dev['M_over_d2']:.3g} ({dev['regime']} cache); cheaper there: "
                     f"{dev['cheaper']} ({dev['source']}, small/large = {dev['small_over_large'] or float('nan'):.3g}); "
                     + "; ".join(parts))
    columns = [("d", "d"), ("M", "M words"), ("M_over_d2", "M/d^2"), ("regime", "regime"), ("bound", "bound"),
               ("kernel_small", "small (pred)"), ("kernel_large_faithful", "large (pred)"),
               ("kernel_large_fa2", "FA2 order (pred)"), ("small_over_large", "small/large"),
               ("large_variant", "vs"), ("cheaper", "cheaper"), ("source", "source")]
    table_rows = [r for r in rows if r["at_device_M"]]
    return "dim", header, rows, columns, notes, lambda path: plot_dim(rows, header, path), table_rows


def _compare_small_large(row: dict) -> None:
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


def plot_dim(rows, header, path) -> None:
    plt = C.pyplot()
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
    C.save_figure(fig, path, header)


# ============================================================================== sparsity
SPARSITY_DOC = """Theorem 4.5 stress test: sweeps the block density of A1/A2, of X and of the QK pattern
independently (the other operands full) and tabulates the sparse-operand kernels' traffic (forward and
backward, matrix elements; the exact traffic model, or --count to run the kernels through Triton's
interpreter at small n), Z_A, Z_X, Z_AX, Z_AXA, the Theorem 4.5 bound with unit constants at M = the
kernels' per-program fast memory, and measured/bound (sparse_io_attn.sparse_operands.stress.sparsity_sweep)."""


def add_sparsity_args(p) -> None:
    p.add_argument("--seq-len", type=C.parse_count, default=4096, help="n (default 4096)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0", help="block densities (default 0.05,...,1.0)")
    p.add_argument("--axes", default="A,X,QK", help="operands to sweep: A (A1 and A2), X, QK (default all)")
    p.add_argument("--block-n", type=int, default=64, help="block rows of A1/A2 and the QK pattern (default 64)")
    p.add_argument("--block-d", type=int, default=16, help="block columns of A1/A2, blocks of X (default 16)")
    p.add_argument("--count", action="store_true", help="count with the kernels (interpreter; n <= 512)")


def run_sparsity(args):
    stress = C.optional_module("sparse_io_attn.sparse_operands.stress", "sweep sparsity")
    densities = [_density(x) for x in C.parse_list(args.densities, what="--densities")]
    axes = C.parse_list(args.axes, allowed=stress.AXES, what="--axes")
    if args.count and args.seq_len > 512:
        raise ValueError(f"--count runs the kernels through the Triton interpreter; use --seq-len <= 512, "
                         f"got {args.seq_len}")
    if args.count:
        import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter set-up before triton is imported)
    header = C.machine_header(torch.float32)
    header.update({"n": args.seq_len, "d": args.head_dim, "block_n": args.block_n, "block_d": args.block_d,
                   "M": "kernel per-program fast memory (paper.traffic.kernel_fast_memory_words)"})
    with C.progress(len(axes) * len(densities), "sweep sparsity", enabled=not args.no_progress) as bar:
        rows = stress.sparsity_sweep(args.seq_len, args.head_dim, densities=densities, axes=tuple(axes),
                                     block_n=args.block_n, block_d=args.block_d, count=args.count,
                                     progress=lambda r: bar.update(note=f"{r['axis']} {r['density']}"))
    notes = []
    for axis in axes:
        pts = [r for r in rows if r["axis"] == axis]
        lo, hi = min(pts, key=lambda r: r["density"]), max(pts, key=lambda r: r["density"])
        notes.append(f"{axis}: backward traffic / bound {lo['bwd_ratio']:.3g} at density {lo['density']:g} -> "
                     f"{hi['bwd_ratio']:.3g} at {hi['density']:g}; forward {lo['fwd_ratio']:.3g} -> {hi['fwd_ratio']:.3g}"
                     f" (binding term {lo['binding']} -> {hi['binding']})")
    notes.append(f"traffic source: {rows[0]['source'] if rows else '-'}; words = matrix elements moved, index bytes "
                 f"excluded; bound = Theorem 4.5 with unit constants")
    columns = [(k, k) for k in ("axis", "density", "Z_A", "Z_X", "Z_AX", "Z_AXA", "M_words", "bound_words",
                                "binding", "fwd_words", "bwd_words", "fwd_ratio", "bwd_ratio", "total_ratio_floor")]
    return "sparsity", header, rows, columns, notes, lambda path: plot_sparsity(rows, header, path)


def _density(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"--densities must be numbers in (0, 1], got {text!r}") from None
    if not 0 < x <= 1:
        raise ValueError(f"--densities must be in (0, 1], got {x}")
    return x


def plot_sparsity(rows, header, path) -> None:
    plt = C.pyplot()
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
    C.save_figure(fig, path, header)
