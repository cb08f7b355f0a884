"""Nsight Compute next to the counted traffic, for one configuration of backend="triton".

Default mode: runs itself under ``ncu`` (child mode ``--child``), profiling only the kernels of the
second step (``--launch-skip``: the first step is a warm-up that compiles them, with one fixed config:
``SPARSE_IO_ATTN_NO_AUTOTUNE=1``), then prints per kernel: the bytes the kernel counts (the traffic
model, equal to ``IOCounter``), DRAM bytes read/written, L2->SM read bytes and SM->L2 write bytes,
and the kernel time. ncu flushes caches before each kernel by default (a cold start, as the model).

``--dkdv-candidates``: the dK/dV kernel once per candidate configuration, one at a time
(``block_sparse.tiles.kernel_configs("dkdv", ...)``, read when the script runs: whatever the tiles
module lists), each launch profiled alone after a warm-up pass over all of them, next to the model's
dK/dV bytes for that candidate's tiles.

    python benchmarks/ncu_block_sparse.py --n 4096 --d 128 --family random --density 0.25
    python benchmarks/ncu_block_sparse.py --ncu /usr/local/cuda/bin/ncu --mode fwd --json out.json
    python benchmarks/ncu_block_sparse.py --dkdv-candidates --family causal --density 1.0 --json dkdv.json
    python benchmarks/ncu_block_sparse.py --dry-run [--dkdv-candidates]     # a CPU: the child in-process, no ncu
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ncu  # noqa: E402

KERNELS = {"_attn_fwd_kernel": "attn_fwd", "attn_bwd_preprocess_kernel": "attn_bwd_preprocess",
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
    p.add_argument("--dkdv-candidates", action="store_true", help="the dK/dV kernel per candidate configuration")
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of the ncu executable")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    p.add_argument("--dry-run", action="store_true", help="a CPU: N 64, D 16, H 2, blocks of 16, the child "
                                                          "in-process on the interpreter; ncu is not run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.n, args.d, args.heads, args.block = 64, 16, 2, 16
    return args


def _setup(args):
    import torch

    import sparse_io_attn._triton.runtime  # noqa: F401
    from bench_gpu_block_sparse import make_layout

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    layout, causal = make_layout(args.family, args.n, args.block, args.density, args.heads)
    return torch, dtype, layout, causal


def candidates(args, dtype) -> list:
    from sparse_io_attn.block_sparse.tiles import kernel_configs
    return kernel_configs("dkdv", (args.block, args.block), args.d, dtype)


def child(args) -> None:
    torch, dtype, layout, causal = _setup(args)
    from sparse_io_attn import block_sparse_attention

    device = "cpu" if args.dry_run else "cuda"
    layout = layout.to(device)
    q, k, v, do = (torch.randn(args.batch, args.heads, args.n, args.d, device=device, dtype=dtype)
                   for _ in range(4))
    if args.dkdv_candidates:
        _dkdv_child(args, torch, dtype, layout, causal, q, k, v, do)
        return

    def step():
        qq, kk, vv = (t.detach().requires_grad_(args.mode != "fwd") for t in (q, k, v))
        out = block_sparse_attention(qq, kk, vv, layout, causal=causal, backend="triton")
        if args.mode != "fwd":
            out.backward(do)

    for _ in range(2):   # the first compiles (ncu skips its launches: --launch-skip), the second is profiled
        step()
        if device == "cuda":
            torch.cuda.synchronize()


def _dkdv_child(args, torch, dtype, layout, causal, q, k, v, do) -> None:
    """Forward once, then the dK/dV call once per candidate, twice over (warm-up, profiled)."""
    import triton

    from sparse_io_attn import plan
    from sparse_io_attn._attention.triton.launch import run
    from sparse_io_attn.block_sparse.triton import launch

    p = plan(layout, causal=causal).to(q.device)
    scale = args.d ** -0.5
    out, _, stats = launch.forward(q, k, v, p, sm_scale=scale)
    calls, *_ = launch.backward_calls(do, q, k, v, out, stats, p, scale)
    pre, dkdv = calls[0], calls[1]
    run(pre, q.device, launch.TUNE_KEY)
    for _ in range(2):
        for c in candidates(args, dtype):
            cfg = triton.Config(c.constexprs(), num_warps=c.num_warps,
                                num_stages=c.num_stages)
            run(dataclasses.replace(dkdv, configs=[cfg]), q.device, launch.TUNE_KEY)
    if q.device.type == "cuda":
        torch.cuda.synchronize()


def _short(name: str) -> str | None:
    return next((short for full, short in KERNELS.items() if full in name), None)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    torch, dtype, layout, causal = _setup(args)
    from sparse_io_attn.accounting import traffic
    from sparse_io_attn.block_sparse.tiles import KernelTiles, choose_tiles

    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--child", "--dry-run")]
    cands = candidates(args, dtype) if args.dkdv_candidates else []
    if args.dkdv_candidates:
        regex, skip, count = "_attn_bwd_dkdv", len(cands), len(cands)
    else:   # the second step's kernels. Not an NVTX range: the backward runs on the autograd engine's own thread
        per_step = 1 if args.mode == "fwd" else 4
        regex, skip, count = "attn_", per_step, per_step
    cmd = _ncu.command(args.ncu, regex, str(Path(__file__).resolve()), passthrough, skip=skip, count=count)
    if args.dry_run:
        print("dry run: would run", " ".join(cmd))
        child(args)
        launches = []
    else:
        if shutil.which(args.ncu) is None and not Path(args.ncu).exists():
            sys.exit(f"ncu not found ({args.ncu!r}); install Nsight Compute or pass --ncu PATH")
        launches, _ = _ncu.run(cmd)
    print(f"# {args.family} density {layout.density:.3f} N={args.n} D={args.d} B*H={args.batch * args.heads} "
          f"{args.dtype} causal={causal} ({torch.cuda.get_device_name() if torch.cuda.is_available() else 'dry run'})")
    print("kernel | counted read | counted write | dram read | dram write | L2->SM read | SM->L2 write | time us")
    base = choose_tiles((args.block, args.block), args.d, dtype)
    table = []
    if args.dkdv_candidates:
        for i, c in enumerate(cands):
            tiles = KernelTiles(fwd=base.fwd, dq=base.dq, dkdv=(c.block_m, c.block_n), preprocess=base.preprocess)
            model = traffic.block_sparse(layout, args.batch, args.heads, args.heads, args.d, dtype, causal=causal,
                                         tiles=tiles).kernels["attn_bwd_dkdv"]
            table.append(_row(f"attn_bwd_dkdv {dataclasses.astuple(c)}", model,
                              launches[i] if i < len(launches) else {}, config=dataclasses.asdict(c)))
    else:
        fn = traffic.block_sparse if args.mode != "fwd" else traffic.block_sparse_forward
        model = fn(layout, args.batch, args.heads, args.heads, args.d, dtype, causal=causal)
        measured: dict = {}
        for launch_ in launches:
            name = _short(launch_["kernel"])
            if name is not None:
                agg = measured.setdefault(name, {m: 0.0 for m in _ncu.METRICS.values()})
                for m in _ncu.METRICS.values():
                    agg[m] += launch_[m]
        table = [_row(name, kt, measured.get(name, {})) for name, kt in model.kernels.items()]
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": table}, indent=1, default=str))


def _row(name: str, kt, m: dict, **extra) -> dict:
    print(" | ".join([name, f"{kt.bytes_read:,}", f"{kt.bytes_written:,}"]
                     + [f"{m.get(k, float('nan')):,.0f}" for k in ("dram_read", "dram_write", "l2_to_sm_read",
                                                                   "sm_to_l2_write")]
                     + [f"{m.get('time_ns', float('nan')) / 1e3:.1f}"]))
    return {"kernel": name, "counted_read": kt.bytes_read, "counted_write": kt.bytes_written,
            **{k: v for k, v in m.items() if k != "kernel"}, **extra}


if __name__ == "__main__":
    main()
