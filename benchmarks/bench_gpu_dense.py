"""GPU timing of the dense backward kernels (issue 5, section 4): small cache (Algorithm 6) vs large
cache (Algorithm 9, "faithful" and "fa2"), with M forced below and above d^2.

Grid: dtype in {fp32, bf16}, d in {64, 128, 256}, n in {2048, 8192}, batch*heads = --bh, and
M in {1/4, 1/2, 1, 2, 4} x d^2 (words), each kernel at every M where its tiles fit. Per row: median
time (``triton.testing.do_bench``), the bytes the traffic model predicts (== what ``IOCounter``
counts), the implied bandwidth, and the Theorem 1.1 bound. Runs that fail (out of shared memory
for large tiles, out of GPU memory for the small-cache n x n buffers) are recorded with the error.

    python benchmarks/bench_gpu_dense.py                       # full grid, writes benchmarks/results/
    python benchmarks/bench_gpu_dense.py --d 256 --n 8192 --dtype bf16 --m-over-d2 0.25 1 4
    python benchmarks/bench_gpu_dense.py --smoke               # tiny run on any device (CPU: interpreter)

Nsight Compute (DRAM and L2->SM bytes of one launch; cold caches, like the model)::

    ncu --target-processes all -k regex:_row_kernel --launch-count 1 --clock-control none \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,l1tex__m_xbar2l1tex_read_bytes.sum,\\
    l1tex__m_l1tex2xbar_write_bytes.sum,gpu__time_duration.sum --csv --page raw \\
        python benchmarks/bench_gpu_dense.py --d 128 --n 8192 --dtype bf16 --m-over-d2 2 --reps 1

Nothing has been run on a GPU yet; results appear in benchmarks/results/gpu_dense_<gpu>.{md,csv}.
"""
from __future__ import annotations

import argparse
import csv
import math
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNELS = ("small", "faithful", "fa2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--m-over-d2", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0],
                   help="fast-memory sizes M as multiples of d^2 (words)")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--bh", type=int, default=8, help="batch x heads (independent problems)")
    p.add_argument("--splits", type=int, default=0,
                   help="num_splits for the faithful kernel (0: enough programs for every SM)")
    p.add_argument("--reps", type=int, default=20, help="timing repetitions (do_bench rep in ms on GPU)")
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/gpu_dense_<gpu>)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configuration (n=48, d=32, bh=1) that runs on any device; writes nothing "
                        "unless --out is given")
    return p.parse_args(argv)


def _time(fn, reps: int, cuda: bool) -> float:
    """Median milliseconds: ``triton.testing.do_bench`` on a GPU, warm perf_counter repeats on CPU."""
    if cuda:
        import triton
        return float(triton.testing.do_bench(fn, warmup=max(5, reps // 4), rep=max(reps, 10)))
    fn()
    ts = []
    for _ in range(max(1, reps)):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def run_case(kernel, n, d, M, dtype, bh, splits, reps, device):
    from sparse_io_attn import dense
    from sparse_io_attn.bounds import dense_backward
    from sparse_io_attn.dense import traffic
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(device=device, dtype=dtype)  # noqa: E731
    A1, A2, A3, dO = (mk(bh, n, d) for _ in range(4))
    X, Y = mk(d, d) / math.sqrt(d), mk(d, d) / math.sqrt(d)
    row = {"kernel": kernel, "dtype": str(dtype).replace("torch.", ""), "n": n, "d": d, "bh": bh, "M": M,
           "M_over_d2": M / (d * d)}
    try:
        if kernel == "small":
            fn = lambda: dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=M)  # noqa: E731
            model = traffic.small_cache_traffic(n, d, M, batch=bh, dtype=dtype)
        else:
            O, lse = dense.forward(A1, A2, A3, X, Y, M=M)
            fn = lambda: dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, variant=kernel,  # noqa: E731
                                                    num_splits=splits)
            model = traffic.large_cache_traffic(n, d, M, batch=bh, dtype=dtype, variant=kernel,
                                                num_splits=splits)
        ms = _time(fn, reps, device.type == "cuda")
        row.update(ms=ms, model_bytes=model.total_bytes, model_GBps=model.total_bytes / ms / 1e6, error="")
    except Exception as exc:  # noqa: BLE001  (tiles that do not fit, OOM, out of resources: recorded)
        row.update(ms=None, model_bytes=None, model_GBps=None, error=f"{type(exc).__name__}: {str(exc)[:120]}")
    row["bound_bytes"] = dense_backward(n, d, M, form="paper", heads=bh).value_words * \
        torch.tensor([], dtype=dtype).element_size()
    return row


def header(device) -> list[str]:
    import triton
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    return [f"- device: {name}", f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
            "- timings: triton.testing.do_bench median ms (GPU) or median of warm repeats (CPU)",
            "- model_bytes: sparse_io_attn.dense.traffic (== IOCounter's count); bound: Theorem 1.1, unit constants"]


def main(argv=None) -> None:
    args = parse_args(argv)
    import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter on CPU-only machines)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.n, args.d, args.bh, args.m_over_d2, args.reps = [48], [32], 1, [1.0, 4.0, 8.0], 1
    rows = []
    for dt in args.dtype:
        for d in args.d:
            for n in args.n:
                for r in args.m_over_d2:
                    M = max(1024, int(r * d * d))
                    for kernel in args.kernels:
                        splits = args.splits
                        if kernel == "faithful" and splits == 0:
                            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
                            splits = max(1, -(-sms // args.bh))
                        row = run_case(kernel, n, d, M, DTYPES[dt], args.bh, max(splits, 1), args.reps, device)
                        rows.append(row)
                        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if args.smoke and args.out is None:
        return
    out = args.out or RESULTS / ("gpu_dense_" + (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
                                 .lower().replace(" ", "_"))
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["kernel", "dtype", "n", "d", "bh", "M", "M_over_d2", "ms", "model_bytes", "model_GBps", "bound_bytes", "error"]
    with open(f"{out}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    lines = ["# Dense backward kernels: time vs M", ""] + header(device) + ["", "| " + " | ".join(cols) + " |",
                                                                          "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r[c] is None else (f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]))
                                for c in cols) + " |" for r in rows]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.md and {out}.csv")


if __name__ == "__main__":
    main()
