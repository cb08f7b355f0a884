"""Train a small character-level transformer LM with block-sparse causal attention, on CPU.

Attention is Sparse Transformer "strided" (Child et al. 2019): each query block reads a local
window of ``stride`` positions plus every ``stride``-th diagonal, built by
``sparse_io_attn.layout.patterns.strided`` and run by ``sparse_io_attn.nn.SparseSelfAttention``.

    python examples/train_char_lm.py                       # ~3-5 minutes on 2 CPU cores
    python examples/train_char_lm.py --steps 50 --eval-every 10   # a quick look

Prints the layout, a progress bar (tqdm if installed, plain lines otherwise), train/validation
loss in nats per character, and a sample generated from a prompt taken from the validation text.
``--attention dense`` trains the same model with dense masked attention over the same element
mask (the check used by ``tests/test_train_example.py``).
"""
from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from sparse_io_attn import patterns
from sparse_io_attn.nn import SparseSelfAttention
from sparse_io_attn.block_sparse.reference import element_mask, masked_attention

DATA = Path(__file__).parent / "data" / "sonnets.txt"


@dataclass
class Config:
    seq_len: int = 256
    block_size: int = 32     # attention block (BLOCK_SIZE_Q = BLOCK_SIZE_KV)
    stride: int = 64         # Sparse Transformer stride, in positions
    d_model: int = 96
    num_layers: int = 3
    num_heads: int = 4
    batch_size: int = 8
    lr: float = 3e-3
    steps: int = 1000
    seed: int = 0


class DenseMaskedSelfAttention(SparseSelfAttention):
    """Same layer and parameters, but attention is dense softmax over the layout's element mask
    (an ``N x N`` score matrix): the reference the block-sparse layer must reproduce."""

    def _attend(self, q, k, v, layout):
        B, H, N, D = q.shape
        mask = element_mask(layout, B, H, N, N, causal=self.causal, device=q.device)
        return masked_attention(q, k, v, mask, D ** -0.5)[0]


def strided_attention(cfg: Config, attention_cls=SparseSelfAttention) -> nn.Module:
    """The example's attention layer: causal Sparse Transformer "strided" pattern."""
    pattern = functools.partial(patterns.strided, block_size=cfg.block_size, stride=cfg.stride,
                                causal=True)
    return attention_cls(cfg.d_model, cfg.num_heads, pattern, causal=True)


class Block(nn.Module):
    def __init__(self, cfg: Config, make_attention: Callable[[Config], nn.Module]):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = make_attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Pre-norm decoder-only transformer over characters: ``[B, N]`` ids -> ``[B, N, vocab]`` logits.

    ``attention``: ``"sparse"`` (the strided layout), ``"dense"`` (dense softmax over the same
    element mask), or a callable ``cfg -> layer`` building each block's causal self-attention
    ``[B, N, d_model] -> [B, N, d_model]`` (``examples/train_dynamic_sparsity.py`` passes others)."""

    def __init__(self, vocab_size: int, cfg: Config, attention: str | Callable[[Config], nn.Module] = "sparse"):
        super().__init__()
        if callable(attention):
            make_attention = attention
        elif attention in ("sparse", "dense"):
            make_attention = strided_attention if attention == "sparse" else functools.partial(
                strided_attention, attention_cls=DenseMaskedSelfAttention)
        else:
            raise ValueError(f"attention must be 'sparse', 'dense' or a callable cfg -> attention layer, "
                             f"got {attention!r}")
        self.tok = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, make_attention) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Corpus:
    """The text as character ids, split 90 / 10 into train / validation."""

    def __init__(self, path: Path = DATA):
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.int64)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, batch_size: int, seq_len: int, gen: torch.Generator):
        data = self.train if split == "train" else self.val
        start = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        rows = start[:, None] + torch.arange(seq_len + 1)
        chunk = data[rows]
        return chunk[:, :-1], chunk[:, 1:]


def loss_fn(model: nn.Module, x, y) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(model: nn.Module, corpus: Corpus, cfg: Config, *, eval_every: int = 0, eval_batches: int = 4,
          progress: bool = False) -> dict:
    """AdamW with linear warm-up and cosine decay. Returns ``{"train": [loss per step],
    "val": [(step, loss)], "val_seconds": [training seconds at each evaluation], "seconds": float,
    "train_seconds": float}`` (losses in nats per character; ``seconds`` is the wall clock, the
    training seconds leave out the time spent evaluating)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)) * 0.9 + 0.1)
    history = {"train": [], "val": [], "val_seconds": []}
    eval_seconds = 0.0
    bar = progress_bar(cfg.steps) if progress else None
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        model.train()
        x, y = corpus.batch("train", cfg.batch_size, cfg.seq_len, gen)
        loss = loss_fn(model, x, y)
        optimizer_step(model, opt, sched, loss)
        history["train"].append(loss.item())
        val = None
        if eval_every and (step % eval_every == 0 or step == cfg.steps):
            t_eval = time.perf_counter()
            val = evaluate(model, corpus, cfg, eval_batches)
            history["val"].append((step, val))
            history["val_seconds"].append(t_eval - t0 - eval_seconds)
            eval_seconds += time.perf_counter() - t_eval
        report_step(bar, step, loss, val, t0)
    if bar is not None:
        bar.close()
    history["seconds"] = time.perf_counter() - t0
    history["train_seconds"] = history["seconds"] - eval_seconds
    return history


def optimizer_step(model: nn.Module, opt, sched, loss: torch.Tensor) -> None:
    """One optimiser step on ``loss`` (gradients clipped to norm 1), then the schedule's."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def report_step(bar, step: int, loss: torch.Tensor, val: float | None, t0: float) -> None:
    """The progress bar's step (``bar``: :func:`progress_bar`'s, None without tqdm) and, after an evaluation
    (``val``), the step's line (train and validation loss, seconds since ``t0``)."""
    if val is not None:
        msg = f"step {step:5d}  train {loss.item():.3f}  val {val:.3f}  ({time.perf_counter() - t0:.0f} s)"
        bar.write(msg) if bar is not None else print(msg, flush=True)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, cfg: Config, batches: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same validation windows every time
    return sum(loss_fn(model, *corpus.batch("val", cfg.batch_size, cfg.seq_len, gen)).item()
               for _ in range(batches)) / batches


@torch.no_grad()
def sample(model: nn.Module, corpus: Corpus, cfg: Config, length: int, temperature: float = 0.8,
           seed: int = 0) -> tuple[str, str]:
    """Continue a ``seq_len`` prompt from the validation text; every step runs the model on the last
    ``seq_len`` characters (one sequence length, so one cached layout). Returns (prompt, sample)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ctx = corpus.val[:cfg.seq_len].clone()
    out = []
    for _ in range(length):
        logits = model(ctx[None])[0, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        out.append(int(nxt))
        ctx = torch.cat([ctx[1:], nxt])
    return corpus.decode(corpus.val[:cfg.seq_len].tolist()), corpus.decode(out)


def progress_bar(total: int):
    """A tqdm bar of ``total`` steps, or None without tqdm (optional, the examples extra: eval lines only)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def run_arguments(p: argparse.ArgumentParser, eval_every: int) -> None:
    """The arguments every training example takes: ``--eval-every``, ``--sample-len``, ``--threads``, ``--data``."""
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--sample-len", type=int, default=300)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    p.add_argument("--data", type=Path, default=DATA)


def parse_run(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``p.parse_args(argv)``, with ``--threads`` applied."""
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, v in vars(Config()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--attention", choices=("sparse", "dense"), default="sparse")
    run_arguments(p, eval_every=50)
    args = parse_run(p, argv)
    cfg = Config(**{f: getattr(args, f) for f in vars(Config())})
    torch.manual_seed(cfg.seed)
    corpus = Corpus(args.data)
    model = CharLM(corpus.vocab_size, cfg, args.attention)
    layout = model.blocks[0].attn.layout_for(cfg.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"text {args.data.name}: {len(corpus.train)} train / {len(corpus.val)} val chars, "
          f"vocab {corpus.vocab_size}; model {n_params / 1e6:.2f} M params, {args.attention} attention, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(layout)
    print(f"uniform guess: {math.log(corpus.vocab_size):.3f} nats/char")
    hist = train(model, corpus, cfg, eval_every=args.eval_every, progress=True)
    print(f"trained {cfg.steps} steps in {hist['seconds']:.0f} s "
          f"({hist['seconds'] / cfg.steps * 1000:.0f} ms/step)")
    print("validation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in hist["val"]))
    if args.sample_len:
        prompt, text = sample(model, corpus, cfg, args.sample_len)
        print("---- prompt (last 80 chars) ----\n" + prompt[-80:])
        print("---- sample ----\n" + text)


if __name__ == "__main__":
    main()
