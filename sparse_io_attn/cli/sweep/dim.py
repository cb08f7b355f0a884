"""``sparse-io-attn sweep dim``: flags, table columns and plot of the threshold sweep over d
(:func:`sparse_io_attn.experiments.sweeps.dim_sweep`)."""
from __future__ import annotations

from sparse_io_attn.cli import _common as common
from sparse_io_attn.cli.bounds import default_cache_words

DOC = """Threshold sweep over d (default 64, 128, 256) at a device's fast memory M: for each d,
the paper's regime M vs d^2, the bound, and the small-cache and large-cache kernels' traffic (model;
next to it the executor's closed forms, which also cover the M the kernels cannot tile) at the
device's M and over M/d^2 from 1/8 to 8, showing where the small-cache algorithm stops paying; the
kernel dense.backward(regime="auto") runs there (fewest predicted bytes among the kernels that fit);
and the crossings, by bisection on the model. On a CPU no timings are taken."""


def add_args(p) -> None:
    p.add_argument("--dims", default="64,128,256", help="comma list of d (default 64,128,256)")
    p.add_argument("--seq-len", type=common.parse_count, default=8192, help="n (default 8192)")
    p.add_argument("--device", default="h100", help="device table entry giving M (default h100)")
    p.add_argument("--cache", default=None, help="M in words or bytes (overrides --device)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")


def run(args, sweeps):
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

    header["units"] = "words; small/large columns: dX path (fp32 bytes / 4); auto: all five gradients"
    with common.progress(sweeps.dim_steps(dims), "sweep dim", enabled=not args.no_progress) as bar:
        rows, notes = sweeps.dim_sweep(n, dims, M_dev, progress=bar.update)
    columns = [("d", "d"), ("M", "M words"), ("M_over_d2", "M/d^2"), ("regime", "paper regime"), ("bound", "bound"),
               ("kernel_small", "small (pred)"), ("kernel_large_faithful", "large (pred)"),
               ("kernel_large_fa2", "FA2 order (pred)"), ("small_over_large", "small/large"),
               ("large_variant", "vs"), ("cheaper", "cheaper"), ("source", "source"),
               ("auto_label", "auto runs (all grads)"), ("auto_ratio", "x fewer B")]
    table_rows = [r for r in rows if r["at_device_M"]]
    return "dim", header, rows, columns, notes, lambda path: plot(rows, header, path), table_rows


def plot(rows, header, path) -> None:
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
    common.log_axes(ax, "M / d²", "small-cache I/O / best large-cache I/O  (<1: small wins)",
                    f"threshold sweep, n={header['n']}, dtype {header['dtype']}", xbase=2)
    common.save_figure(fig, path, header)
