"""CPU scaling of backend="cpu" (the fused C++ kernel) with sequence length, 16k to 1M tokens.

Setting: sliding window ``|q - k| <= 512`` (``patterns.sliding_window(N, 64, 512)``), blocks 64,
B = 1, H = 1, head dim 64, float32, all torch threads of the machine. For each N one fresh
subprocess builds the layout and the inputs, loads the C++ kernel on a 128-token problem, then:

* ``fwd``: ``block_sparse_attention(q, k, v, layout, backend="cpu")`` under ``torch.no_grad()``;
* ``fwd+bwd``: the same with ``q, k, v`` requiring grad, then ``out.backward(do)``.

Each is run once untimed-for-memory first (its peak-RSS delta: ``ru_maxrss`` after the call minus
``ru_maxrss`` before it, i.e. what the call adds on top of inputs, layout and the loaded kernel;
``fwd`` runs first, so ``fwd+bwd``'s delta is what it needs beyond the forward's peak and is 0
when it fits under it) and then timed ``--repeats`` times (median; with ``--single-from``, sizes
of at least that many tokens are timed once: the memory run is then the timed run). Time per token (ns) is
the median divided by N: flat when the cost grows linearly.

    python benchmarks/cpu_scaling.py                   # writes benchmarks/results/cpu_scaling.{md,csv}
    python benchmarks/cpu_scaling.py --sizes 16384 32768 --repeats 2 --out /tmp/scaling
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SIZES = (16384, 32768, 65536, 131072, 262144, 524288, 1048576)
WINDOW, BLOCK, HEAD_DIM = 512, 64, 64


def _child(cfg: dict) -> dict:
    import resource

    import torch

    from sparse_io_attn import block_sparse_attention, patterns

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    n = cfg["n"]
    small = patterns.sliding_window(128, BLOCK, WINDOW)
    x = torch.randn(1, 1, 128, HEAD_DIM)
    block_sparse_attention(x, x, x, small, backend="cpu")  # load (or build) the kernel outside the timings
    layout = patterns.sliding_window(n, BLOCK, WINDOW)
    layout.ccol_indices  # the transposed index backward walks, built once outside the timings
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, n, HEAD_DIM, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, layout, backend="cpu")

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        block_sparse_attention(*leaves, layout, backend="cpu").backward(do)

    res = {"n": n, "nnz_blocks": layout.nnz_blocks, "threads": torch.get_num_threads()}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        before = peak()
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        res[f"{name}_peak_delta"] = peak() - before
        times = [first] if cfg["repeats"] == 1 else []
        for _ in range(cfg["repeats"] if cfg["repeats"] > 1 else 0):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        res[f"{name}_s"] = statistics.median(times)
        res[f"{name}_runs"] = len(times)
    res["rss_peak"] = peak()
    return res


def _load() -> str:
    """The load averages as ``uptime`` prints them."""
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    return out.split("load average:")[-1].strip() if "load average:" in out else \
        ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _header(load_before: str, load_after: str) -> list[str]:
    import torch

    return [f"machine: 2-core development VM (shared), nproc {os.cpu_count()}, {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}",
            f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average (uptime: 1, 5, "
            f"15 min) before {load_before}, after {load_after}",
            f"backend \"cpu\", float32, B=1, H=1, head dim {HEAD_DIM}, sliding_window(window={WINDOW}), "
            f"block {BLOCK}, {torch.get_num_threads()} torch threads"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per size (median)")
    p.add_argument("--single-from", type=int, default=0,
                   help="sizes of at least this many tokens are timed once (0: every size gets --repeats)")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_scaling", help="output path without suffix")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    load_before = _load()
    rows = []
    for n in args.sizes:
        cfg = {"n": n, "repeats": 1 if args.single_from and n >= args.single_from else args.repeats}
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"N={n}: fwd {r['fwd_s']:.3f} s, fwd+bwd {r['fwd_bwd_s']:.3f} s", flush=True)
    header = _header(load_before, _load())
    command = "python benchmarks/cpu_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    _write(args.out, header, rows, command.strip())
    return 0


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


def _write(out: Path, header: list[str], rows: list[dict], command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["n", "nnz_blocks", "fwd_s", "fwd_runs", "fwd_ns_per_token", "fwd_peak_delta_bytes",
              "fwd_bwd_s", "fwd_bwd_runs", "fwd_bwd_ns_per_token", "fwd_bwd_peak_delta_bytes", "rss_peak_bytes"]
    table = []
    for r in rows:
        table.append({"n": r["n"], "nnz_blocks": r["nnz_blocks"], "fwd_s": round(r["fwd_s"], 4),
                      "fwd_runs": r["fwd_runs"], "fwd_ns_per_token": round(r["fwd_s"] / r["n"] * 1e9, 1),
                      "fwd_peak_delta_bytes": r["fwd_peak_delta"], "fwd_bwd_s": round(r["fwd_bwd_s"], 4),
                      "fwd_bwd_runs": r["fwd_bwd_runs"],
                      "fwd_bwd_ns_per_token": round(r["fwd_bwd_s"] / r["n"] * 1e9, 1),
                      "fwd_bwd_peak_delta_bytes": r["fwd_bwd_peak_delta"], "rss_peak_bytes": r["rss_peak"]})
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(table)
    lines = ["# CPU scaling of backend \"cpu\" (sliding window, 16k to 1M tokens)", "",
             f"Command: `{command}`", "", *[f"    {h}" for h in header], "",
             "| N | kept blocks | fwd s | fwd ns/token | fwd peak +MiB | fwd+bwd s | fwd+bwd ns/token | "
             "fwd+bwd peak +MiB | runs (fwd, fwd+bwd) | process peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['n']:,} | {t['nnz_blocks']:,} | {t['fwd_s']:.3f} | {t['fwd_ns_per_token']:.0f} | "
                     f"{_mib(t['fwd_peak_delta_bytes'])} | {t['fwd_bwd_s']:.3f} | {t['fwd_bwd_ns_per_token']:.0f} | "
                     f"{_mib(t['fwd_bwd_peak_delta_bytes'])} | {t['fwd_runs']}, {t['fwd_bwd_runs']} | "
                     f"{_mib(t['rss_peak_bytes'])} |")
    lines += ["", "Times: median wall time of the timed runs (one run where *runs* is 1: the first, "
              "memory-measuring call is then the timed one). Memory: peak-RSS delta (`ru_maxrss` after the "
              "call minus before it, in a fresh process per N), not the torch profiler; the fwd+bwd delta "
              "is what it needs beyond the forward's peak. *process peak RSS*: the whole process "
              "(Python, torch, kernel, inputs, gradients). Shared 2-core machine: times are indicative."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
