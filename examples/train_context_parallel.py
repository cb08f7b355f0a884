"""Train the character LM of ``train_char_lm.py`` with the sequence sharded over CPU processes
(context parallelism), and check that the losses equal single-process training step by step.

Each of ``--world-size`` gloo processes holds the tokens a :class:`ContextParallelPlan` assigns it,
with the key/value blocks of the same tokens. Embeddings, layer norms and MLPs run on the local
tokens; every attention layer is a :class:`~sparse_io_attn.distributed.ContextParallelSelfAttention`
around the model's own ``SparseSelfAttention``, which receives only the K/V blocks its rows read.
The loss of the local tokens is this rank's share of the mean; gradients are summed over the ranks,
so every rank takes the same optimizer step as one process would.

Two attentions (``--attention``):

* ``strided`` (default): the Sparse Transformer strided causal pattern, a layout known in advance:
  one static plan (query-block rows balanced by kept work, send sets fixed once);
* ``moba``: ``selector=nn.selectors.moba(block_size, top_k)``, a selection chosen from the
  activations in every layer at every step: a plan of the sequence length
  (``ContextParallelPlan.for_sequence``, zig-zag ownership), and each layer's step built from that
  step's selection (``plan.step``), so each rank receives exactly the blocks selected this step.
  The selector runs on the whole sequence's ``q`` and ``k`` (gathered detached: one ``all_gather``
  per layer), whatever it returns (a layout, or a per-token ``Selection``).

    python examples/train_context_parallel.py                      # 2 processes, 40 steps, ~1 minute
    python examples/train_context_parallel.py --attention moba     # the MoBA selector
    python examples/train_context_parallel.py --world-size 3 --steps 100

Prints both loss curves and their largest relative difference, the plan (bytes each rank receives
per layer against an all-gather), and writes ``results/context_parallel_training[_moba].csv``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_char_lm import CharLM, Config, Corpus, loss_fn, strided_attention  # noqa: E402

from sparse_io_attn.accounting import IOCounter  # noqa: E402
from sparse_io_attn.accounting.traffic import context_parallel  # noqa: E402
from sparse_io_attn.distributed import ContextParallelSelfAttention  # noqa: E402
from sparse_io_attn.distributed.traffic import FORWARD  # noqa: E402
from sparse_io_attn.nn import SparseSelfAttention, selectors  # noqa: E402

TIMEOUT_S = 300   # a hung rank fails the run instead of blocking it
ATTENTIONS = ("strided", "moba")
MOBA_TOP_K = 3    # key blocks per query block: its own and the 2 best-scoring earlier ones


def small_config(**kw) -> Config:
    """The model of the run: 2 layers, context 256 in blocks of 32, strided causal pattern."""
    return Config(**{**dict(seq_len=256, block_size=32, stride=64, d_model=64, num_layers=2, num_heads=4,
                            batch_size=4, lr=3e-3, steps=40, seed=0), **kw})


def moba_attention(cfg: Config) -> SparseSelfAttention:
    """The MoBA-selector layer: its own key block and the best-scoring earlier ones, chosen at every
    forward from the layer's ``q`` and ``k``."""
    return SparseSelfAttention(cfg.d_model, cfg.num_heads, selector=selectors.moba(cfg.block_size, MOBA_TOP_K),
                               causal=True)


def _model(corpus: Corpus, cfg: Config, attention: str = "strided") -> CharLM:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    torch.manual_seed(cfg.seed)
    model = CharLM(corpus.vocab_size, cfg, strided_attention if attention == "strided" else moba_attention)
    for block in model.blocks:
        block.attn.backend = "cpu"
    return model


def _batches(corpus: Corpus, cfg: Config):
    gen = torch.Generator().manual_seed(cfg.seed + 1)          # the same data order on every rank
    return [corpus.batch("train", cfg.batch_size, cfg.seq_len, gen) for _ in range(cfg.steps)]


def train_single(corpus: Corpus, cfg: Config, attention: str = "strided") -> list[float]:
    """One process, the whole sequence: the loss of every step."""
    model = _model(corpus, cfg, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    for x, y in _batches(corpus, cfg):
        loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def local_logits(model: CharLM, attention: list[ContextParallelSelfAttention], ids, positions):
    """``CharLM.forward`` on this rank's tokens: the same modules, attention through the wrappers."""
    x = model.tok(ids) + model.pos(positions)
    for block, attn in zip(model.blocks, attention):
        x = x + attn(block.ln1(x))
        x = x + block.mlp(block.ln2(x))
    return model.head(model.ln_f(x))


def train_rank(rank: int, world: int, corpus: Corpus, cfg: Config, attention: str = "strided") -> dict:
    """This rank's part of context-parallel training (``torch.distributed`` initialised): the loss of
    every step (summed over ranks: the whole batch's mean), and the attention's K/V bytes it received
    (for ``moba``: each step's, which change with the selection)."""
    model = _model(corpus, cfg, attention)
    plan = ContextParallelSelfAttention.plan_for(model.blocks[0].attn, cfg.seq_len, world)
    attention = [ContextParallelSelfAttention(block.attn, plan) for block in model.blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    positions = plan.token_index(rank)
    losses, received = [], []
    for x, y in _batches(corpus, cfg):
        x, y = plan.shard(x, rank, 1), plan.shard(y, rank, 1)
        with IOCounter() as io:
            logits = local_logits(model, attention, x, positions)
        forward = io.network.kernels.get(FORWARD)
        received.append(forward.bytes_read if forward is not None else 0)  # K/V over all layers
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           reduction="sum") / (cfg.batch_size * cfg.seq_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():          # the whole sequence's gradient, on every rank
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return {"losses": losses, "imbalance": plan.imbalance, "rows": [len(plan.rows(r)) for r in range(world)],
            "received": received}


def _worker(rank: int, world: int, port: int, cfg: dict, out: str, attentions: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        result = {name: train_rank(rank, world, Corpus(), Config(**cfg), name) for name in attentions}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_context_parallel(cfg: Config, world: int, attention: str | tuple = "strided") -> dict:
    """Spawn ``world`` gloo processes running :func:`train_rank`; rank 0's result (raises if a rank
    fails or the run exceeds the timeout). ``attention``: one of :data:`ATTENTIONS`, or a tuple of
    them trained one after the other by the same processes (then ``{attention: result}``)."""
    names = (attention,) if isinstance(attention, str) else tuple(attention)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.spawn(_worker, args=(world, _free_port(), cfg.__dict__, out, names), nprocs=world, join=False)
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError(f"context-parallel workers did not finish within {TIMEOUT_S} s")
        result = json.loads(Path(out).read_text())
    return result[attention] if isinstance(attention, str) else result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--attention", choices=ATTENTIONS, default="strided")
    ap.add_argument("--out", default=None, help="CSV of the losses (default results/context_parallel_training"
                                                "[_moba].csv)")
    args = ap.parse_args(argv)
    name = "context_parallel_training" + ("" if args.attention == "strided" else "_moba") + ".csv"
    out = args.out or str(Path(__file__).parent / "results" / name)
    cfg = small_config(steps=args.steps)
    corpus = Corpus()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    single = train_single(corpus, cfg, args.attention)
    t1 = time.perf_counter()
    cp = train_context_parallel(cfg, args.world_size, args.attention)
    t2 = time.perf_counter()
    model = _model(corpus, cfg, args.attention)
    plan = ContextParallelSelfAttention.plan_for(model.blocks[0].attn, cfg.seq_len, args.world_size)
    diff = max(abs(a - b) / abs(a) for a, b in zip(single, cp["losses"]))
    print(f"{plan}\nquery-block rows per rank {cp['rows']}")
    token = cfg.d_model // cfg.num_heads * 4 * 2 * cfg.batch_size * cfg.num_heads      # fp32 K and V, all heads
    gathered = cfg.num_layers * token * (cfg.seq_len - plan.num_tokens(0))
    if plan.is_static:
        net = context_parallel(plan, batch=cfg.batch_size, num_heads_kv=cfg.num_heads,
                               head_dim=cfg.d_model // cfg.num_heads, dtype=torch.float32)
        print(f"K/V bytes received per rank and layer, forward: {list(net.recv)} (the floor: {list(net.floor)}; "
              f"an all-gather: {list(net.all_gather)})")
    else:
        got = cp["received"]
        print(f"K/V bytes rank 0 received per step over {cfg.num_layers} layers, forward (each step's selection): "
              f"min {min(got)}, mean {sum(got) / len(got):.0f}, max {max(got)}; an all-gather: {gathered}")
    print(f"{'step':>5} {'1 process':>10} {f'{args.world_size} ranks':>10}")
    for i in sorted(set(range(0, len(single), max(1, len(single) // 8))) | {len(single) - 1}):
        print(f"{i + 1:>5} {single[i]:>10.5f} {cp['losses'][i]:>10.5f}")
    print(f"largest relative loss difference over {len(single)} steps: {diff:.2e}; "
          f"time {t1 - t0:.1f} s (1 process) / {t2 - t1:.1f} s ({args.world_size} processes, incl. start-up)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_single_process", f"loss_{args.world_size}_ranks"])
        w.writerows((i + 1, f"{a:.7f}", f"{b:.7f}") for i, (a, b) in enumerate(zip(single, cp["losses"])))


if __name__ == "__main__":
    main()
