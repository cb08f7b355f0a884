"""Context parallelism's network traffic: the model at 1M tokens, and a measured gloo run.

* ``model``: N = 2**20 tokens, blocks of 128, W = 8, 16, 32, 64 ranks, one sequence with 32 query and 8
  KV heads of head dim 128 in bf16; sliding window (512), BigBird (defaults), causal, causal
  documents. Per rank: bytes received (max, mean) by this design (the K/V blocks its rows read and
  it does not own, and the queries of spread rows) against an all-gather of K/V and a ring (W - 1
  steps of the largest shard), and the plan's work imbalance (max / mean), strategy and spread rows.
  Plans are built from the kept blocks.
* ``measured``: ``context_parallel_attention`` forward + backward on W = 2 and 4 gloo CPU
  processes at a small N: counted network bytes (``IOCounter().network``) against the model, and
  wall time (median of warm repeats) next to one process running the whole sequence.

    python benchmarks/context_parallel_table.py            # writes results/context_parallel.{md,json}
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_io_attn import block_sparse_attention, patterns
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.accounting.traffic import context_parallel
from sparse_io_attn.distributed import ContextParallelPlan, context_parallel_attention

RESULTS = Path(__file__).parent / "results"
GiB = 2**30


def _documents(n: int, seed: int = 0) -> list[int]:
    """Document boundaries: lengths uniform in [2048, 131072] tokens (seeded), the last cut at ``n``."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < n:
        cu.append(min(n, cu[-1] + int(torch.randint(2048, 131073, (1,), generator=gen))))
    return cu


def _pattern(name: str, n: int, block: int):
    if name == "sliding_window":
        return patterns.sliding_window(n, block, 512), False
    if name == "bigbird":
        return patterns.bigbird(n, block), False
    if name == "causal":
        return patterns.causal(n, block), False
    if name == "documents":
        return patterns.document(_documents(n), block, causal=True), False
    raise ValueError(name)


def model_rows(n: int, block: int, worlds, heads_q: int, heads_kv: int, head_dim: int) -> list[dict]:
    rows = []
    for name in ("sliding_window", "bigbird", "causal", "documents"):
        layout, causal = _pattern(name, n, block)
        for world in worlds:
            t0 = time.perf_counter()
            plan = ContextParallelPlan(layout, world, causal=causal)
            build_s = time.perf_counter() - t0
            m = context_parallel(plan, batch=1, num_heads_kv=heads_kv, head_dim=head_dim, dtype=torch.bfloat16,
                                 num_heads_q=heads_q)
            assert m.recv == m.floor
            recv = [kv + q for kv, q in zip(m.recv, m.q_recv)]            # K/V and spread rows' queries
            partials = [q // m.q_token_bytes * (m.o_token_bytes + m.stats_token_bytes) for q in m.q_send]
            rows.append({"pattern": name, "layout": layout.name, "world": world, "strategy": plan.strategy,
                         "spread_rows": int(plan.spread.sum()),
                         "imbalance": plan.imbalance, "nnz_blocks": layout.nnz_blocks, "plan_s": build_s,
                         "recv_max": max(recv), "recv_mean": sum(recv) / world, "q_recv_max": max(m.q_recv),
                         "partials_max": max(partials),
                         "all_gather_max": max(m.all_gather), "all_gather_mean": sum(m.all_gather) / world,
                         "ring": max(m.ring)})
            print(f"{name} W={world}: {plan.strategy}, imbalance {plan.imbalance:.4f}, recv max "
                  f"{max(recv) / GiB:.3f} GiB, all-gather {max(m.all_gather) / GiB:.3f} GiB ({build_s:.1f} s)",
                  flush=True)
    return rows


# ---------------------------------------------------------------------------------------- measured
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: dict, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        out = {}
        for name in cfg["patterns"]:
            layout, causal = _pattern(name, cfg["n"], cfg["block"])
            plan = ContextParallelPlan(layout, world, causal=causal)
            gen = torch.Generator().manual_seed(0)
            q, k, v, do = (torch.randn(1, h, cfg["n"], cfg["head_dim"], generator=gen)
                           for h in (cfg["heads"], cfg["heads_kv"], cfg["heads_kv"], cfg["heads"]))
            leaves = [plan.shard(t, rank, 2).clone().requires_grad_() for t in (q, k, v)]
            do_local = plan.shard(do, rank, 2)
            times, counted = [], None
            for i in range(cfg["repeats"] + 1):
                dist.barrier()
                t0 = time.perf_counter()
                with IOCounter() as io:
                    context_parallel_attention(*leaves, plan, causal=causal, backend=cfg["backend"]).backward(do_local)
                dist.barrier()
                if i:
                    times.append(time.perf_counter() - t0)
                counted = io.network
            m = context_parallel(plan, batch=1, num_heads_kv=cfg["heads_kv"], head_dim=cfg["head_dim"],
                                 dtype=torch.float32, num_heads_q=cfg["heads"])
            out[name] = {"seconds": statistics.median(times), "counted_equals_model": counted == m.report(rank),
                         "recv": counted.bytes_read, "sent": counted.bytes_written, "imbalance": plan.imbalance,
                         "strategy": plan.strategy}
        torch.save(out, f"{path}.rank{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _single(cfg: dict) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in cfg["patterns"]:
        layout, causal = _pattern(name, cfg["n"], cfg["block"])
        gen = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, h, cfg["n"], cfg["head_dim"], generator=gen)
                       for h in (cfg["heads"], cfg["heads_kv"], cfg["heads_kv"], cfg["heads"]))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        times = []
        for i in range(cfg["repeats"] + 1):
            t0 = time.perf_counter()
            block_sparse_attention(*leaves, layout, causal=causal, backend=cfg["backend"]).backward(do)
            if i:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def measured_rows(cfg: dict, worlds) -> list[dict]:
    single = _single(cfg)
    rows = []
    for world in worlds:
        path = f"/tmp/context_parallel_bench_{os.getpid()}_{world}"
        mp.spawn(_worker, args=(world, _free_port(), cfg, path), nprocs=world)
        ranks = [torch.load(f"{path}.rank{r}") for r in range(world)]
        for name in cfg["patterns"]:
            res = [r[name] for r in ranks]
            rows.append({"pattern": name, "world": world, "strategy": res[0]["strategy"],
                         "imbalance": res[0]["imbalance"],
                         "counted_equals_model": all(r["counted_equals_model"] for r in res),
                         "recv_max": max(r["recv"] for r in res), "sent_max": max(r["sent"] for r in res),
                         "seconds_max": max(r["seconds"] for r in res), "single_process_s": single[name]})
            print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------- output
def _machine() -> list[str]:
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return [f"machine: 2-core development VM (nproc {cpu}), {platform.processor() or platform.machine()}",
            f"torch {torch.__version__}, Python {platform.python_version()}",
            f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
            f"{' '.join(load)} (shared machine: times are indicative; bytes are exact)"]


def _gib(b: float) -> str:
    return f"{b / GiB:.3f}"


def write(model: list[dict], measured: list[dict], args, cfg: dict) -> None:
    lines = ["# Context parallelism: network traffic per rank", "",
             "Command: `python benchmarks/context_parallel_table.py`", ""]
    lines += ["    " + s for s in _machine()] + [""]
    lines += [f"## Model: N = {args.n} tokens, blocks of {args.block}, 1 sequence, {args.heads_q} query / "
              f"{args.heads_kv} KV heads, head dim {args.head_dim}, bf16", "",
              "Bytes each rank receives in the forward exchange (backward sends the same sizes back as "
              "dK/dV and dQ). *this design*: the K/V blocks its rows read and it does not own (= the "
              "floor, checked), plus the queries of spread rows it computes for their owners (*of which "
              "queries*); *partials back*: the fp32 partial outputs and row statistics a rank receives "
              "for its spread rows (a second forward exchange); *all-gather*: every K/V token it does "
              "not own; *ring*: W - 1 steps of the largest shard. GiB = 2^30 bytes.", "",
              "| pattern | W | strategy | spread rows | imbalance | this design max GiB | mean GiB | "
              "of which queries, max GiB | partials back max GiB | all-gather max GiB | mean GiB | ring GiB | "
              "all-gather / this (mean) | plan s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in model:
        ratio = r["all_gather_mean"] / r["recv_mean"] if r["recv_mean"] else float("inf")
        lines.append(f"| {r['pattern']} | {r['world']} | {r['strategy']} | {r['spread_rows']} | {r['imbalance']:.4f} | "
                     f"{_gib(r['recv_max'])} | {_gib(r['recv_mean'])} | {_gib(r['q_recv_max'])} | "
                     f"{_gib(r['partials_max'])} | {_gib(r['all_gather_max'])} | "
                     f"{_gib(r['all_gather_mean'])} | {_gib(r['ring'])} | {ratio:.1f}x | {r['plan_s']:.1f} |")
    lines += ["", "Layouts: " + "; ".join(sorted({f"{r['pattern']}: `{r['layout']}` ({r['nnz_blocks']:,} kept blocks)"
                                                 for r in model})) + ".", ""]
    lines += [f"## Measured: gloo, CPU, N = {cfg['n']}, blocks of {cfg['block']}, {cfg['heads']} query / "
              f"{cfg['heads_kv']} KV heads, head dim {cfg['head_dim']}, fp32, backend \"{cfg['backend']}\", "
              f"1 thread per process", "",
              f"Forward + backward wall time: median of {cfg['repeats']} warm repeats, slowest rank; the "
              f"single process runs the whole sequence with 1 thread. W processes share the machine's "
              f"cores, so wall times are indicative only.", "",
              "| pattern | W | strategy | imbalance | counted bytes = model | max recv B (fwd + bwd) | "
              "max sent B | wall s (slowest rank) | single process s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in measured:
        lines.append(f"| {r['pattern']} | {r['world']} | {r['strategy']} | {r['imbalance']:.4f} | "
                     f"{r['counted_equals_model']} | {r['recv_max']:,} | {r['sent_max']:,} | "
                     f"{r['seconds_max']:.3f} | {r['single_process_s']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "context_parallel.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "context_parallel.json").write_text(json.dumps({"machine": _machine(), "model": model,
                                                               "measured": measured, "config": cfg}, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2**20)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--measured-n", type=int, default=4096)
    args = p.parse_args()
    cfg = {"n": args.measured_n, "block": 64, "heads": 4, "heads_kv": 2, "head_dim": 64, "backend": "torch",
           "repeats": 3, "patterns": ["sliding_window", "causal", "bigbird"]}
    model = model_rows(args.n, args.block, args.worlds, args.heads_q, args.heads_kv, args.head_dim)
    measured = measured_rows(cfg, [2, 4])
    write(model, measured, args, cfg)


if __name__ == "__main__":
    main()
