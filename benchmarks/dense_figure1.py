"""Kernel-level Figure 1 of the paper, from the exact traffic model of the dense kernels.

Bytes moved by the dense backward kernels (``sparse_io_attn.dense``) over a sweep of the fast memory
``M`` (words) at fixed ``n, d``: the small-cache kernels (Algorithm 6), the large-cache kernels as
written (Algorithm 9, "faithful") and the FlashAttention-2-style variant ("fa2"; "fa2_model" extends
its schedule below the 16-row tiles tl.dot needs, model only), the slope of the small-cache forward,
and the small/large crossings by bisection on the model (``figure1.crossings``). The traffic model equals the kernels'
counted traffic exactly (tests/dense/test_dense_kernels.py checks it at interpreter sizes), so this table
needs no GPU and no kernel run.

    python benchmarks/dense_figure1.py                      # n=8192, d in {128, 256}, fp32
    python benchmarks/dense_figure1.py --n 4096 --d 256 --dtype bf16 --out /tmp/fig1
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ["M", "M_over_d2", "B", "small_g", "faithful_g", "fa2_g", "fa2_model_g", "small_all",
           "faithful_all", "fa2_all", "small_g_tiled_reads", "faithful_g_rereads", "fa2_g_rereads",
           "fa2_model_g_rereads", "bound_bytes"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="sequence length")
    p.add_argument("--d", type=int, nargs="+", default=[128, 256], help="head dims (>= 128)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--out", type=Path, default=RESULTS / "dense_figure1", help="output stem")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def header(dtype: str) -> list[str]:
    import triton
    return ["- source: exact traffic model `sparse_io_attn.dense.traffic` (no kernel run; equals the "
            "counted traffic of the Triton kernels, tested at interpreter sizes)",
            f"- host: {platform.node()} ({platform.machine()}, {platform.system()}), no GPU used",
            f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
            f"- dtype: {dtype} (inputs and dA*); intermediates, lse and d x d partials fp32",
            "- bytes for batch 1 (one head); M in words of the dtype"]


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x < 100:
        return f"{x:.3g}"
    return f"{x:.3e}" if x >= 1e6 else f"{x:,}"


def crossing_lines(c, d):
    from sparse_io_attn.experiments.figure1 import crossing_lines as lines
    return lines(c, d)


def summary_lines(s: dict) -> list[str]:
    d2 = s["d2"]
    ratio = lambda M: f"{M / d2:.3g} d^2" if M else "-"  # noqa: E731
    lines = [f"### n = {s['n']}, d = {s['d']} (d^2 = {d2:,} words)", "",
             f"- small-cache (Algorithm 6), g path, M = 4B^2 for B in "
             f"{[int((M // 4) ** 0.5) for M in s['small_Ms']]} (all < d^2): log-log slope of the tiled-product "
             f"reads (total less the M-independent writes and f/q sweeps) **{s['small_tiled_slope']:.3f}** "
             f"(expected -1/2); of the total {s['small_total_slope']:.3f}.",
             f"- large-cache faithful (Algorithm 9 as written), g path: runs from M = {ratio(s['faithful_min_M'])}; "
             f"falls with slope **{s.get('faithful_slope', float('nan')):.3f}** (re-reads "
             f"{s.get('faithful_reread_slope', float('nan')):.3f}) over M in "
             f"{[ratio(M) for M in s['faithful_falling_Ms']]}; "
             + (f"**plateau** from M = {ratio(s['faithful_plateau_from_M'])} at {s['faithful_plateau_bytes']:.3e} B "
                f"(row block capped at B_r = d)." if s['faithful_plateau_from_M'] else "no plateau up to M = nd."),
             f"- large-cache fa2 (FlashAttention-2 loop order, dQ then g = A1^T dQ), g path: slope "
             f"**{s.get('fa2_slope', float('nan')):.3f}** (re-reads {s.get('fa2_reread_slope', float('nan')):.3f}) "
             f"over M in {[ratio(M) for M in s['fa2_falling_Ms']]}"
             + (f"; plateau from {ratio(s['fa2_plateau_from_M'])}." if s['fa2_plateau_from_M'] else "; no plateau up to M = nd."),
             f"- small-cache forward (Saha & Ye), same M = 4B^2: log-log slope of the tiled-product reads "
             f"**{s['fwd_small_tiled_slope']:.3f}** (expected -1/2); of the total {s['fwd_small_total_slope']:.3f}.",
             "- crossings, by bisection over integer M on the exact model (not read off a grid):"]
    lines += [f"  - {line}" for line in crossing_lines(s["crossings"], s["d"])]
    lines.append("")
    return lines


def table_lines(rows) -> list[str]:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |")
    return out


def plot(summaries, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(summaries), figsize=(6 * len(summaries), 4.5), squeeze=False)
    for ax, s in zip(axes[0], summaries):
        rows = s["rows"]
        for key, label, style in (("small_g", "small cache (Alg. 6)", "o-"),
                                  ("faithful_g", "large cache, faithful (Alg. 9)", "s-"),
                                  ("fa2_g", "large cache, fa2 variant", "^-"),
                                  ("fa2_model_g", "fa2 schedule, model below 16-row tiles", "^:"),
                                  ("bound_bytes", "Theorem 1.1 (unit constants)", "k--")):
            pts = [(r["M"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label, markersize=3)
        ax.axvline(s["d2"], color="grey", lw=0.8)
        ax.text(s["d2"], ax.get_ylim()[0], " M = d²", color="grey", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("fast memory M (words)")
        ax.set_ylabel("bytes moved (g path)")
        ax.set_title(f"n = {s['n']}, d = {s['d']}, {s['dtype']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    from sparse_io_attn.experiments import figure1
    dtype = DTYPES[args.dtype]
    summaries = [figure1.summarize(args.n, d, dtype) for d in args.d]
    lines = ["# Kernel-level Figure 1: dense backward traffic vs fast memory M", ""] + header(args.dtype) + [""]
    for s in summaries:
        lines += summary_lines(s) + table_lines(s["rows"]) + [""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    with open(f"{args.out}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["n", "d"] + COLUMNS + ["bound_small_term_bytes", "bound_large_term_bytes",
                                                                   "fa2_model_all"], extrasaction="ignore")
        w.writeheader()
        for s in summaries:
            for r in s["rows"]:
                w.writerow({"n": s["n"], "d": s["d"], **r})
    Path(f"{args.out}.json").write_text(json.dumps(summaries, indent=1))
    if not args.no_plot:
        plot(summaries, Path(f"{args.out}.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
