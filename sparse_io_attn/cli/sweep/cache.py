"""``sparse-io-attn sweep cache``: flags, table columns and plot of the paper's Figure 1 sweep
(:func:`sparse_io_attn.experiments.sweeps.cache_sweep`)."""
from __future__ import annotations

import torch

from sparse_io_attn.cli import _common as common

DOC = """Figure 1 of the paper with measured points: backward I/O vs fast-memory size M at fixed
n, d for the small-cache (Algorithm 6) and large-cache (Algorithm 9, as written and in the FA2 loop
order) algorithms -- the exact executor's closed forms and the Triton kernels' traffic model at n,
and the kernels' counted traffic at a small --count-n through the interpreter -- with both bound
terms of Theorem 1.1 and their crossover M = d^2 marked; next to them the forward (Table 1): the
small-cache forward (Saha & Ye; executor and kernel) and the large-cache forward (kernel) with
Saha & Ye's bound. The crossings of the small- and large-cache backwards are computed by
bisection on the model (kernels with the tiles they can run, and the algorithms as written)."""


def add_args(p) -> None:
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


def run(args, sweeps):
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

    Ms, count_Ms, steps = sweeps.cache_plan(d, m_min, m_max, args.per_octave, args.count_n, args.count_m_min)
    with common.progress(steps, "sweep cache", enabled=not args.no_progress) as bar:
        rows, cross, notes = sweeps.cache_sweep(n, d, Ms, args.count_n, count_Ms,
                                                progress=lambda note: bar.update(note=note))
    header["crossing_kernel_fa2_M"] = cross["kernel_fa2"]["M"]
    header["crossing_executor_faithful_M"] = cross["executor_faithful"]["always_from_M"]
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
    return "cache", header, rows, columns, notes, lambda path: plot(rows, header, path)


def plot(rows, header, path) -> None:
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
    common.log_axes(ax, "fast memory M (words)", "I/O (words): backward; forward in orange/cyan",
                    f"Figure 1 reproduction: n={n}, d={d} (backward, and forward of Table 1)", xbase=2,
                    loc="lower left", ncol=2, framealpha=0.9)
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
        common.log_axes(ax2, "fast memory M (words)", "traffic (words): backward; forward in orange",
                        f"n={cn}, d={d}: kernels counted (interpreter) vs model; executor run", xbase=2,
                        loc="upper right", framealpha=0.9)
    common.save_figure(fig, path, header)


def _line(ax, M, rows, key, color, ls, marker, label):
    pts = [(m, r[key]) for m, r in zip(M, rows) if r.get(key)]
    if pts:
        ax.plot(*zip(*pts), color=color, ls=ls, marker=marker, ms=4, lw=1.3, label=label,
                mfc="none" if marker == "o" else color)
