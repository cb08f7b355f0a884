"""Nsight Compute on the paper's dense-form backward kernels (Algorithm 6: small cache, Algorithm 9: large
cache, "faithful") at two fast-memory sizes M, next to the traffic model (issue 43 point 5).

The child runs each case's forward, a warm-up backward (compiles), records the backward's launch names
(``_triton.runtime.recording()``: nothing runs), then the profiled backward inside an NVTX range that
ncu filters on (``--nvtx-include prof/``; the backward is called directly on this thread). Per case and
model kernel name: counted bytes (``sparse_io_attn.dense.traffic``, == ``IOCounter``), DRAM bytes,
L2->SM and SM->L2 bytes, time. ncu flushes the caches before each kernel (a cold start, as the model).
A case that does not fit (M too small for a kernel's tiles, shared memory) is recorded with its error.

    python benchmarks/ncu_dense.py --json dense_ncu.json           # n 8192, d 128, bh 8, bf16, M = d^2 and 4 d^2
    python benchmarks/ncu_dense.py --dry-run                       # a CPU: the child in-process, no ncu
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ncu  # noqa: E402

KERNELS = {"small": "Algorithm 6 (small cache)", "faithful": "Algorithm 9 (large cache, faithful)"}
RANGE = "prof"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--bh", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--m-over-d2", type=float, nargs="+", default=[1.0, 4.0], help="M as multiples of d^2 (words)")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--splits", type=int, default=0, help="num_splits of the faithful kernel (0: one program per SM)")
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="a CPU: n 48, d 32, bh 1, M = d^2 and 8 d^2, the "
                                                          "child in-process on the interpreter; ncu is not run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.n, args.d, args.bh, args.dtype, args.m_over_d2 = 48, 32, 1, "fp32", [1.0, 8.0]
    return args


def cases(args) -> list[tuple[str, int]]:
    return [(kernel, max(1024, int(r * args.d * args.d))) for kernel in args.kernels for r in args.m_over_d2]


def _call(args, kernel: str, M: int, device):
    """``fn()`` running the backward of ``kernel`` at ``M`` (forward done here), and its traffic model."""
    import torch

    from sparse_io_attn import dense
    from sparse_io_attn.dense import traffic
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(device=device, dtype=dtype)  # noqa: E731
    A1, A2, A3, dO = (mk(args.bh, args.n, args.d) for _ in range(4))
    X, Y = mk(args.d, args.d) / math.sqrt(args.d), mk(args.d, args.d) / math.sqrt(args.d)
    if kernel == "small":
        return (lambda: dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=M),
                traffic.small_cache_traffic(args.n, args.d, M, batch=args.bh, dtype=dtype))
    splits = args.splits or (max(1, -(-torch.cuda.get_device_properties(device).multi_processor_count // args.bh))
                             if device.type == "cuda" else 2)
    O, lse = dense.forward(A1, A2, A3, X, Y, M=M)
    return (lambda: dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, variant=kernel, num_splits=splits),
            traffic.large_cache_traffic(args.n, args.d, M, batch=args.bh, dtype=dtype, variant=kernel,
                                        num_splits=splits))


def child(args) -> None:
    """Per case one JSON line (its launch names in order, or its error); the profiled backward in an NVTX
    range on a GPU."""
    import torch

    from sparse_io_attn._triton.runtime import recording
    device = torch.device("cpu" if args.dry_run else "cuda")
    for kernel, M in cases(args):
        try:
            fn, _ = _call(args, kernel, M, device)
            fn()                                  # compile
            with recording() as rec:              # the launch names, in order (nothing runs)
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(RANGE)
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            print(json.dumps({"kernel": kernel, "M": M, "names": [r.name for r in rec]}), flush=True)
        except Exception as exc:  # noqa: BLE001  (a case that does not fit: recorded, the next runs)
            print(json.dumps({"kernel": kernel, "M": M, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}),
                  flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    import sparse_io_attn._triton.runtime  # noqa: F401  (the interpreter on a CPU, before triton loads)
    if args.child:
        child(args)
        return
    import io
    from contextlib import redirect_stdout

    import torch
    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--child", "--dry-run")]
    cmd = _ncu.command(args.ncu, ".*", str(Path(__file__).resolve()), passthrough, nvtx_range=RANGE)
    if args.dry_run:
        print("dry run: would run", " ".join(cmd))
        buf = io.StringIO()
        with redirect_stdout(buf):
            child(args)
        launches, child_out = [], buf.getvalue()
    else:
        if shutil.which(args.ncu) is None and not Path(args.ncu).exists():
            sys.exit(f"ncu not found ({args.ncu!r}); install Nsight Compute or pass --ncu PATH")
        launches, child_out = _ncu.run(cmd)
    device = torch.device("cpu" if args.dry_run else "cuda")
    results = [json.loads(ln) for ln in child_out.splitlines() if ln.startswith("{")]
    rows, pos = [], 0
    print(f"# dense-form backward, n={args.n} d={args.d} bh={args.bh} {args.dtype} "
          f"({torch.cuda.get_device_name() if not args.dry_run else 'dry run'})")
    print("case | kernel | counted read | counted write | dram read | dram write | L2->SM read | SM->L2 write | time us")
    for res in results:
        case = f"{KERNELS[res['kernel']]} M={res['M']} ({res['M'] / args.d ** 2:g} d^2)"
        if "error" in res:
            rows.append({"case": case, "error": res["error"]})
            print(f"{case} | error: {res['error'][:120]}")
            continue
        _, model = _call(args, res["kernel"], res["M"], device)
        measured: dict = {}
        for name, launch_ in zip(res["names"], launches[pos:pos + len(res["names"])]):
            agg = measured.setdefault(name, {m: 0.0 for m in _ncu.METRICS.values()})
            for m in _ncu.METRICS.values():
                agg[m] += launch_[m]
        pos += len(res["names"])
        for name, kt in model.kernels.items():
            m = measured.get(name, {})
            rows.append({"case": case, "kernel": name, "counted_read": kt.bytes_read, "counted_write": kt.bytes_written,
                         **m})
            print(" | ".join([case, name, f"{kt.bytes_read:,}", f"{kt.bytes_written:,}"]
                             + [f"{m.get(k, float('nan')):,.0f}" for k in ("dram_read", "dram_write", "l2_to_sm_read",
                                                                           "sm_to_l2_write")]
                             + [f"{m.get('time_ns', float('nan')) / 1e3:.1f}"]))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
