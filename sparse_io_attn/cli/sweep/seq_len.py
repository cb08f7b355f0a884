"""``sparse-io-attn sweep seq-len``: the long-sequence stress test of the torch path, one point per
fresh subprocess (:func:`seq_point`), with its flags, table columns and plot."""
from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time

import torch

from sparse_io_attn.block_sparse.api import block_sparse_attention
from sparse_io_attn.cli import _common as common

DOC = """Long-sequence stress test: peak memory and forward+backward time of the torch path
from n = 1k up to --max-seq-len (doubling) for block-sparse patterns, each point in a fresh
subprocess (peak resident memory = its high-water mark), next to the bytes a dense n x n fp32
score matrix and the small-cache kernel's f, q, p materialization would need; the small-cache
kernel is reported as refused where that exceeds --device-memory. Points stop early (and say so)
once --time-budget seconds would be exceeded."""

DEFAULT_PATTERNS = ("longformer:w=256,g=64", "bigbird")
COLUMNS = [("pattern", "pattern"), ("n", "n"), ("density", "density"), ("status", "status"),
               ("fwd_bwd_s", "fwd+bwd s"), ("fwd_s", "fwd s"), ("peak_rss_mib", "peak RSS MiB"),
               ("rss_over_baseline_mib", "over base MiB"), ("dense_scores_gib", "n x n fp32 GiB"),
               ("small_cache_need_gib", "small-cache f,q,p GiB"), ("small_cache", "small-cache kernel")]


def add_args(p) -> None:
    p.add_argument("--pattern", dest="patterns", action="append", default=None, metavar="SPEC",
                   help="pattern spec, repeatable (default: longformer:w=256,g=64 and bigbird)")
    p.add_argument("--min-seq-len", type=common.parse_count, default=1024, help="first n (default 1k)")
    p.add_argument("--max-seq-len", type=common.parse_count, default=131072, help="last n (default 131072)")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--block", type=common.parse_count, default=64, help="block size (default 64)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--repeats", type=int, default=2, help="timed fwd+bwd runs per point (median; default 2)")
    p.add_argument("--time-budget", type=float, default=900.0, help="stop the sweep before exceeding this (s)")
    p.add_argument("--device-memory", default="80GiB",
                   help="memory the small-cache kernel's fp32 n x n buffers must fit in (default 80GiB, an H100's HBM)")


def seq_point(spec: str, n: int, heads: int, head_dim: int, block: int, dtype: str, repeats: int) -> dict:
    """Run in a fresh subprocess: time fwd and fwd+bwd of the torch path, report peak RSS."""
    layout = common.build_layout(spec, n, block)
    dt = common.parse_dtype(dtype)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    q, k, v, do = (torch.randn(1, heads, n, head_dim, dtype=dt) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, layout, backend="torch")

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        block_sparse_attention(q, k, v, layout, backend="torch").backward(do)

    t_fb = common.time_fn(fwd_bwd, warmup=0 if n >= 32768 else 1, repeats=repeats, max_seconds=120)
    t_f = common.time_fn(fwd, warmup=0, repeats=repeats, max_seconds=60)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"name": layout.name, "density": layout.density, "fwd_bwd_s": t_fb["median_s"], "fwd_s": t_f["median_s"],
            "peak_rss_bytes": peak, "baseline_rss_bytes": base}


def run(args, sweeps):
    dtype = common.parse_dtype(args.dtype)
    specs = args.patterns or list(DEFAULT_PATTERNS)
    if args.min_seq_len > args.max_seq_len:
        raise ValueError(f"--min-seq-len {args.min_seq_len} is larger than --max-seq-len {args.max_seq_len}")
    for name in ("heads", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    device_memory = _parse_bytes(args.device_memory)
    common.build_layout(specs[0], args.min_seq_len, args.block)  # fail fast on a bad spec, in this process
    ns = []
    n = args.min_seq_len
    while n <= args.max_seq_len:
        ns.append(n)
        n *= 2
    header = common.machine_header(dtype)
    header.update({"backend": "torch", "batch": 1, "heads": args.heads, "head_dim": args.head_dim,
                   "block": args.block, "device_memory_bytes": device_memory})
    rows, notes, start = [], [], time.perf_counter()
    # after the header, which records the environment as the command found it (importing the
    # dense kernels sets TRITON_INTERPRET=1 on a machine without CUDA)

    with common.progress(len(ns) * len(specs), "sweep seq-len", enabled=not args.no_progress) as bar:
        for spec in specs:
            last = None
            for n in ns:
                need = sweeps.small_cache_need(n, args.head_dim, args.heads)
                row = {"pattern": spec, "n": n,
                       "dense_scores_gib": args.heads * n * n * 4 / 2 ** 30,
                       "small_cache_need_gib": need / 2 ** 30,
                       "small_cache": "fits" if need <= device_memory else
                       f"refused: needs {need:,} B > {device_memory:,} B"}
                elapsed = time.perf_counter() - start
                if last is not None and elapsed + 2.5 * last > args.time_budget:
                    row["status"] = "not run (time budget)"
                    rows.append(row)
                    bar.update()
                    continue
                t0 = time.perf_counter()
                res = _run_point(spec, n, args, dtype)
                last = time.perf_counter() - t0
                if "error" in res:
                    row.update(status=f"failed: {res['error']}")
                else:
                    row.update(pattern=res["name"], density=res["density"], status="ok",
                               fwd_bwd_s=res["fwd_bwd_s"], fwd_s=res["fwd_s"],
                               peak_rss_mib=res["peak_rss_bytes"] / 2 ** 20,
                               rss_over_baseline_mib=(res["peak_rss_bytes"] - res["baseline_rss_bytes"]) / 2 ** 20)
                rows.append(row)
                bar.update(note=f"{spec} n={n} {row['status']}")
    skipped = [r for r in rows if r["status"].startswith("not run")]
    if skipped:
        notes.append(f"stopped early: {len(skipped)} point(s) (from n={min(r['n'] for r in skipped):,}) not run "
                     f"because the next point would pass --time-budget {args.time_budget:.0f} s on this machine")
    refused = [r["n"] for r in rows if r["small_cache"].startswith("refused")]
    if refused:
        notes.append(f"small-cache kernel (Algorithm 6) refused from n = {min(refused):,}: its fp32 f, q, p (n x n) and T "
                     f"buffers for {args.heads} heads exceed --device-memory {common.human_bytes(device_memory)}")
    notes.append("peak RSS is the subprocess high-water mark (includes the Python/torch runtime); 'over base' "
                 "subtracts the mark taken after import, before the inputs are allocated")
    header["elapsed_s"] = round(time.perf_counter() - start, 1)
    return "seq_len", header, rows, COLUMNS, notes, lambda path: plot(rows, header, path)


def plot(rows, header, path) -> None:
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    specs = list(dict.fromkeys(r["pattern"] for r in rows))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    for i, spec in enumerate(specs):
        ok = [r for r in rows if r["pattern"] == spec and r["status"] == "ok"]
        if not ok:
            continue
        c = palette[i % 4]
        ns = [r["n"] for r in ok]
        ax1.plot(ns, [r["fwd_bwd_s"] for r in ok], marker="o", color=c, label=f"{spec}: fwd+bwd")
        ax1.plot(ns, [r["fwd_s"] for r in ok], marker="s", ls="--", color=c, label=f"{spec}: fwd")
        ax2.plot(ns, [r["peak_rss_mib"] * 2 ** 20 for r in ok], marker="o", color=c, label=f"{spec}: peak RSS (torch path)")
    ns_all = sorted({r["n"] for r in rows})
    first = [next(r for r in rows if r["n"] == n) for n in ns_all]
    ax2.plot(ns_all, [r["dense_scores_gib"] * 2 ** 30 for r in first], color="0.4", ls=":",
             label=f"one n x n fp32 score matrix x {header['heads']} heads")
    ax2.plot(ns_all, [r["small_cache_need_gib"] * 2 ** 30 for r in first], color="tab:red", ls="-.",
             label="small-cache kernel: f, q, p (n x n each)")
    ax2.axhline(header["device_memory_bytes"], color="tab:red", lw=0.8)
    ax2.text(ns_all[0], header["device_memory_bytes"], f" device memory {common.human_bytes(header['device_memory_bytes'])}",
             color="tab:red", fontsize=8, va="bottom")
    refused = [r["n"] for r in first if r["small_cache"].startswith("refused")]
    if refused:
        ax2.axvline(min(refused), color="tab:red", ls="--", lw=0.8)
        ax2.text(min(refused), 0.02, f" small-cache refused\n from n={min(refused):,}", color="tab:red",
                 fontsize=8, transform=ax2.get_xaxis_transform(), va="bottom")
    for ax, ylabel, title in ((ax1, "seconds (median)", "time, torch path (CPU)"),
                              (ax2, "bytes", "memory")):
        common.log_axes(ax, "sequence length n", ylabel,
                        f"{title}: B=1, H={header['heads']}, d={header['head_dim']}, block {header['block']}", xbase=2)
    common.save_figure(fig, path, header)


def _run_point(spec, n, args, dtype) -> dict:
    code = ("import json,sys; from sparse_io_attn.cli.sweep.seq_len import seq_point; "
            f"print(json.dumps(seq_point({spec!r}, {n}, {args.heads}, {args.head_dim}, {args.block}, "
            f"{args.dtype!r}, {args.repeats})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]
        return {"error": last[:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", str(text), flags=re.I)
    if not m:
        raise ValueError(f"expected a byte size such as 80GiB or 24GB, got {text!r}")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}[unit])
