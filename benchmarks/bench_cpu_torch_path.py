"""CPU benchmark of backend="torch" against dense SDPA and compiled FlexAttention.

Setting (issue 2): B=1, H=8, N=4096, D=64, block 64, float32 on CPU; patterns sliding window
(~10% of blocks), BigBird (~15%), causal (~50%) and dense. For each pattern:

* ours: ``block_sparse_attention(..., backend="torch")``, forward and forward+backward;
* SDPA: ``F.scaled_dot_product_attention`` with the equivalent boolean element mask
  (``is_causal=True`` for the causal pattern, no mask for dense), forward and forward+backward;
* SDPA without any mask (the plain dense cost), forward and forward+backward, once;
* Flex: ``torch.compile(flex_attention)`` forward with ``layout.to_flex_block_mask(causal)``
  (compile time excluded; FlexAttention has no CPU backward).

Methods are run interleaved (one call of each per round) so that load from other processes hits
them alike; the table reports the median wall time over the warm rounds (and the minimum in the
CSV/JSON). Targets checked: at ~10% density ours >= 8x SDPA forward and >= 6x forward+backward;
at ~50% never slower than SDPA; forward >= 1.5x faster than compiled Flex.

    python benchmarks/bench_cpu_torch_path.py                    # writes benchmarks/results/cpu_torch_path.*
    python benchmarks/bench_cpu_torch_path.py --seq-len 1024 --repeats 3 --no-flex --out /tmp/x
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
from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_csv, write_json
from sparse_io_attn.block_sparse.reference import rel_err

from _cpu_timing import PATTERNS, build, fwd_bwd, shape_arguments, time_interleaved  # noqa: E402  (benchmarks/ on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {  # pattern -> (min fwd speedup vs SDPA, min fwd+bwd speedup vs SDPA)
    "sliding_window": (8.0, 6.0),
    "causal": (1.0, 1.0),
}
FLEX_TARGET = 1.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(p, repeats=7)
    p.add_argument("--threads", default=None,
                   help="comma-separated torch thread counts, one table block each (default: torch's choice)")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention)")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_torch_path", help="output stem (.md/.csv/.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    torch.manual_seed(0)
    B, H, N, D = 1, args.heads, args.seq_len, args.head_dim
    header = machine_header(torch.float32, "cpu")
    header["threads"] = ",".join(map(str, threads))
    header["shape"] = f"B={B} H={H} N={N} D={D} block={args.block}"
    header["load_avg_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(format_header(header))
    print(f"# {header['shape']}, threads {header['threads']}, load average {header['load_avg_at_start']}")

    q, k, v, do = (torch.randn(B, H, N, D) for _ in range(4))
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)
    rows, nomask = [], {}
    for nt in threads:
        torch.set_num_threads(nt)
        r, nomask[nt] = bench_threads(args, q, k, v, do, flex)
        rows += r
    header["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_outputs(args.out, header, rows, nomask)
    return 0


def bench_threads(args, q, k, v, do, flex):
    """Rows for every pattern at the current thread count, and the no-mask SDPA times (ms)."""
    B, H, N, D = q.shape
    nt = torch.get_num_threads()
    rows = []
    dense_sdpa = {"sdpa_nomask_fwd": lambda: F.scaled_dot_product_attention(q, k, v),
                  "sdpa_nomask_fwdbwd": fwd_bwd(F.scaled_dot_product_attention, q, k, v, do)}
    t_dense = time_interleaved(dense_sdpa, max(3, args.repeats // 2))
    med_dense = {k_: statistics.median(t) for k_, t in t_dense.items()}
    print(f"# {nt} threads: SDPA without mask: fwd {med_dense['sdpa_nomask_fwd'] * 1e3:.1f} ms, "
          f"fwd+bwd {med_dense['sdpa_nomask_fwdbwd'] * 1e3:.1f} ms")

    for name in args.patterns.split(","):
        layout, causal = build(name, N, args.block)
        if causal:
            sdpa = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)  # noqa: E731
        elif layout.density == 1.0:
            sdpa = F.scaled_dot_product_attention
        else:
            mask = layout.expand_dense_mask(B, H)
            sdpa = lambda q_, k_, v_, m=mask: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m)  # noqa: E731
        ours = lambda q_, k_, v_, lo=layout, c=causal: block_sparse_attention(  # noqa: E731
            q_, k_, v_, lo, causal=c, backend="torch")
        methods = {"ours_fwd": lambda: ours(q, k, v), "sdpa_fwd": lambda: sdpa(q, k, v),
                   "ours_fwdbwd": fwd_bwd(ours, q, k, v, do), "sdpa_fwdbwd": fwd_bwd(sdpa, q, k, v, do)}
        err = rel_err(ours(q, k, v), sdpa(q, k, v))
        if flex is not None:
            block_mask = layout.to_flex_block_mask(causal)
            methods["flex_fwd"] = lambda bm=block_mask: flex(q, k, v, block_mask=bm)
            t0 = time.perf_counter()
            err_flex = rel_err(ours(q, k, v), methods["flex_fwd"]())
            compile_s = time.perf_counter() - t0
        times = time_interleaved(methods, args.repeats)
        med = {k_: statistics.median(t) * 1e3 for k_, t in times.items()}
        mins = {k_: min(t) * 1e3 for k_, t in times.items()}
        row = {"threads": nt, "pattern": name, "layout": layout.name, "density": round(layout.density, 4),
               "ours_fwd_ms": med["ours_fwd"], "sdpa_fwd_ms": med["sdpa_fwd"],
               "speedup_fwd": med["sdpa_fwd"] / med["ours_fwd"],
               "ours_fwdbwd_ms": med["ours_fwdbwd"], "sdpa_fwdbwd_ms": med["sdpa_fwdbwd"],
               "speedup_fwdbwd": med["sdpa_fwdbwd"] / med["ours_fwdbwd"],
               "speedup_fwd_vs_nomask": med_dense["sdpa_nomask_fwd"] * 1e3 / med["ours_fwd"],
               "speedup_fwdbwd_vs_nomask": med_dense["sdpa_nomask_fwdbwd"] * 1e3 / med["ours_fwdbwd"],
               "rel_err_vs_sdpa": err}
        if flex is not None:
            row.update(flex_fwd_ms=med["flex_fwd"], speedup_vs_flex=med["flex_fwd"] / med["ours_fwd"],
                       rel_err_vs_flex=err_flex, flex_first_call_s=compile_s)
        row.update({f"min_{k_}_ms": v_ for k_, v_ in mins.items()})
        row["targets"] = targets_note(name, row)
        rows.append(row)
        print(f"{nt} threads, {name}: density {row['density']:.3f}, fwd {row['ours_fwd_ms']:.1f} ms vs SDPA "
              f"{row['sdpa_fwd_ms']:.1f} ({row['speedup_fwd']:.2f}x), fwd+bwd {row['ours_fwdbwd_ms']:.1f} vs "
              f"{row['sdpa_fwdbwd_ms']:.1f} ({row['speedup_fwdbwd']:.2f}x)"
              + (f", Flex fwd {row['flex_fwd_ms']:.1f} ({row['speedup_vs_flex']:.2f}x)" if flex else "")
              + f"; {row['targets']}", flush=True)
    return rows, {k_: v_ * 1e3 for k_, v_ in med_dense.items()}


def targets_note(name: str, row: dict) -> str:
    notes = []
    if name in TARGETS:
        t_f, t_fb = TARGETS[name]
        notes.append(f"fwd>={t_f:g}x {'met' if row['speedup_fwd'] >= t_f else 'NOT met'}")
        notes.append(f"fwd+bwd>={t_fb:g}x {'met' if row['speedup_fwdbwd'] >= t_fb else 'NOT met'}")
    if "speedup_vs_flex" in row:
        notes.append(f"flex>={FLEX_TARGET:g}x {'met' if row['speedup_vs_flex'] >= FLEX_TARGET else 'NOT met'}")
    return ", ".join(notes) or "-"


def write_outputs(stem: Path, header: dict, rows: list, nomask: dict) -> None:
    cols = [("threads", "threads"), ("pattern", "pattern"), ("density", "density"), ("ours_fwd_ms", "ours fwd ms"),
            ("sdpa_fwd_ms", "SDPA fwd ms"), ("speedup_fwd", "x"), ("flex_fwd_ms", "Flex fwd ms"),
            ("speedup_vs_flex", "x Flex"), ("ours_fwdbwd_ms", "ours f+b ms"),
            ("sdpa_fwdbwd_ms", "SDPA f+b ms"), ("speedup_fwdbwd", "x f+b"), ("targets", "targets")]
    table = format_table(rows, cols)
    md = [f"# CPU benchmark: backend=\"torch\" vs SDPA and compiled FlexAttention", "",
          "```", format_header(header),
          f"# {header['shape']}, threads {header['threads']}, load average at start "
          f"{header['load_avg_at_start']}, at end {header['load_avg_at_end']} (the machine is shared)",
          "```", "",
          "Median wall time over warm interleaved rounds. SDPA uses the equivalent boolean element mask "
          "(`is_causal=True` for causal, no mask for dense). `x` = SDPA time / ours. SDPA without any mask: "
          + "; ".join(f"{nt} threads fwd {t['sdpa_nomask_fwd']:.1f} ms, fwd+bwd {t['sdpa_nomask_fwdbwd']:.1f} ms"
                      for nt, t in nomask.items()) + ".", "", "```", table, "```", ""]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(md))
    write_csv(stem.with_suffix(".csv"), rows, header)
    write_json(stem.with_suffix(".json"), {"header": header, "sdpa_nomask_ms": nomask, "rows": rows})
    print(table)
    print(f"wrote {stem.with_suffix('.md')}, .csv, .json")


if __name__ == "__main__":
    raise SystemExit(main())
