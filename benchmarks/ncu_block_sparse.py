"""Nsight Compute next to the counted traffic, for one configuration of backend="triton".

Runs itself under ``ncu`` (child mode ``--child``), profiling only the kernels of the second
step (``--launch-skip``: the first step is a warm-up that compiles them, with one fixed config:
``SPARSE_IO_ATTN_NO_AUTOTUNE=1``), then prints per kernel: the bytes the kernel counts (the traffic
model, equal to ``IOCounter``), DRAM bytes read/written, L2->SM read bytes and SM->L2 write bytes,
and the kernel time. ncu flushes caches before each kernel by default (a cold start, as the model).

    python benchmarks/ncu_block_sparse.py --n 4096 --d 128 --family random --density 0.25
    python benchmarks/ncu_block_sparse.py --ncu /usr/local/cuda/bin/ncu --mode fwd --json out.json
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

METRICS = {
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "l1tex__m_xbar2l1tex_read_bytes.sum": "l2_to_sm_read",
    "l1tex__m_l1tex2xbar_write_bytes.sum": "sm_to_l2_write",
    "gpu__time_duration.sum": "time_ns",
}
KERNELS = {"_attn_fwd_kernel": "attn_fwd", "_attn_bwd_preprocess_kernel": "attn_bwd_preprocess",
           "_attn_bwd_dkdv_kernel": "attn_bwd_dkdv", "_attn_bwd_dq_kernel": "attn_bwd_dq"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--family", default="random", choices=["sliding_window", "bigbird", "causal", "random"])
    p.add_argument("--density", type=float, default=0.25)
    p.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of the ncu executable")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _setup(args):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    import sparse_io_attn._triton.runtime  # noqa: F401
    from bench_gpu_block_sparse import make_layout

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    layout, causal = make_layout(args.family, args.n, args.block, args.density, args.heads)
    return torch, dtype, layout, causal


def child(args) -> None:
    torch, dtype, layout, causal = _setup(args)
    from sparse_io_attn import block_sparse_attention

    layout = layout.to("cuda")
    q, k, v, do = (torch.randn(args.batch, args.heads, args.n, args.d, device="cuda", dtype=dtype)
                   for _ in range(4))

    def step():
        qq, kk, vv = (t.detach().requires_grad_(args.mode != "fwd") for t in (q, k, v))
        out = block_sparse_attention(qq, kk, vv, layout, causal=causal, backend="triton")
        if args.mode != "fwd":
            out.backward(do)

    step()  # compile (ncu skips these launches: --launch-skip)
    torch.cuda.synchronize()
    step()
    torch.cuda.synchronize()


def parse_ncu_csv(text: str) -> dict:
    """``{kernel: {metric short name: value}}`` from ``ncu --csv --page raw --print-units base``."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        raise RuntimeError("ncu printed no kernel rows; check that the GPU is visible and ncu may profile "
                           "(permissions: NVreg_RestrictProfilingToAdminUsers)")
    head, data = rows[0], rows[2:]  # rows[1] holds the units
    out: dict = {}
    for row in data:
        rec = dict(zip(head, row))
        name = next((short for full, short in KERNELS.items() if full in rec.get("Kernel Name", "")), None)
        if name is None:
            continue
        agg = out.setdefault(name, {v: 0.0 for v in METRICS.values()})
        for metric, short in METRICS.items():
            agg[short] += float(rec[metric].replace(",", ""))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if shutil.which(args.ncu) is None and not Path(args.ncu).exists():
        sys.exit(f"ncu not found ({args.ncu!r}); install Nsight Compute or pass --ncu PATH")
    # The second step's kernels: skip the first step's (the warm-up that compiles them). Not an NVTX
    # range: the backward runs on the autograd engine's own thread, outside a range pushed here.
    per_step = 1 if args.mode == "fwd" else 4
    cmd = [args.ncu, "--target-processes", "all", "--launch-skip", str(per_step), "--launch-count", str(per_step),
           "-k", "regex:_attn_", "--clock-control", "none", "--metrics", ",".join(METRICS),
           "--csv", "--page", "raw", "--print-units", "base",
           sys.executable, str(Path(__file__).resolve()), "--child"] + [a for a in (argv or sys.argv[1:])
                                                                        if a != "--child"]
    env = dict(os.environ, SPARSE_IO_ATTN_NO_AUTOTUNE="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"ncu failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    measured = parse_ncu_csv(res.stdout)

    torch, dtype, layout, causal = _setup(args)
    from sparse_io_attn.accounting import traffic

    fn = traffic.block_sparse if args.mode != "fwd" else traffic.block_sparse_forward
    model = fn(layout, args.batch, args.heads, args.heads, args.d, dtype, causal=causal)
    table = []
    print(f"# {args.family} density {layout.density:.3f} N={args.n} D={args.d} B*H={args.batch * args.heads} "
          f"{args.dtype} causal={causal} ({torch.cuda.get_device_name() if torch.cuda.is_available() else '?'})")
    print("kernel | counted read | counted write | dram read | dram write | L2->SM read | SM->L2 write | time us")
    for name, kt in model.kernels.items():
        m = measured.get(name, {})
        row = {"kernel": name, "counted_read": kt.bytes_read, "counted_write": kt.bytes_written, **m}
        table.append(row)
        print(" | ".join([name, f"{kt.bytes_read:,}", f"{kt.bytes_written:,}"]
                         + [f"{m.get(k, float('nan')):,.0f}" for k in ("dram_read", "dram_write", "l2_to_sm_read",
                                                                       "sm_to_l2_write")]
                         + [f"{m.get('time_ns', float('nan')) / 1e3:.1f}"]))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": table}, indent=1, default=str))


if __name__ == "__main__":
    main()
