"""Train the character LM of ``train_char_lm.py`` with six attention layouts and selectors: dense causal
attention, a static block sliding window, this library's pooled block top-k, exact MoBA, NSA's block
selection alone, and the full NSA layer.

The runs share everything but the attention: the model (``train_char_lm.CharLM``, initialised from
one seed), the data order, the optimiser and schedule (``train_char_lm.train``), the steps, and one
attention backend (``--backend``, ``"torch"`` by default: the portable path that every method has, so
that step times compare methods under one implementation). Every sparse method reads at most
``top_k`` key blocks of ``block_size`` keys per query (the own block included):

* ``dense``:       ``patterns.causal``, every block on or below the diagonal (the baseline);
* ``window``:      a static banded block mask, each query block reads its own block and the
                   ``top_k - 1`` before it (``BlockSparseLayout.from_block_mask``);
* ``pooled_topk``: ``selectors.pooled_topk(block_size, top_k)``: per query block and KV head, its
                   own block and the ``top_k - 1`` earlier blocks whose mean-pooled keys score
                   highest against the block's mean-pooled queries (this library's rule);
* ``moba``:        ``selectors.moba(block_size, top_k)``: exact MoBA, per query token and head, the
                   own chunk and the ``top_k - 1`` past chunks of highest ``q . mean(k)``;
* ``nsa_select``:  ``selectors.nsa(block_size, top_k)``: NSA's block selection (fla's
                   ``naive_nsa_topk``: blocks 0, own - 1 and own forced, the rest by the scaled
                   group-mean softmax over complete blocks) as the only branch;
* ``nsa``:         ``nn.NativeSparseAttention`` (fla's layer: its own projections, RoPE and sigmoid
                   gates mixing the selected branch, ``top_k`` blocks, a sliding window of
                   ``block_size`` keys and the compressed branch over the mean-pooled complete
                   blocks; like fla's layer it selects ``top_k`` rounded up to a power of two).
                   Its parameters differ from the others' (no biases, ``g_proj``), so it
                   starts from its own initialisation of the same seed, and it reads more keys per
                   query (window and compressed keys on top of its ``top_k`` blocks).

The first five are ``nn.SparseSelfAttention`` layers with identical parameters, so one seed gives
them identical initial models; ``window``, ``pooled_topk``, ``moba`` and ``nsa_select`` keep the same
number of key blocks per query (``min(top_k, own block + 1)``), only which blocks differs.

    python examples/train_dynamic_sparsity.py                 # about 5 minutes on 2 shared CPU cores
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

from sparse_io_attn import BlockSparseLayout, Selection, patterns
from sparse_io_attn.nn import NativeSparseAttention, SparseSelfAttention, selectors

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

METHODS = ("dense", "window", "pooled_topk", "moba", "nsa_select", "nsa")
#: the sparse methods whose layer chooses per forward (a selector or NSA's own selection)
SELECTORS = {"pooled_topk": selectors.pooled_topk, "moba": selectors.moba, "nsa_select": selectors.nsa}
# train_char_lm.py's model and batch; context 256 in blocks of 16: 16 key blocks per row, of which
# top_k 4 keeps a quarter at most (a window of 49-64 characters, about a line of a sonnet). 250 steps
# (the three-method version ran 700): six methods on the portable backend in a few minutes.
DEFAULTS = Config(seq_len=256, block_size=16, d_model=96, num_layers=3, num_heads=4, batch_size=8,
                  lr=3e-3, steps=250, seed=0)
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


def attention_factory(method: str, top_k: int, backend: str = "torch"):
    """``cfg -> attention layer`` for one of :data:`METHODS` (``CharLM``'s ``attention=``). Every
    method but ``nsa`` is a ``SparseSelfAttention`` with the same parameters, so one seed gives those
    models the same initialisation."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def make(cfg: Config) -> nn.Module:
        if method == "nsa":
            return NativeSparseAttention(cfg.d_model, cfg.num_heads, cfg.num_heads, block_size=cfg.block_size,
                                         num_blocks=top_k, window=cfg.block_size, backend=backend,
                                         layout_block_size=cfg.block_size)
        if method in SELECTORS:
            return SparseSelfAttention(cfg.d_model, cfg.num_heads, selector=SELECTORS[method](cfg.block_size, top_k),
                                       causal=True, backend=backend)
        pattern = (functools.partial(patterns.causal, block_size=cfg.block_size) if method == "dense"
                   else functools.partial(block_window, block_size=cfg.block_size, top_k=top_k))
        return SparseSelfAttention(cfg.d_model, cfg.num_heads, pattern, causal=True, backend=backend)
    return make


def build_model(method: str, vocab_size: int, cfg: Config, top_k: int, backend: str = "torch") -> nn.Module:
    torch.manual_seed(cfg.seed)
    return char_lm.CharLM(vocab_size, cfg, attention_factory(method, top_k, backend))


@torch.no_grad()
def kept_blocks_per_query(model: nn.Module, x: torch.Tensor) -> float:
    """Mean key blocks per query of the first layer's attention on ids ``x [B, N]``: for a layout the
    kept blocks of each query-block row (over rows, heads and batch), for a per-token selection the
    distinct causally alive blocks of each (token, selection) (``nsa``: its selected branch only)."""
    attn = model.blocks[0].attn
    if isinstance(attn, SparseSelfAttention) and attn.selector is None:
        return attn.layout_for(x.shape[1]).to_block_mask().sum(-1).double().mean().item()
    h = model.blocks[0].ln1(model.tok(x) + model.pos(torch.arange(x.shape[1])))
    if isinstance(attn, NativeSparseAttention):
        q, k, _, _ = attn.project(h)
        chosen = attn.selector(q, k)
    else:
        q, k, _ = attn.project(h)
        chosen = attn.selector(q, k)
    if isinstance(chosen, BlockSparseLayout):
        return chosen.to_block_mask().sum(-1).double().mean().item()
    return selected_blocks_per_query(chosen, x.shape[1])


def selected_blocks_per_query(selection: Selection, seqlen: int) -> float:
    """Mean distinct valid blocks per (token, selection) of a causal self-attention selection."""
    idx = selection.indices.to(torch.int64)
    t = torch.arange(seqlen)[:, None]
    valid = (idx >= 0) & (idx * selection.block_size <= t)
    first = torch.ones_like(valid)
    ordered = torch.sort(torch.where(valid, idx, -1), -1).values
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    return ((ordered >= 0) & first).sum(-1).double().mean().item()


def run(method: str, corpus, cfg: Config, *, top_k: int, eval_every: int, eval_batches: int,
        backend: str = "torch", progress: bool = False) -> dict:
    """Train one method. Returns ``{"method", "rows": [(step, train_loss, val_loss, elapsed_s)],
    "train_seconds", "ms_per_step", "tokens_per_s", "kept_per_row", "final_val"}``; row 0 is the validation loss
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
            "ms_per_step": 1000 * hist["train_seconds"] / cfg.steps,
            "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / hist["train_seconds"],
            "kept_per_row": kept_blocks_per_query(model, x), "final_val": rows[-1][2],
            "params": sum(p.numel() for p in model.parameters())}


def machine() -> dict:
    load = os.getloadavg()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "nproc": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load": " ".join(f"{x:.2f}" for x in load),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def summary_table(results: list[dict], num_blocks: int) -> str:
    lines = ["| method | params | key blocks per query (of %d) | final val loss (nats/char) | best val loss | "
             "train s | ms/step | tokens/s |" % num_blocks,
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = min(v for _, _, v, _ in r["rows"])
        lines.append(f"| {r['method']} | {r['params']:,} | {r['kept_per_row']:.3f} | {r['final_val']:.4f} | "
                     f"{best:.4f} | {r['train_seconds']:.1f} | {r['ms_per_step']:.0f} | {r['tokens_per_s']:.0f} |")
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
                                               f"blocks per query, final {r['final_val']:.3f}")
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
    p.add_argument("--top-k", type=int, default=4, help="key blocks per query (the sparse methods)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--backend", default="torch", help="attention backend of every method")
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
        f"# Dense, window, pooled top-k, exact MoBA, NSA selection and the NSA layer\n\n"
        f"`{cmd.strip()}`\n\n"
        f"- machine: 2-core development VM shared with other jobs; nproc {before['nproc']}, "
        f"torch {before['torch']}, {before['threads']} torch threads, fp32\n"
        f"- started {before['date']}, finished {after['date']}\n"
        f"- `uptime` before: `{before['uptime']}`\n"
        f"- `uptime` after: `{after['uptime']}`\n"
        f"- {header}\n\n"
        f"Validation loss: mean over {args.eval_batches} fixed validation batches; key blocks per query: mean over "
        f"the queries (query-block rows for a layout; tokens and heads for a per-token selection; for nsa its "
        f"selected branch only, which its {cfg.block_size}-key window and compressed keys come on top of) of the "
        f"first layer on one validation batch; train s, ms/step and tokens/s: training only (evaluations left "
        f"out), on a shared machine whose load is below.\n\n"
        f"## Final validation loss and step time (load average {before['load']} before, {after['load']} after, "
        f"2 cores)\n\n"
        f"{table}\n")
    print(f"wrote {args.out}/dynamic_sparsity.{{csv,png,md}}")


if __name__ == "__main__":
    main()
