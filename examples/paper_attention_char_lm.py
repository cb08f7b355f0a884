"""Train the character LM of ``train_char_lm.py`` with ``sparse_io_attn.nn.PaperAttention`` (the
paper's form: per-head ``X = W_Q W_K^T`` and ``Y = W_V W_O`` trained directly, block-sparse on
patterns magnitude-pruned once from the initialisation) against dense multi-head attention of the
same width, for the same steps, data order and seed, on CPU.

    python examples/paper_attention_char_lm.py              # ~2-3 minutes on 2 cores, both models
    python examples/paper_attention_char_lm.py --steps 40 --eval-every 20   # a quick look

Writes ``examples/results/paper_attention.csv``: per evaluation step the validation loss (nats per
character) of both models and each run's training throughput (tokens/s over the whole run,
evaluation included), under ``#`` lines recording the machine and configuration.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from train_char_lm import Config, Corpus, train  # noqa: E402  (examples/ on sys.path)

from sparse_io_attn import patterns  # noqa: E402
from sparse_io_attn.nn import PaperAttention  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "paper_attention.csv"


@dataclass
class Settings:
    seq_len: int = 128
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    batch_size: int = 8
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    block: int = 16          # block of the X / Y patterns and of the causal QK layout
    x_density: float = 0.5   # fraction of X's blocks kept per head
    y_density: float = 0.5   # fraction of Y's blocks kept per head


class DenseCausalAttention(nn.Module):
    """Standard multi-head causal self-attention of the same width (``q/k/v/out`` projections)."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.h = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x):
        B, N, E = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, E // self.h).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, N, E))


class Block(nn.Module):
    def __init__(self, s: Settings, attention: str, generator: torch.Generator):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(s.d_model), nn.LayerNorm(s.d_model)
        if attention == "paper":
            causal = functools.partial(patterns.causal, block_size=s.block)
            self.attn = PaperAttention(s.d_model, s.num_heads, x_pattern=s.x_density, y_pattern=s.y_density,
                                       qk_pattern=causal, block_size=s.block, backend="torch", generator=generator)
        else:
            self.attn = DenseCausalAttention(s.d_model, s.num_heads)
        self.mlp = nn.Sequential(nn.Linear(s.d_model, 4 * s.d_model), nn.GELU(), nn.Linear(4 * s.d_model, s.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, s: Settings, attention: str):
        super().__init__()
        g = torch.Generator().manual_seed(s.seed)
        self.tok, self.pos = nn.Embedding(vocab, s.d_model), nn.Embedding(s.seq_len, s.d_model)
        self.blocks = nn.ModuleList(Block(s, attention, g) for _ in range(s.num_layers))
        self.ln_f, self.head = nn.LayerNorm(s.d_model), nn.Linear(s.d_model, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def run(attention: str, s: Settings, corpus: Corpus, eval_every: int) -> tuple[dict, int]:
    torch.manual_seed(s.seed)
    model = LM(corpus.vocab_size, s, attention)
    cfg = Config(seq_len=s.seq_len, d_model=s.d_model, num_layers=s.num_layers, num_heads=s.num_heads,
                 batch_size=s.batch_size, lr=s.lr, steps=s.steps, seed=s.seed)
    hist = train(model, corpus, cfg, eval_every=eval_every)
    return hist, sum(p.numel() for p in model.parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, v in asdict(Settings()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = Settings(**{f: getattr(args, f) for f in asdict(Settings())})
    corpus = Corpus()
    load0 = os.getloadavg()[0]
    results = {}
    for attention in ("paper", "dense"):
        hist, n_params = run(attention, s, corpus, args.eval_every)
        tok_s = s.steps * s.batch_size * s.seq_len / hist["seconds"]
        results[attention] = (dict(hist["val"]), tok_s, n_params, hist["seconds"])
        print(f"{attention}: {n_params} params, {hist['seconds']:.1f} s, {tok_s:.0f} tokens/s, val "
              + ", ".join(f"{k}: {v:.3f}" for k, v in hist["val"]), flush=True)
    load1 = os.getloadavg()[0]
    lines = [f"# 2-core dev VM, nproc {os.cpu_count()}, torch threads {args.threads}, torch {torch.__version__}, "
             f"load average {load0:.2f} -> {load1:.2f}",
             f"# {asdict(s)}; uniform guess {math.log(corpus.vocab_size):.3f} nats/char",
             f"# params: paper {results['paper'][2]}, dense {results['dense'][2]}; seconds: paper "
             f"{results['paper'][3]:.1f}, dense {results['dense'][3]:.1f}",
             "step,val_loss_paper,val_loss_dense,tokens_per_s_paper,tokens_per_s_dense"]
    for step in results["paper"][0]:
        lines.append(f"{step},{results['paper'][0][step]:.4f},{results['dense'][0][step]:.4f},"
                     f"{results['paper'][1]:.0f},{results['dense'][1]:.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
