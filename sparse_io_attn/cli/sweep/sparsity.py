"""``sparse-io-attn sweep sparsity``: flags, table columns and plot of the Theorem 4.5 stress test
(:func:`sparse_io_attn.experiments.sweeps.sparsity_sweep`)."""
from __future__ import annotations

import torch

from sparse_io_attn.cli import _common as common
from sparse_io_attn.experiments import sparsity_stress

DOC = """Theorem 4.5 stress test: sweeps the block density of A1/A2, of X and of the QK pattern
independently (the other operands full) and tabulates the sparse-operand kernels' traffic (forward and
backward, matrix elements; the exact traffic model, or --count to run the kernels through Triton's
interpreter at small n), Z_A, Z_X, Z_AX, Z_AXA, the Theorem 4.5 bound with unit constants at M = the
kernels' per-program fast memory, and measured/bound (sparse_io_attn.experiments.sparsity_stress.sparsity_sweep)."""


def add_args(p) -> None:
    p.add_argument("--seq-len", type=common.parse_count, default=4096, help="n (default 4096)")
    p.add_argument("--head-dim", type=int, default=128, help="d (default 128)")
    p.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0", help="block densities (default 0.05,...,1.0)")
    p.add_argument("--axes", default="A,X,QK", help="operands to sweep: A (A1 and A2), X, QK (default all)")
    p.add_argument("--block-n", type=int, default=64, help="block rows of A1/A2 and the QK pattern (default 64)")
    p.add_argument("--block-d", type=int, default=16, help="block columns of A1/A2, blocks of X (default 16)")
    p.add_argument("--count", action="store_true", help="count with the kernels (interpreter; n <= 512)")


def run(args, sweeps):
    densities = [_density(x) for x in common.parse_list(args.densities, what="--densities")]
    axes = common.parse_list(args.axes, allowed=sparsity_stress.AXES, what="--axes")
    if args.count and args.seq_len > 512:
        raise ValueError(f"--count runs the kernels through the Triton interpreter; use --seq-len <= 512, "
                         f"got {args.seq_len}")
    if args.count:
        import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter set-up before triton is imported)
    header = common.machine_header(torch.float32)
    header.update({"n": args.seq_len, "d": args.head_dim, "block_n": args.block_n, "block_d": args.block_d,
                   "M": "kernel per-program fast memory (sparse_operands.traffic.kernel_fast_memory_words)"})
    # after the header, which records the environment as the command found it

    with common.progress(len(axes) * len(densities), "sweep sparsity", enabled=not args.no_progress) as bar:
        rows, notes = sweeps.sparsity_sweep(args.seq_len, args.head_dim, densities=densities, axes=tuple(axes),
                                            block_n=args.block_n, block_d=args.block_d, count=args.count,
                                            progress=lambda r: bar.update(note=f"{r['axis']} {r['density']}"))
    columns = [(k, k) for k in ("axis", "density", "Z_A", "Z_X", "Z_AX", "Z_AXA", "M_words", "bound_words",
                                "binding", "fwd_words", "bwd_words", "fwd_ratio", "bwd_ratio", "total_ratio_floor")]
    return "sparsity", header, rows, columns, notes, lambda path: plot(rows, header, path)


def _density(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"--densities must be numbers in (0, 1], got {text!r}") from None
    if not 0 < x <= 1:
        raise ValueError(f"--densities must be in (0, 1], got {x}")
    return x


def plot(rows, header, path) -> None:
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
    common.log_axes(ax, "block density of the swept operand (others full)",
                    "kernel traffic / Theorem 4.5 bound (unit constants)",
                    f"Theorem 4.5 stress test, n={header['n']}, d={header['d']}")
    common.save_figure(fig, path, header)
