"""What element-exact masks cost on the CPU: exact layouts (full + element-masked partial blocks)
against the block-level approximation of the same patterns (every kept block full), same kept
blocks, same backend.

Setting (issue "element-exact masks"): B=1, H=8, N=4096, D=64, block 64, fp32, backends "cpu"
(the C++ kernel) and "torch", patterns

* document packing with boundaries off the block edges, causal within documents;
* a causal sliding window of 300 tokens (not a multiple of the block).

Methods run interleaved (one call of each per round), medians over the warm rounds. Target: exact
costs at most 10% more time than block-level, forward and forward+backward.

    python benchmarks/bench_exact_masks.py             # writes benchmarks/results/exact_masks.{md,csv,json}
    python benchmarks/bench_exact_masks.py --repeats 3 --out /tmp/x
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_csv, write_json

from _cpu_timing import shape_arguments  # noqa: E402  (benchmarks/ on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(p, repeats=9)
    p.add_argument("--backends", default="cpu,torch", help="comma-separated backends (cpu, torch)")
    p.add_argument("--out", type=Path, default=RESULTS / "exact_masks", help="output stem (.md/.csv/.json)")
    return p.parse_args(argv)


def layouts(N: int, block: int) -> dict:
    cu = [0, 700, 1500, 2900, 3333, N] if N == 4096 else [0, N // 5 + 3, N // 2 + 7, N]
    return {"document-causal": patterns.document(cu, block, causal=True),
            "sliding-window-causal": patterns.sliding_window(N, block, 300, causal=True)}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    header = machine_header(torch.float32)
    load_before = header["load_avg_1min"]
    N, H, D = args.seq_len, args.heads, args.head_dim
    q, k, v = (torch.randn(1, H, N, D, requires_grad=True) for _ in range(3))
    rows = []
    for name, exact in layouts(N, args.block).items():
        block = BlockSparseLayout.from_block_mask(exact.to_block_mask(), exact.block_size, exact.seqlen)
        for backend in args.backends.split(","):
            times = {(s, p): [] for s in ("exact", "block") for p in ("fwd", "fwd+bwd")}
            for r in range(args.repeats + 1):
                for sem, lo in (("exact", exact), ("block", block)):
                    t0 = time.perf_counter()
                    out = block_sparse_attention(q, k, v, lo, backend=backend)
                    t1 = time.perf_counter()
                    out.sum().backward()
                    t2 = time.perf_counter()
                    if r:
                        times[(sem, "fwd")].append(t1 - t0)
                        times[(sem, "fwd+bwd")].append(t2 - t0)
            for p in ("fwd", "fwd+bwd"):
                e, b = statistics.median(times[("exact", p)]), statistics.median(times[("block", p)])
                rows.append({"pattern": name, "backend": backend, "pass": p, "partial_blocks": exact.num_partial_blocks,
                             "kept_blocks": exact.nnz_blocks, "exact_ms": e * 1e3, "block_level_ms": b * 1e3,
                             "exact/block": e / b, "target_met": e / b <= TARGET})
    header["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    cols = [("pattern", "pattern"), ("backend", "backend"), ("pass", "pass"), ("partial_blocks", "partial"),
            ("kept_blocks", "kept"), ("exact_ms", "exact ms"), ("block_level_ms", "block-level ms"),
            ("exact/block", "exact/block"), ("target_met", f"<= {TARGET}")]
    table = format_table(rows, cols)
    text = (f"{format_header(header)} -> {header['load_avg_1min_after']} after\n"
            f"# B=1, H={H}, N={N}, D={D}, block {args.block}, fp32, {torch.get_num_threads()} threads, "
            f"median of {args.repeats} interleaved rounds\n\n{table}\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("```\n" + text + "```\n")
    write_csv(args.out.with_suffix(".csv"), rows, header)
    write_json(args.out.with_suffix(".json"), {"header": header, "load_avg_before": load_before, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
