"""Long-sequence stress test: block-sparse attention forward+backward at n up to 131072 on CPU.

Each measurement runs in a fresh subprocess (so ``ru_maxrss`` is that run's peak resident memory):

* ``time``: forward and backward wall time, peak RSS, and a float64 spot check of a few output rows
  (global row, middle row, last row) against dense softmax over those rows' kept keys.
* ``profile``: the largest single CPU allocation, from ``torch.profiler`` allocation events.
* ``limit``: the same forward+backward under ``RLIMIT_AS`` (address-space cap) of ``--limit-gib``,
  far below one ``n x n`` fp32 buffer (64 GiB at n = 131072); it can only pass if no such buffer,
  or anything near it, is ever allocated.

    python benchmarks/long_sequence.py            # n = 16k, 32k, 64k, 128k; writes results/long_sequence.*
    python benchmarks/long_sequence.py --n 131072 --modes time

Pattern: ``patterns.longformer(n, block, window, global_tokens)`` (sliding window ``|q - k| <=
window`` plus global tokens whose rows and columns are complete), backend ``"torch"``, fp32,
batch 1. Memory in bytes (MiB/GiB = 2^20/2^30).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _child(cfg: dict) -> dict:
    import resource

    if cfg["mode"] == "limit":
        cap = int(cfg["limit_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch

    from sparse_io_attn import block_sparse_attention, patterns

    torch.set_num_threads(cfg["threads"])
    rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n, H, D = cfg["n"], cfg["heads"], cfg["head_dim"]
    layout = patterns.longformer(n, cfg["block"], cfg["window"], cfg["global_tokens"])
    layout.ccol_indices  # the transposed index backward needs (built once, counted here)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(1, H, n, D, generator=gen)
    res = {"n": n, "mode": cfg["mode"], "nnz_blocks": layout.nnz_blocks, "density": layout.density,
           "layout": layout.name, "rss_after_import": rss_import}

    def run():
        t0 = time.perf_counter()
        out = block_sparse_attention(q, k, v, layout, backend="torch")
        t1 = time.perf_counter()
        out.backward(do)
        t2 = time.perf_counter()
        return out, t1 - t0, t2 - t1

    if cfg["mode"] == "profile":
        from sparse_io_attn.accounting.allocations import allocation_sizes

        sizes = allocation_sizes(run)
        res["largest_alloc"] = max(sizes)
        res["num_allocs"] = len(sizes)
    else:
        out, t_fwd, t_bwd = run()
        res.update(fwd_s=t_fwd, bwd_s=t_bwd, finite=bool(torch.isfinite(out).all() and all(
            torch.isfinite(t.grad).all() for t in (q, k, v))))
        res["spot_rel_err"] = _spot_check(q, k, v, out, layout, [0, n // 2, n - 1])
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _spot_check(q, k, v, out, layout, rows) -> float:
    """Max relative error of ``out[0, :, rows]`` vs float64 softmax over each row's kept keys."""
    import torch

    bq, bk = layout.block_size
    blocks = layout.to_block_mask()[0, 0]
    worst = 0.0
    for i in rows:
        keys = blocks[i // bq].repeat_interleave(bk)[: layout.seqlen_k]
        s = (q[0, :, i:i + 1].double() @ k[0, :, keys].double().transpose(-1, -2)) * q.shape[-1] ** -0.5
        ref = torch.softmax(s, -1) @ v[0, :, keys].double()  # [H, 1, D]
        got = out[0, :, i:i + 1].detach().double()
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def _run(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True,
                          text=True, env=os.environ | {"OMP_NUM_THREADS": str(cfg["threads"])})
    if proc.returncode != 0:
        return {"n": cfg["n"], "mode": cfg["mode"], "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _header(args) -> list[str]:
    import torch

    import sparse_io_attn

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [f"device: CPU {cpu}, {os.cpu_count()} cores, {mem:.1f} GiB RAM; {args.threads} torch thread(s)",
            f"torch {torch.__version__}, sparse_io_attn {sparse_io_attn.__version__}, Python "
            f"{platform.python_version()}, backend \"torch\", dtype float32",
            f"batch 1, heads {args.heads}, head_dim {args.head_dim}, pattern longformer(block={args.block}, "
            f"window={args.window}, global_tokens={args.global_tokens})",
            f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at the end "
            f"{os.getloadavg()[0]:.1f} (shared machine: times are indicative, memory is not affected)"]


def _table(rows: list[dict], args) -> list[str]:
    gib, mib = 2**30, 2**20
    by_n: dict[int, dict] = {}
    for r in rows:
        by_n.setdefault(r["n"], {})[r["mode"]] = r
    out = ["| n | nnz blocks | density | fwd s | bwd s | peak RSS | largest alloc | n x n fp32 | "
           f"under {args.limit_gib:g} GiB cap | spot rel err |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for n, m in sorted(by_n.items()):
        t, p, lim = m.get("time", {}), m.get("profile", {}), m.get("limit", {})
        base = t or p or lim

        def fmt(d, key, f):
            return f(d[key]) if key in d else ("error" if "error" in d else "-")
        out.append(
            f"| {n} | {base.get('nnz_blocks', '-')} | {fmt(base, 'density', lambda x: f'{x:.4f}')} | "
            f"{fmt(t, 'fwd_s', lambda x: f'{x:.1f}')} | {fmt(t, 'bwd_s', lambda x: f'{x:.1f}')} | "
            f"{fmt(t, 'peak_rss', lambda x: f'{x / gib:.2f} GiB')} | "
            f"{fmt(p, 'largest_alloc', lambda x: f'{x / mib:.1f} MiB')} | {n * n * 4 / gib:g} GiB | "
            f"{('passed, peak RSS %.2f GiB' % (lim['peak_rss'] / gib)) if 'peak_rss' in lim else fmt(lim, 'x', str)} | "
            f"{fmt(t, 'spot_rel_err', lambda x: f'{x:.1e}')} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--modes", nargs="+", default=["time", "profile", "limit"],
                   choices=["time", "profile", "limit"])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--global-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gib", type=float, default=8.0)
    p.add_argument("--out", type=Path, default=RESULTS / "long_sequence")
    p.add_argument("--render", type=Path, help="re-render --out's .md from this saved .json")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.render:  # re-render the .md from a saved .json (same numbers, no rerun)
        saved = json.loads(args.render.read_text())
        return _write(args, saved["header"], saved["rows"], saved["command"])
    rows = []
    for n in args.n:
        for mode in args.modes:
            cfg = dict(n=n, mode=mode, heads=args.heads, head_dim=args.head_dim, block=args.block,
                       window=args.window, global_tokens=args.global_tokens, threads=args.threads,
                       limit_gib=args.limit_gib)
            r = _run(cfg)
            print(json.dumps(r), flush=True)
            rows.append(r)
    command = "python benchmarks/long_sequence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return _write(args, _header(args), rows, command.strip())


def _write(args, header: list[str], rows: list[dict], command: str) -> str:
    lines = ["# Long-sequence stress test (forward + backward, CPU, torch path)", "",
             f"Command: `{command}`", "", *[f"    {h}" for h in header], "", *_table(rows, args), "",
             *_summary(rows, args)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "header": header, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(text)
    return text


def _summary(rows: list[dict], args) -> list[str]:
    """What the table shows, in words computed from the rows."""
    gib, mib = 2**30, 2**20
    out = ["Columns: *peak RSS* is the subprocess's `ru_maxrss` (whole process: Python, torch, inputs,",
           "gradients, workspace); *largest alloc* is the largest single CPU allocation seen by",
           "`torch.profiler(profile_memory=True)`; *under cap* reruns forward+backward with the address",
           f"space limited to {args.limit_gib:g} GiB (`RLIMIT_AS`); *spot rel err* compares three output rows",
           "with float64 softmax over their kept keys.", ""]
    for r in rows:
        if r["mode"] == "profile" and "largest_alloc" in r:
            n = r["n"]
            q_bytes = n * args.heads * args.head_dim * 4
            out.append(f"* n = {n}: largest single allocation {r['largest_alloc'] / mib:.0f} MiB, "
                       f"{n * n * 4 / r['largest_alloc']:.0f}x smaller than one n x n fp32 score matrix "
                       f"({n * n * 4 / gib:g} GiB); one q-sized tensor [1, {args.heads}, n, "
                       f"{args.head_dim}] fp32 is {q_bytes / mib:.0f} MiB.")
        if r["mode"] == "limit" and "peak_rss" in r and r["n"] ** 2 * 4 > args.limit_gib * gib:
            out.append(f"* n = {r['n']}: forward+backward completed under a {args.limit_gib:g} GiB "
                       f"address-space cap, smaller than one n x n fp32 buffer "
                       f"({r['n'] ** 2 * 4 / gib:g} GiB): no such buffer was allocated.")
        if "error" in r:
            out.append(f"* n = {r['n']} ({r['mode']}): failed: {r['error']}")
    return out


if __name__ == "__main__":
    main()
