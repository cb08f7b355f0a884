"""Train the character LM of ``train_char_lm.py`` three ways: dense causal attention, a static
block sliding window, and a MoBA-style selection chosen from the activations at every forward.

The three runs share everything but the attention layout: the model (``train_char_lm.CharLM``,
initialised from one seed, so the three start from identical parameters), the data order, the
optimiser and schedule (``train_char_lm.train``), and the attention kernel
(``sparse_io_attn.nn.SparseSelfAttention`` on the ``"cpu"`` backend, the fused C++ kernel):

* ``dense``:  ``patterns.causal``, every block on or below the diagonal (the dense causal baseline
  run by the same block-sparse kernel, so the tokens/s compare kernels under one implementation);
* ``window``: a static banded block mask, each query block reads its own block and the
  ``top_k - 1`` blocks before it (``BlockSparseLayout.from_block_mask``, ``causal=True`` at the call);
* ``moba``:   ``SparseSelfAttention(..., selector=selectors.moba(block_size, top_k), causal=True)``:
  its own block and the ``top_k - 1`` earlier key blocks whose mean-pooled keys score highest
  against the query block's mean-pooled queries, per head, chosen at every forward.

``window`` and ``moba`` keep exactly the same number of blocks in every query-block row
(``min(top_k, row + 1)``), so they cost the same; only which blocks differs.

    python examples/train_dynamic_sparsity.py                 # ~12 minutes on 2 shared CPU cores
    python examples/train_dynamic_sparsity.py --steps 40 --eval-every 20 --out /tmp/dyn   # a quick look

Writes ``<out>/dynamic_sparsity.csv`` (step, method, train_loss, val_loss, elapsed_s),
``dynamic_sparsity.png`` (validation loss against step) and ``dynamic_sparsity.md`` (machine
header and the summary table that is also printed).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn.nn import SparseSelfAttention, selectors

_HERE = Path(__file__).resolve().parent


def _load_char_lm():
    """``examples/train_char_lm.py`` as a module (the examples are scripts, not a package)."""
    if "train_char_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_char_lm", _HERE / "train_char_lm.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_char_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_char_lm"]


char_lm = _load_char_lm()
Config = char_lm.Config

METHODS = ("dense", "window", "moba")
# train_char_lm.py's model and batch; context 256 in blocks of 16: 16 key blocks per row, of which
# top_k 4 keeps a quarter at most (a window of 49-64 characters, about a line of a sonnet)
DEFAULTS = Config(seq_len=256, block_size=16, d_model=96, num_layers=3, num_heads=4, batch_size=8,
                  lr=3e-3, steps=700, seed=0)
_FIELDS = ("seq_len", "block_size", "d_model", "num_layers", "num_heads", "batch_size", "lr", "steps", "seed")
RESULTS = _HERE / "results"


def block_window(seqlen: int, block_size: int, top_k: int) -> BlockSparseLayout:
    """Static causal block window: query block ``r`` keeps key blocks ``r - top_k + 1 .. r`` (its own
    and the ``top_k - 1`` before it; fewer near the start), every block full. Use it with
    ``causal=True`` at the call, which masks the diagonal block's future elements."""
    m = math.ceil(seqlen / block_size)
    d = torch.arange(m)[:, None] - torch.arange(m)[None, :]
    return BlockSparseLayout.from_block_mask((d >= 0) & (d < top_k), block_size, seqlen,
                                             name=f"block_window(top_k={top_k})")


def attention_factory(method: str, top_k: int, backend: str = "cpu"):
    """``cfg -> SparseSelfAttention`` for one of :data:`METHODS` (``CharLM``'s ``attention=``). Every
    method has the same parameters, so one seed gives the three models the same initialisation."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def make(cfg: Config) -> nn.Module:
        if method == "moba":
            return SparseSelfAttention(cfg.d_model, cfg.num_heads, selector=selectors.moba(cfg.block_size, top_k),
                                       causal=True, backend=backend)
        pattern = (functools.partial(patterns.causal, block_size=cfg.block_size) if method == "dense"
                   else functools.partial(block_window, block_size=cfg.block_size, top_k=top_k))
        return SparseSelfAttention(cfg.d_model, cfg.num_heads, pattern, causal=True, backend=backend)
    return make


def build_model(method: str, vocab_size: int, cfg: Config, top_k: int, backend: str = "cpu") -> nn.Module:
    torch.manual_seed(cfg.seed)
    return char_lm.CharLM(vocab_size, cfg, attention_factory(method, top_k, backend))


@torch.no_grad()
def kept_blocks_per_row(model: nn.Module, x: torch.Tensor) -> float:
    """Mean kept key blocks per query-block row of the first layer's attention on ids ``x [B, N]``
    (for ``moba`` the layout selected from these activations)."""
    attn = model.blocks[0].attn
    if attn.selector is None:
        layout = attn.layout_for(x.shape[1])
    else:
        h = model.blocks[0].ln1(model.tok(x) + model.pos(torch.arange(x.shape[1])))
        B, N, _ = h.shape
        q = attn.q_proj(h).view(B, N, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, N, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        layout = attn.selector(q, k)
    return layout.to_block_mask().sum(-1).double().mean().item()


def run(method: str, corpus, cfg: Config, *, top_k: int, eval_every: int, eval_batches: int,
        backend: str = "cpu", progress: bool = False) -> dict:
    """Train one method. Returns ``{"method", "rows": [(step, train_loss, val_loss, elapsed_s)],
    "train_seconds", "tokens_per_s", "kept_per_row", "final_val"}``; row 0 is the validation loss
    before training (no train loss), ``train_loss`` at an evaluation is the mean over the steps
    since the previous one, ``elapsed_s`` the training seconds so far (evaluations left out)."""
    model = build_model(method, corpus.vocab_size, cfg, top_k, backend)
    val0 = char_lm.evaluate(model, corpus, cfg, eval_batches)
    hist = char_lm.train(model, corpus, cfg, eval_every=eval_every, eval_batches=eval_batches, progress=progress)
    rows, prev = [(0, math.nan, val0, 0.0)], 0
    for (step, val), secs in zip(hist["val"], hist["val_seconds"]):
        seg = hist["train"][prev:step]
        rows.append((step, sum(seg) / len(seg), val, secs))
        prev = step
    x, _ = corpus.batch("val", cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(1234))
    return {"method": method, "rows": rows, "train": hist["train"], "train_seconds": hist["train_seconds"],
            "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / hist["train_seconds"],
            "kept_per_row": kept_blocks_per_row(model, x), "final_val": rows[-1][2]}


def machine() -> dict:
    load = os.getloadavg()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "nproc": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load": " ".join(f"{x:.2f}" for x in load),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def summary_table(results: list[dict], num_blocks: int) -> str:
    lines = ["| method | kept blocks per row (of %d) | kept fraction | final val loss (nats/char) | "
             "best val loss | train s | tokens/s |" % num_blocks,
             "|---|---|---|---|---|---|---|"]
    for r in results:
        best = min(v for _, _, v, _ in r["rows"])
        lines.append(f"| {r['method']} | {r['kept_per_row']:.3f} | {r['kept_per_row'] / num_blocks:.1%} | "
                     f"{r['final_val']:.4f} | {best:.4f} | {r['train_seconds']:.1f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def write_csv(path: Path, results: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "method", "train_loss", "val_loss", "elapsed_s"])
        for r in results:
            for step, tr, val, secs in r["rows"]:
                w.writerow([step, r["method"], "" if math.isnan(tr) else f"{tr:.5f}", f"{val:.5f}", f"{secs:.2f}"])


def plot(path: Path, results: list[dict], num_blocks: int, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        steps = [s for s, *_ in r["rows"]]
        vals = [v for _, _, v, _ in r["rows"]]
        ax.plot(steps, vals, marker=".", label=f"{r['method']}: {r['kept_per_row']:.2f} of {num_blocks} "
                                               f"blocks per row ({r['kept_per_row'] / num_blocks:.0%})")
    lo = min(v for r in results for _, _, v, _ in r["rows"][1:]) if any(len(r["rows"]) > 1 for r in results) else None
    if lo is not None:
        ax.set_ylim(lo - 0.05, min(3.0, max(r["rows"][1][2] for r in results if len(r["rows"]) > 1) + 0.1))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in _FIELDS:
        v = getattr(DEFAULTS, f)
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--top-k", type=int, default=4, help="key blocks per query-block row (window and moba)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: PyTorch's default)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(DEFAULTS, **{f: getattr(args, f) for f in _FIELDS})
    corpus = char_lm.Corpus()
    num_blocks = math.ceil(cfg.seq_len / cfg.block_size)
    before = machine()
    n_params = sum(q.numel() for q in build_model("dense", corpus.vocab_size, cfg, args.top_k).parameters())
    header = (f"text sonnets.txt: {len(corpus.train)} train / {len(corpus.val)} val chars, vocab {corpus.vocab_size}; "
              f"model {n_params / 1e6:.3f} M params ({cfg.num_layers} layers, d_model {cfg.d_model}, "
              f"{cfg.num_heads} heads), context {cfg.seq_len} in blocks of {cfg.block_size} ({num_blocks} per row), "
              f"top_k {args.top_k}; batch {cfg.batch_size}, {cfg.steps} steps, lr {cfg.lr}, seed {cfg.seed}; "
              f"backend {args.backend!r}")
    print(header)
    print(f"machine: {before['date']}, nproc {before['nproc']}, torch {before['torch']}, "
          f"{before['threads']} threads, load average before: {before['load']}")
    results = []
    for method in args.methods:
        print(f"== {method}", flush=True)
        results.append(run(method, corpus, cfg, top_k=args.top_k, eval_every=args.eval_every,
                           eval_batches=args.eval_batches, backend=args.backend, progress=True))
    after = machine()
    table = summary_table(results, num_blocks)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "dynamic_sparsity.csv", results)
    plot(args.out / "dynamic_sparsity.png", results, num_blocks,
         f"char LM, context {cfg.seq_len}, blocks of {cfg.block_size}, top_k {args.top_k}, {cfg.steps} steps")
    cmd = "python examples/train_dynamic_sparsity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "dynamic_sparsity.md").write_text(
        f"# Dense causal vs. static block window vs. MoBA-style selection\n\n"
        f"`{cmd.strip()}`\n\n"
        f"- machine: 2-core development VM shared with other jobs; nproc {before['nproc']}, "
        f"torch {before['torch']}, {before['threads']} torch threads, fp32\n"
        f"- started {before['date']}, finished {after['date']}\n"
        f"- `uptime` before: `{before['uptime']}`\n"
        f"- `uptime` after: `{after['uptime']}`\n"
        f"- {header}\n\n"
        f"Validation loss: mean over {args.eval_batches} fixed validation batches; kept blocks per row: mean over "
        f"the {num_blocks} query-block rows (and for moba the heads and batch of one validation batch) of "
        f"the first layer; tokens/s: training tokens over training seconds (evaluations left out).\n\n"
        f"{table}\n")
    print(f"wrote {args.out}/dynamic_sparsity.{{csv,png,md}}")


if __name__ == "__main__":
    main()
