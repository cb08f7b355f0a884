"""Context parallelism's network traffic: the model at 1M tokens, per-step selections, and a
measured gloo run.

* ``model``: N = 2**20 tokens, blocks of 128, W = 8, 16, 32, 64 ranks, one sequence with 32 query and 8
  KV heads of head dim 128 in bf16; sliding window (512), BigBird (defaults), causal, causal
  documents. Per rank: bytes received (max, mean) by this design (the K/V blocks its rows read and
  it does not own, and the queries of spread rows) against an all-gather of K/V and a ring (W - 1
  steps of the largest shard), and the plan's work imbalance (max / mean), strategy and spread rows.
  Plans are built from the kept blocks (the static plan; its build time is the "plan s" column).
* ``steps``: selections chosen every step at N = 2**20, blocks of 128, 8 KV heads, 16 blocks per row
  (own + 15): MoBA selections from block means synthesized with the statistics of a trained model's
  queries and keys (``examples/train_dynamic_sparsity.py``'s MoBA char LM trained briefly; see
  :func:`trained_block_statistics`), uniformly random earlier blocks, and a recency window; a
  per-token selection (one per token, shared by the heads) built from the MoBA rows. Per rank: the
  K/V bytes of that step's units (model of every rank's ``plan.step``, = the floor) against an
  all-gather and a ring, W = 8 and 64 (``for_sequence``, zig-zag); the planning time of one step on
  one rank (``plan.step`` and the parts' attention plans) next to the attention time (estimated
  from a smaller measured run).
* ``measured``: ``context_parallel_attention`` forward + backward on W = 2 and 4 gloo CPU
  processes at a small N: counted network bytes (``IOCounter().network``) against the model, and
  wall time (median of warm repeats) next to one process running the whole sequence.

    python benchmarks/context_parallel_table.py            # writes results/context_parallel.{md,json}
    python benchmarks/context_parallel_table.py --sections steps   # one section (the others kept)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn import plan as attention_plan
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.accounting.traffic import context_parallel, context_parallel_steps
from sparse_io_attn.distributed import ContextParallelPlan, context_parallel_attention
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import plan_selection

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


# ---------------------------------------------------------------------------------------- per step
#: the trained char LM's (layer, head) pairs whose block statistics stand for the 8 KV heads
STEP_HEADS = ((1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3))
MOBA_BLOCK = 16          # the example's MoBA block (16 characters)


def trained_block_statistics(steps: int, cache: Path) -> dict:
    """The mean-pooled queries and keys of the MoBA char LM of ``examples/train_dynamic_sparsity.py``
    trained ``steps`` steps (its defaults otherwise): ``z [layers, windows, heads, blocks, 2 * head
    dim]`` (each block's mean query, then mean key) on 256 training windows of 256 characters, kept
    in ``cache`` (training takes minutes)."""
    if cache.exists():
        return torch.load(cache)
    import dataclasses
    import importlib.util
    import sys
    from sparse_io_attn.nn.selectors import block_means
    path = Path(__file__).resolve().parents[1] / "examples" / "train_dynamic_sparsity.py"
    spec = importlib.util.spec_from_file_location("train_dynamic_sparsity", path)
    dyn = importlib.util.module_from_spec(spec)
    sys.modules["train_dynamic_sparsity"] = dyn
    spec.loader.exec_module(dyn)
    cfg = dataclasses.replace(dyn.DEFAULTS, steps=steps)
    corpus = dyn.char_lm.Corpus()
    model = dyn.build_model("moba", corpus.vocab_size, cfg, 4)
    t0 = time.perf_counter()
    history = dyn.char_lm.train(model, corpus, cfg)
    seconds = time.perf_counter() - t0
    model.eval()
    caught = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: caught.append((m, a[0]))) for b in model.blocks]
    gen, windows = torch.Generator().manual_seed(0), []
    with torch.no_grad():
        for _ in range(8):
            x, _ = corpus.batch("train", 32, cfg.seq_len, gen)
            caught.clear()
            model(x)
            per_layer = []
            for m, h in caught:
                q, k, _ = m.project(h)
                per_layer.append(torch.cat([block_means(q, MOBA_BLOCK), block_means(k, MOBA_BLOCK)], -1))
            windows.append(torch.stack(per_layer))
    for h in hooks:
        h.remove()
    stats = {"z": torch.cat(windows, 1), "steps": steps, "train_seconds": seconds,
             "final_loss": sum(history["train"][-10:]) / 10}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(stats, cache)
    return stats


def _ar1(z: torch.Tensor):
    """A stationary first-order autoregression of block vectors ``z [windows, blocks, F]`` (float64):
    mean, transition ``A`` (ridge least squares over consecutive blocks), innovation and stationary
    covariances' Cholesky factors."""
    mu = z.mean((0, 1))
    x = z - mu
    X, Y = x[:, :-1].reshape(-1, x.shape[-1]), x[:, 1:].reshape(-1, x.shape[-1])
    eye = torch.eye(X.shape[1], dtype=X.dtype)
    A = torch.linalg.solve(X.T @ X + 1e-3 * X.pow(2).mean() * len(X) * eye, X.T @ Y).T
    innovation = torch.cov((Y - X @ A.T).T)
    stationary = torch.cov(x.reshape(-1, x.shape[-1]).T)
    return mu, A, torch.linalg.cholesky(innovation + 1e-9 * eye), torch.linalg.cholesky(stationary + 1e-9 * eye)


def synthesized_moba(stats: dict, n: int, block: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """MoBA's choice at ``n`` tokens in blocks of ``block``, one selection per KV head: block means
    synthesized as a stationary AR(1) process with each (layer, head) of :data:`STEP_HEADS`' trained
    statistics (mean, covariance, lag-one dependence of consecutive 16-character blocks), each row
    keeping its own block and the ``top_k - 1`` earlier blocks of highest pooled ``q . k``.
    int64 ``[heads, R, top_k]`` (``-1``: fewer earlier blocks)."""
    R = math.ceil(n / block)
    gen = torch.Generator().manual_seed(seed)
    z = stats["z"].double()
    out = torch.full((len(STEP_HEADS), R, top_k), -1, dtype=torch.int64)
    rows = torch.arange(R)
    out[:, :, 0] = rows
    D = z.shape[-1] // 2
    for i, (layer, head) in enumerate(STEP_HEADS):
        mu, A, innovation, stationary = _ar1(z[layer, :, head])
        noise = torch.randn(R, 2 * D, generator=gen, dtype=torch.float64) @ innovation.T
        x = stationary @ torch.randn(2 * D, generator=gen, dtype=torch.float64)
        blocks = torch.empty(R, 2 * D, dtype=torch.float64)
        for t in range(R):
            blocks[t] = x
            x = A @ x + noise[t]
        blocks += mu
        q, k = blocks[:, :D].float(), blocks[:, D:].float()
        for a in range(0, R, 1024):
            s = (q[a:a + 1024] @ k.T).masked_fill(rows[None, :] >= rows[a:a + 1024, None], float("-inf"))
            top = torch.topk(s, min(top_k - 1, R), dim=-1)
            out[i, a:a + 1024, 1:] = torch.where(top.values > float("-inf"), top.indices, -1)
    return out


def score_character(stats: dict) -> dict:
    """What decides the synthesized MoBA choice, from the trained block means of :data:`STEP_HEADS`:
    ``recency`` (mean pooled score at distance 1 minus at distance 8, over its standard deviation;
    near 0: no preference for recent blocks) and ``shared`` (norm of the mean query over the spread
    of the queries: the part of every row's ranking that is the same for all rows)."""
    z = stats["z"]
    D = z.shape[-1] // 2
    recency, shared = [], []
    for layer, head in STEP_HEADS:
        q, k = z[layer, :, head, :, :D], z[layer, :, head, :, D:]
        s = q @ k.transpose(-1, -2)                                         # [windows, blocks, blocks]
        recency.append(float((s.diagonal(-1, -2, -1).mean() - s.diagonal(-8, -2, -1).mean()) / s.std()))
        spread = (q - q.mean((0, 1))).pow(2).sum(-1).mean().sqrt()
        shared.append(float(q.mean((0, 1)).norm() / spread))
    return {"recency": sum(recency) / len(recency), "shared": sum(shared) / len(shared)}


def random_selection(heads: int, R: int, top_k: int, seed: int = 1) -> torch.Tensor:
    """Own block and ``top_k - 1`` uniformly random earlier blocks (repeats count once)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(R)
    earlier = (torch.rand(heads, R, top_k - 1, generator=gen) * rows[:, None]).long()
    return torch.cat([rows.expand(heads, R)[..., None], torch.where(rows[:, None] > 0, earlier, -1)], -1)


def window_selection(heads: int, R: int, top_k: int) -> torch.Tensor:
    """Own block and the ``top_k - 1`` before it (a recency window)."""
    sel = torch.arange(R)[:, None] - torch.arange(top_k)
    return torch.where(sel >= 0, sel, -1).expand(heads, R, top_k).contiguous()


def token_selection(kv_indices: torch.Tensor, n: int, block: int) -> Selection:
    """A per-token selection shared by the heads (``G = 1``): token ``t`` of block ``r`` takes row ``r``
    of head ``t % heads``, so the tokens of a block choose differently."""
    H, R, K = kv_indices.shape
    t = torch.arange(n)
    return Selection(kv_indices[t % H, t // block][None].contiguous(), block)


def _median_ms(f, repeats: int = 5) -> float:
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def step_rows(args) -> dict:
    n, block, K, heads_kv = args.n, args.block, 16, 8
    R = math.ceil(n / block)
    stats = trained_block_statistics(args.train_steps, Path(args.stats_cache))
    t0 = time.perf_counter()
    moba = synthesized_moba(stats, n, block, K)
    synth_s = time.perf_counter() - t0
    character = score_character(stats)
    earlier = (torch.arange(R)[None, :, None] - moba)[:, :, 1:][moba[:, :, 1:] >= 0].float()
    character["distance_quartiles"] = torch.quantile(earlier[torch.randperm(earlier.numel(),
                                                     generator=torch.Generator().manual_seed(0))[:1 << 20]],
                                                     torch.tensor([0.25, 0.5, 0.75])).tolist()
    selections = {"moba (trained statistics)": moba, "random earlier blocks": random_selection(heads_kv, R, K),
                  "recency window": window_selection(heads_kv, R, K)}
    layouts = {name: BlockSparseLayout.from_kv_indices(kv, block, n, check=False, name=name)
               for name, kv in selections.items()}
    per_token = token_selection(moba, n, block)
    rows, planning = [], []
    for world in (8, 64):
        plan = ContextParallelPlan.for_sequence(n, block, world, causal=True)
        for name, source in list(layouts.items()) + [("moba per token (G = 1)", per_token)]:
            steps = [plan.step(source, rank=r, num_heads_kv=heads_kv) for r in range(world)]
            m = context_parallel_steps(steps, batch=1, num_heads_kv=heads_kv, head_dim=args.head_dim)
            assert m.recv == m.floor
            kept = source.nnz_blocks if isinstance(source, BlockSparseLayout) else int((source.indices >= 0).sum())
            rows.append({"selection": name, "world": world, "kept": kept, "recv_max": max(m.recv),
                         "recv_mean": sum(m.recv) / world, "requests_max": max(m.req_send),
                         "all_gather_max": max(m.all_gather), "ring": max(m.ring)})
            print(rows[-1], flush=True)
            if name.startswith("moba"):
                rank = max(range(world), key=lambda r: sum(steps[r].recv_units))        # the busiest rank
                entry = {"selection": name, "world": world, "rank": rank,
                         "step_ms": _median_ms(lambda: plan.step(source, rank=rank, num_heads_kv=heads_kv))}
                if isinstance(source, BlockSparseLayout):
                    for hq in (8, 32):
                        def full():
                            s = plan.step(source, rank=rank, num_heads_kv=heads_kv)
                            for part, causal in ((s.local, True), (s.received, False)):
                                if part is not None:
                                    attention_plan(part, causal=causal, num_heads_q=hq, num_heads_kv=heads_kv)
                        entry[f"step_and_plans_ms_hq{hq}"] = _median_ms(full)
                planning.append(entry)
                print(planning[-1], flush=True)
    whole = {"layout_plan_ms_hq8": _median_ms(lambda: attention_plan(
        BlockSparseLayout.from_kv_indices(moba, block, n, check=False), causal=True), 3),
        "selection_plan_ms": _median_ms(lambda: plan_selection(per_token, n, causal_offset=0), 3)}
    return {"rows": rows, "planning": planning, "whole": whole, "attention": attention_estimate(args),
            "synthesis_s": synth_s, "scores": character, "training": {k: v for k, v in stats.items() if k != "z"},
            "machine": _machine()}


def attention_estimate(args) -> dict:
    """The attention of one rank's step at 1M tokens, estimated from a measured smaller run: backend
    ``cpu``, fp32, 8 query and K/V heads of head dim 128, a random 16-blocks-per-row causal selection
    of ``args.attention_n`` tokens in blocks of 128 on one process, forward and forward + backward
    (median of warm repeats); the time scales with the kept (head, row, block) entries."""
    n, block, H, D = args.attention_n, args.block, 8, args.head_dim
    layout = BlockSparseLayout.from_kv_indices(random_selection(H, math.ceil(n / block), 16), block, n, check=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, n, D, generator=gen) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    fwd = _median_ms(lambda: block_sparse_attention(*leaves, layout, causal=True, backend="cpu"), 3)
    both = _median_ms(lambda: block_sparse_attention(*leaves, layout, causal=True, backend="cpu").backward(do), 3)
    return {"n": n, "heads": H, "head_dim": D, "kept": layout.nnz_blocks, "forward_ms": fwd,
            "forward_backward_ms": both, "threads": torch.get_num_threads()}


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


def _ms(x: float) -> str:
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _header(machine: list) -> list:
    return ["    " + s for s in machine] + [""]


def _steps_lines(steps: dict, args) -> list:
    t = steps["training"]
    att = steps["attention"]
    sc = steps["scores"]
    lines = [f"## Per step: selections chosen every step, N = {args.n} tokens, blocks of {args.block}, 8 KV "
             f"heads, 16 blocks per row, head dim {args.head_dim}, bf16 (model, not a run)", ""]
    lines += _header(steps["machine"])
    lines += [
        "A plan of the sequence length (`ContextParallelPlan.for_sequence`, zig-zag ownership) and, every "
        "step, each rank's `plan.step(selection)`. Bytes each rank receives in the forward exchange: the "
        "K/V of the units its rows selected and it does not own (one key block of one K/V head: per head, "
        "not whole blocks of every head), from `accounting.traffic.context_parallel_steps` over every "
        "rank's step, equal to the floor (checked); backward sends the same sizes back as dK/dV. The "
        "requested unit ids (8 bytes each) add *requests*. *all-gather*: every K/V token a rank does not "
        "own; *ring*: W - 1 steps of a shard.", "",
        f"Selections. *moba (trained statistics)*: MoBA's choice (own block + the 15 earlier blocks of "
        f"highest mean-pooled q . k, per K/V head) on block means **synthesized** at 1M tokens, not "
        f"computed by a 1M-token model: a stationary AR(1) process per head with the mean, covariance and "
        f"lag-one dependence of the pooled queries and keys (16-character blocks) of "
        f"`examples/train_dynamic_sparsity.py`'s MoBA char LM trained {t['steps']} steps (loss "
        f"{t['final_loss']:.2f} nats/char after {t['train_seconds']:.0f} s; layers 2-3, 4 heads each, as "
        f"the 8 K/V heads). What decides the choice: little recency (mean pooled score at distance 1 "
        f"minus at distance 8: {sc['recency']:+.2f} standard deviations) and a strong component shared "
        f"by every row (the mean query's norm is {sc['shared']:.1f}x the spread of the queries), so every "
        f"row ranks much the same few key blocks first and the union a rank reads stays small; the "
        f"selected earlier blocks lie {sc['distance_quartiles'][0]:.0f} / {sc['distance_quartiles'][1]:.0f} / "
        f"{sc['distance_quartiles'][2]:.0f} blocks back (quartiles). *random earlier blocks*: own + 15 uniform "
        f"earlier blocks "
        f"(the union a rank reads grows with its rows: the hard case). *recency window*: own + the 15 "
        f"before. *moba per token (G = 1)*: a per-token selection shared by the heads (token t of "
        f"block r takes head t mod 8's row r), 16.8M (token, block) entries; a unit is then a block of "
        f"all 8 K/V heads.", "",
        "| selection | W | kept (row or token, block) entries | received max GiB | mean GiB | requests max MiB | "
        "all-gather GiB | ring GiB | all-gather / received (max) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in steps["rows"]:
        ratio = r["all_gather_max"] / r["recv_max"] if r["recv_max"] else float("inf")
        lines.append(f"| {r['selection']} | {r['world']} | {r['kept']:,} | {_gib(r['recv_max'])} | "
                     f"{_gib(r['recv_mean'])} | {r['requests_max'] / 2**20:.3f} | {_gib(r['all_gather_max'])} | "
                     f"{_gib(r['ring'])} | {ratio:.1f}x |")
    w = steps["whole"]
    est = att["forward_ms"] * 1040000 / att["kept"]                         # per rank: total kept / W
    lines += ["", f"Planning one step on the rank receiving the most (median of 5 warm repeats, "
              f"{steps['machine_threads']} threads): `plan.step` (which units from which rank, the received "
              f"key space, the local and received parts re-indexed; one host read) and, for a layout, the "
              f"parts' attention plans (`block_sparse` plans of the rank's rows, for 8 or 32 query heads: "
              f"with 32 the plan repeats each K/V head's lists for its 4 query heads).", "",
              "| selection | W | rank | plan.step ms | + parts' attention plans, Hq = 8, ms | Hq = 32, ms |",
              "|---|---|---|---|---|---|"]
    for r in steps["planning"]:
        lines.append(f"| {r['selection']} | {r['world']} | {r['rank']} | {_ms(r['step_ms'])} | "
                     f"{_ms(r['step_and_plans_ms_hq8']) if 'step_and_plans_ms_hq8' in r else '-'} | "
                     f"{_ms(r['step_and_plans_ms_hq32']) if 'step_and_plans_ms_hq32' in r else '-'} |")
    lines += ["", f"For comparison, one process planning the whole step: the attention plan of the 1M MoBA layout "
              f"(8 heads) {_ms(w['layout_plan_ms_hq8'])} ms; `selection_attention`'s plan of the per-token "
              f"selection (its rows normalised) {_ms(w['selection_plan_ms'])} ms.", "",
              f"The attention itself (estimated, not run at 1M): backend `cpu`, fp32, 8 heads of dim "
              f"{att['head_dim']}, measured on one process at N = {att['n']} ({att['kept']:,} kept blocks, "
              f"{att['threads']} threads): forward {_ms(att['forward_ms'])} ms, forward + backward "
              f"{_ms(att['forward_backward_ms'])} ms. Its time grows with the kept (head, row, block) "
              f"entries, so one rank's share of the 1M step (1.04M / W entries) takes about "
              f"{est / 8 / 1000:.1f} s forward at W = 8 and {est / 64 / 1000:.2f} s at W = 64 on this machine "
              f"(x 4 for 32 query heads): the step's planning is a few percent of it or less.", ""]
    return lines


def write(data: dict, args) -> None:
    cfg = data["config"]
    machines = data["machines"]
    lines = ["# Context parallelism: network traffic per rank", "",
             "Command: `python benchmarks/context_parallel_table.py` (`--sections model steps measured`)", ""]
    lines += [f"## Model: N = {args.n} tokens, blocks of {args.block}, 1 sequence, {args.heads_q} query / "
              f"{args.heads_kv} KV heads, head dim {args.head_dim}, bf16", ""]
    lines += _header(machines["model"])
    lines += ["Bytes each rank receives in the forward exchange (backward sends the same sizes back as "
              "dK/dV and dQ). *this design*: the K/V blocks its rows read and it does not own (= the "
              "floor, checked), plus the queries of spread rows it computes for their owners (*of which "
              "queries*); *partials back*: the fp32 partial outputs and row statistics a rank receives "
              "for its spread rows (a second forward exchange); *all-gather*: every K/V token it does "
              "not own; *ring*: W - 1 steps of the largest shard. GiB = 2^30 bytes. *plan s*: building "
              "the static plan (`ContextParallelPlan(layout, W, causal=...)`) from the layout.", "",
              "| pattern | W | strategy | spread rows | imbalance | this design max GiB | mean GiB | "
              "of which queries, max GiB | partials back max GiB | all-gather max GiB | mean GiB | ring GiB | "
              "all-gather / this (mean) | plan s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    model = data["model"]
    for r in model:
        ratio = r["all_gather_mean"] / r["recv_mean"] if r["recv_mean"] else float("inf")
        lines.append(f"| {r['pattern']} | {r['world']} | {r['strategy']} | {r['spread_rows']} | {r['imbalance']:.4f} | "
                     f"{_gib(r['recv_max'])} | {_gib(r['recv_mean'])} | {_gib(r['q_recv_max'])} | "
                     f"{_gib(r['partials_max'])} | {_gib(r['all_gather_max'])} | "
                     f"{_gib(r['all_gather_mean'])} | {_gib(r['ring'])} | {ratio:.1f}x | {r['plan_s']:.2f} |")
    lines += ["", "Layouts: " + "; ".join(sorted({f"{r['pattern']}: `{r['layout']}` ({r['nnz_blocks']:,} kept blocks)"
                                                 for r in model})) + ".", ""]
    if "steps" in data:
        lines += _steps_lines(data["steps"], args)
    measured = data["measured"]
    lines += [f"## Measured: gloo, CPU, N = {cfg['n']}, blocks of {cfg['block']}, {cfg['heads']} query / "
              f"{cfg['heads_kv']} KV heads, head dim {cfg['head_dim']}, fp32, backend \"{cfg['backend']}\", "
              f"1 thread per process", ""]
    lines += _header(machines["measured"])
    lines += [f"Forward + backward wall time: median of {cfg['repeats']} warm repeats, slowest rank; the "
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
    (RESULTS / "context_parallel.json").write_text(json.dumps(data, indent=1))


SECTIONS = ("model", "steps", "measured")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2**20)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--measured-n", type=int, default=4096)
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="sections to run; the others are kept from results/context_parallel.json")
    p.add_argument("--train-steps", type=int, default=200, help="steps of the MoBA char LM the statistics come from")
    p.add_argument("--stats-cache", default=os.path.join(tempfile.gettempdir(), "sparse_io_attn_moba_block_stats.pt"))
    p.add_argument("--attention-n", type=int, default=2**14, help="tokens of the measured attention run")
    args = p.parse_args()
    cfg = {"n": args.measured_n, "block": 64, "heads": 4, "heads_kv": 2, "head_dim": 64, "backend": "torch",
           "repeats": 3, "patterns": ["sliding_window", "causal", "bigbird"]}
    path = RESULTS / "context_parallel.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("machines", {"model": data.get("machine"), "measured": data.get("machine")})
    data.pop("machine", None)
    data["config"] = cfg
    if "model" in args.sections:
        data["model"] = model_rows(args.n, args.block, args.worlds, args.heads_q, args.heads_kv, args.head_dim)
        data["machines"]["model"] = _machine()
    if "steps" in args.sections:
        data["steps"] = step_rows(args)
        data["steps"]["machine_threads"] = torch.get_num_threads()
    if "measured" in args.sections:
        data["measured"] = measured_rows(cfg, [2, 4])
        data["machines"]["measured"] = _machine()
    missing = [name for name in SECTIONS if name not in data]
    if missing:
        raise SystemExit(f"no results for {missing}: run them (--sections {' '.join(missing)})")
    write(data, args)


if __name__ == "__main__":
    main()
