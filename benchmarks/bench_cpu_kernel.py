"""CPU benchmark of backend="cpu" (the fused C++ kernel) against dense SDPA, compiled FlexAttention
and backend="torch".

Setting (the CPU-kernel issue): B=1, H=8, N=4096, D=64, block 64, 2 torch threads, float32 and
bfloat16; patterns sliding window (~10% of blocks, element-exact band), BigBird (~15%), causal
(~50%) and dense (100%). For each dtype and pattern, one process runs interleaved rounds (every
method once per round, the starting method rotating) after one warm-up round:

* ours: ``block_sparse_attention(..., backend="cpu")``, forward and forward+backward;
* SDPA without any mask (the dense cost the targets compare with), forward and forward+backward;
  for the causal pattern also SDPA ``is_causal=True``;
* Flex: ``torch.compile(flex_attention)`` forward with ``layout.to_flex_block_mask(causal)``
  (compile time excluded, reported as ``flex_first_call_s``; FlexAttention has no CPU backward);
* torch: ``backend="torch"`` (the portable PyTorch path), forward and forward+backward.

The table reports the median wall time (ms) over the timed rounds, ratios (other / ours, > 1 means
ours is faster) and GFLOP/s over the *kept* FLOPs
(:func:`sparse_io_attn.block_sparse.traffic.block_sparse_flops`: 4*D per kept element forward,
10*D backward) next to dense SDPA's GFLOP/s over the full score matrix. The machine header records
the CPU, core count, versions, dtype, threads and the load average before and after (the machine
may be shared: compare ratios from the same rounds).

Targets (checked in the ``targets`` column): sliding window forward >= 8x and forward+backward >= 6x
faster than SDPA without mask, forward >= 1.5x faster than compiled Flex; causal not slower than
SDPA ``is_causal`` (forward and forward+backward); dense >= 0.95x SDPA (forward and
forward+backward).

    python benchmarks/bench_cpu_kernel.py                       # writes benchmarks/results/cpu_kernel.*
    python benchmarks/bench_cpu_kernel.py --seq-len 1024 --repeats 3 --dtypes fp32 --out /tmp/x
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparse_io_attn import block_sparse_attention
from sparse_io_attn.block_sparse import cpu as cpu_backend
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.block_sparse.traffic import block_sparse_flops
from sparse_io_attn.cli._common import DTYPES, format_header, format_table, machine_header, write_csv, write_json

from _cpu_timing import PATTERNS, build, fwd_bwd, shape_arguments, time_interleaved  # noqa: E402  (benchmarks/ on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(p, repeats=7)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention)")
    p.add_argument("--no-torch", action="store_true", help="skip backend='torch'")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_kernel", help="output stem (.md/.csv/.json)")
    return p.parse_args(argv)


def bench_pattern(args, name: str, dtype: torch.dtype, q, k, v, do, flex) -> dict:
    B, H, N, D = q.shape
    layout, causal = build(name, N, args.block)
    ours = lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, layout, causal=causal, backend="cpu")  # noqa: E731
    torch_path = lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, layout, causal=causal,  # noqa: E731
                                                           backend="torch")
    sdpa_causal = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)  # noqa: E731
    methods = {"ours_fwd": lambda: ours(q, k, v), "ours_fwdbwd": fwd_bwd(ours, q, k, v, do),
               "sdpa_fwd": lambda: F.scaled_dot_product_attention(q, k, v),
               "sdpa_fwdbwd": fwd_bwd(F.scaled_dot_product_attention, q, k, v, do)}
    if causal:
        methods.update(sdpa_causal_fwd=lambda: sdpa_causal(q, k, v),
                       sdpa_causal_fwdbwd=fwd_bwd(sdpa_causal, q, k, v, do))
    row = {"dtype": {v_: k_ for k_, v_ in DTYPES.items()}[dtype], "pattern": name, "layout": layout.name,
           "density": round(layout.density, 4)}
    with torch.no_grad():
        out = ours(q, k, v)
        row["rel_err_vs_torch"] = rel_err(out, torch_path(q, k, v))
    if flex is not None:
        block_mask = layout.to_flex_block_mask(causal)

        def flex_fwd(bm=block_mask):
            with torch.no_grad():   # one grad mode for every call: no recompilation
                return flex(q, k, v, block_mask=bm)
        methods["flex_fwd"] = flex_fwd
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                row["rel_err_vs_flex"] = rel_err(out, methods["flex_fwd"]())
            row["flex_first_call_s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # e.g. a dtype the CPU Flex backend does not compile
            print(f"# flex failed for {name} {dtype}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del methods["flex_fwd"]
            row["flex_error"] = f"{type(e).__name__}"
    if not args.no_torch:
        methods.update(torch_fwd=lambda: torch_path(q, k, v), torch_fwdbwd=fwd_bwd(torch_path, q, k, v, do))

    times = time_interleaved(methods, args.repeats)
    med = {k_: statistics.median(t) * 1e3 for k_, t in times.items()}
    mins = {k_: min(t) * 1e3 for k_, t in times.items()}
    fl_f = block_sparse_flops(layout, B, H, D, causal=causal)
    fl_b = block_sparse_flops(layout, B, H, D, causal=causal, backward=True)
    dense_f, dense_b = 4 * D * N * N * B * H, 10 * D * N * N * B * H
    row.update(kept=round(fl_f / dense_f, 4),
               ours_fwd_ms=med["ours_fwd"], ours_fwdbwd_ms=med["ours_fwdbwd"],
               sdpa_fwd_ms=med["sdpa_fwd"], sdpa_fwdbwd_ms=med["sdpa_fwdbwd"],
               x_sdpa_fwd=med["sdpa_fwd"] / med["ours_fwd"], x_sdpa_fwdbwd=med["sdpa_fwdbwd"] / med["ours_fwdbwd"])
    if causal:
        row.update(sdpa_causal_fwd_ms=med["sdpa_causal_fwd"], sdpa_causal_fwdbwd_ms=med["sdpa_causal_fwdbwd"],
                   x_sdpa_causal_fwd=med["sdpa_causal_fwd"] / med["ours_fwd"],
                   x_sdpa_causal_fwdbwd=med["sdpa_causal_fwdbwd"] / med["ours_fwdbwd"])
    if "flex_fwd" in med:
        row.update(flex_fwd_ms=med["flex_fwd"], x_flex_fwd=med["flex_fwd"] / med["ours_fwd"])
    if not args.no_torch:
        row.update(torch_fwd_ms=med["torch_fwd"], torch_fwdbwd_ms=med["torch_fwdbwd"],
                   x_torch_fwd=med["torch_fwd"] / med["ours_fwd"],
                   x_torch_fwdbwd=med["torch_fwdbwd"] / med["ours_fwdbwd"])
    row.update(ours_fwd_gflops=fl_f / med["ours_fwd"] / 1e6, ours_fwdbwd_gflops=(fl_f + fl_b) / med["ours_fwdbwd"] / 1e6,
               sdpa_fwd_gflops=dense_f / med["sdpa_fwd"] / 1e6,
               sdpa_fwdbwd_gflops=(dense_f + dense_b) / med["sdpa_fwdbwd"] / 1e6)
    row.update({f"min_{k_}_ms": v_ for k_, v_ in mins.items()})
    row["rounds"] = args.repeats
    row["targets"] = targets_note(name, row)
    return row


def targets_note(name: str, row: dict) -> str:
    def check(label, value, goal):
        return f"{label}>={goal:g}x {'met' if value >= goal else 'NOT met'} ({value:.2f})"
    notes = []
    if name == "sliding_window":
        notes += [check("fwd/SDPA", row["x_sdpa_fwd"], 8.0), check("f+b/SDPA", row["x_sdpa_fwdbwd"], 6.0)]
        if "x_flex_fwd" in row:
            notes.append(check("fwd/Flex", row["x_flex_fwd"], 1.5))
    elif name == "causal":
        notes += [check("fwd/SDPA-causal", row["x_sdpa_causal_fwd"], 1.0),
                  check("f+b/SDPA-causal", row["x_sdpa_causal_fwdbwd"], 1.0)]
    elif name == "dense":
        notes += [check("fwd/SDPA", row["x_sdpa_fwd"], 0.95), check("f+b/SDPA", row["x_sdpa_fwdbwd"], 0.95)]
    return "; ".join(notes) or "-"


COLUMNS = [("dtype", "dtype"), ("pattern", "pattern"), ("kept", "kept"),
           ("ours_fwd_ms", "ours fwd ms"), ("ours_fwdbwd_ms", "ours f+b ms"),
           ("sdpa_fwd_ms", "SDPA fwd ms"), ("sdpa_fwdbwd_ms", "SDPA f+b ms"),
           ("x_sdpa_fwd", "x SDPA fwd"), ("x_sdpa_fwdbwd", "x SDPA f+b"),
           ("sdpa_causal_fwd_ms", "SDPA-causal fwd ms"), ("sdpa_causal_fwdbwd_ms", "SDPA-causal f+b ms"),
           ("x_sdpa_causal_fwd", "x causal fwd"), ("x_sdpa_causal_fwdbwd", "x causal f+b"),
           ("flex_fwd_ms", "Flex fwd ms"), ("x_flex_fwd", "x Flex"),
           ("torch_fwd_ms", "torch fwd ms"), ("torch_fwdbwd_ms", "torch f+b ms"),
           ("x_torch_fwd", "x torch fwd"), ("x_torch_fwdbwd", "x torch f+b"),
           ("ours_fwd_gflops", "ours fwd GF/s"), ("ours_fwdbwd_gflops", "ours f+b GF/s"),
           ("sdpa_fwd_gflops", "SDPA fwd GF/s"), ("sdpa_fwdbwd_gflops", "SDPA f+b GF/s")]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu_backend.load()   # build (or load) the kernel before anything is timed
    B, H, N, D = 1, args.heads, args.seq_len, args.head_dim
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    header = machine_header(dtypes[0], "cpu")
    header["dtype"] = args.dtypes
    header["threads"] = args.threads
    header["shape"] = f"B={B} H={H} N={N} D={D} block={args.block}"
    header["cpu_kernel_isa"] = torch.ops.sparse_io_attn_cpu.capability()
    header["load_avg_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(format_header(header))
    print(f"# {header['shape']}, threads {args.threads}, kernel ISA {header['cpu_kernel_isa']}, load average "
          f"{header['load_avg_at_start']}", flush=True)

    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        torch._dynamo.config.recompile_limit = 64   # one compilation per pattern and dtype
        flex = torch.compile(flex_attention)
    rows = []
    for dtype in dtypes:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, dtype=dtype) for _ in range(4))
        for name in args.patterns.split(","):
            row = bench_pattern(args, name, dtype, q, k, v, do, flex)
            rows.append(row)
            print(format_table([row], COLUMNS), flush=True)
            print(f"# targets: {row['targets']}", flush=True)
    header["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_outputs(args.out, header, rows)
    return 0


def write_outputs(stem: Path, header: dict, rows: list) -> None:
    table = format_table(rows, COLUMNS)
    targets = "\n".join(f"- {r['dtype']} {r['pattern']}: {r['targets']}" for r in rows if r["targets"] != "-")
    md = ["# CPU benchmark: backend=\"cpu\" (fused C++ kernel) vs SDPA, compiled FlexAttention and backend=\"torch\"", "",
          "```", format_header(header),
          f"# {header['shape']}, threads {header['threads']}, kernel ISA {header['cpu_kernel_isa']}, load average at "
          f"start {header['load_avg_at_start']}, at end {header['load_avg_at_end']} (the machine may be shared)",
          "```", "",
          f"Median wall time over {rows[0]['rounds'] if rows else '?'} interleaved rounds after a warm-up round. "
          "`x ...` = other method's time / ours (> 1: ours is faster). SDPA = `scaled_dot_product_attention` "
          "without any mask; SDPA-causal = `is_causal=True`; Flex = `torch.compile(flex_attention)` forward with "
          "the layout's BlockMask; torch = `backend=\"torch\"`. GFLOP/s: ours over the kept FLOPs "
          "(`block_sparse_flops`), SDPA over the full score matrix. `kept` = kept fraction of the score "
          "elements.", "", "```", table, "```", "", "Targets:", "", targets, ""]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(md))
    write_csv(stem.with_suffix(".csv"), rows, header)
    write_json(stem.with_suffix(".json"), {"header": header, "rows": rows})
    print(table)
    print(targets)
    print(f"wrote {stem.with_suffix('.md')}, .csv, .json")


if __name__ == "__main__":
    raise SystemExit(main())
