"""The floor of block-sparse forward+backward at small kept fractions, diagnosed on a GPU (issue 46).

The first H200 run saw forward+backward stay at 1.35-1.66 ms at 2.5-10% kept while the forward took
0.17-0.41 ms. For each case (layout family at a target density; N 8192, D 128, B 1, H 16, bf16,
blocks of 128 by default) and for the forward and forward+backward (``torch.autograd.grad`` of the
output: no ``.grad`` accumulation, so the step can be captured), this measures:

* ``do_bench`` with ``return_mode="all"``: every timed call, reported as mean, median, min, p20, p80;
* ``do_bench_cudagraph`` (median): the same step replayed from a CUDA graph, the host's launch work
  out of the time (a capture failure is recorded: it means the step is not capturable);
* ``host_us``: wall time of the Python call without synchronising (what the host spends enqueueing
  one step), median of 50 calls after warm-up;
* a ``torch.profiler`` trace of 5 steps (CPU and CUDA): each kernel's device time, the device-busy
  fraction between the first kernel's start and the last kernel's end, and the trace itself
  (``<out>/trace_<case>.json``, Chrome/Perfetto format).

Reading: graph time well under ``do_bench``'s, with device-busy low, is a host floor; graph time equal
to it is the kernels' own time (then the per-kernel times say which).

    python benchmarks/gpu_floor.py --out /tmp/floor                  # on a GPU
    python benchmarks/gpu_floor.py --dry-run --out /tmp/floor        # any CPU: the interpreter, tiny
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_timing as timing  # noqa: E402

CASES = ("causal:0.05", "sliding_window:0.05", "sliding_window:0.1")
STEPS = 5   # profiled steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--cases", nargs="+", default=list(CASES), help="family:target_density")
    p.add_argument("--out", type=Path, required=True, help="folder for floor.jsonl and the traces")
    p.add_argument("--dry-run", action="store_true", help="CPU, the Triton interpreter, the first case at N 64, "
                                                          "D 16, H 1, blocks of 16; no CUDA graph, CPU profiler")
    return p.parse_args(argv)


def _steps(layout, causal, q, k, v, do):
    from sparse_io_attn import block_sparse_attention

    def fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")

    def fwd_bwd():
        out = block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")
        torch.autograd.grad(out, (q, k, v), do)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _host_us(fn, dry: bool, n: int = 50) -> float:
    """Median wall time of ``fn()`` without synchronising after it (the host's enqueue time)."""
    times = []
    for _ in range(n if not dry else 1):
        timing.sync(dry)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    timing.sync(dry)
    return statistics.median(times)


def _profile(fn, dry: bool, trace: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([] if dry else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        for _ in range(STEPS):
            fn()
        timing.sync(dry)
    prof.export_chrome_trace(str(trace))
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per_kernel: dict = {}
    for e in kernels:
        per_kernel.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    out = {"trace": trace.name, "kernels_per_step": len(kernels) / STEPS,
           "kernel_us": {name[:80]: round(statistics.median(d), 1) for name, d in per_kernel.items()}}
    if kernels:
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        busy = sum(e.time_range.end - e.time_range.start for e in kernels)
        out.update(span_us_per_step=span / STEPS, busy_us_per_step=busy / STEPS, device_busy=busy / max(span, 1e-9))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    import sparse_io_attn._triton.runtime  # noqa: F401  (the interpreter on a CPU, before triton loads)
    from bench_gpu_block_sparse import make_layout

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: this diagnosis needs a GPU (--dry-run runs it on a CPU)")
    if dry:
        args.n, args.d, args.heads, args.block, args.cases = 64, 16, 1, 16, args.cases[:1]
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    q, k, v, do = (torch.randn(1, args.heads, args.n, args.d, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    header = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "torch": torch.__version__,
              "N": args.n, "D": args.d, "H": args.heads, "block": args.block, "dtype": str(dtype),
              "do_bench": timing.label("all", dry), "graph": timing.GRAPH_LABEL if not dry else "dry run"}
    print(json.dumps(header), flush=True)
    for case in args.cases:
        family, target = case.split(":")
        layout, causal = make_layout(family, args.n, args.block, float(target), args.heads)
        layout = layout.to(device)
        for mode, fn in _steps(layout, causal, q, k, v, do).items():
            fn()                                   # compile, autotune, plan
            timing.sync(dry)
            times = timing.bench(fn, mode="all", dry=dry)
            graph_ms, graph_error = timing.bench_graph(fn, dry=dry)
            row = {"case": case, "density": round(layout.density, 4), "causal": causal, "mode": mode,
                   "mean_ms": statistics.fmean(times), "median_ms": statistics.median(times), "min_ms": min(times),
                   "p20_ms": statistics.quantiles(times, n=5)[0] if len(times) > 1 else times[0],
                   "p80_ms": statistics.quantiles(times, n=5)[-1] if len(times) > 1 else times[0],
                   "timed_calls": len(times), "graph_median_ms": graph_ms, "graph_error": graph_error,
                   "host_us": _host_us(fn, dry)}
            row["profile"] = _profile(fn, dry, args.out / f"trace_{family}_{target}_{mode.replace('+', '')}.json")
            with (args.out / "floor.jsonl").open("a") as f:
                f.write(json.dumps({**row, "header": header}) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
