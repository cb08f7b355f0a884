"""Train a small Hugging Face Llama from scratch with block-sparse attention, on CPU, then generate.

The model is ``transformers.LlamaForCausalLM`` built from a config (no download: random init, a
character vocabulary) with ``attn_implementation="sparse_io_attn"`` from
:mod:`sparse_io_attn.integrations.transformers`; the pattern is a spec on the config::

    config.sparse_attention = {"pattern": "strided:stride=64,causal", "block_size": 32}

intersected with the model's causality (Sparse Transformer "strided", like ``train_char_lm.py``).
The text is the bundled sonnets, character-level, with the data pipeline of ``train_char_lm.py``.

    python examples/train_hf_llama.py                      # 300 steps, a few minutes on 2 CPU cores
    python examples/train_hf_llama.py --steps 30 --sample-len 100        # a quick look
    python examples/train_hf_llama.py --attn-implementation sdpa         # same model, dense attention

Prints the layout, validation loss (nats per character) before and after training, a progress bar
(tqdm if installed), the time per step, and a sample from ``model.generate()`` (KV cache: the
prompt is prefilled with the block-sparse kernels, each new token reads its layout row).
Needs the ``hf`` extra (``pip install "sparse-io-attn[hf]"``).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
# train_char_lm's text, split and batches, training step, progress line and run arguments
from train_char_lm import Corpus, optimizer_step, parse_run, progress_bar, report_step, run_arguments  # noqa: E402

from sparse_io_attn.block_sparse.api import BACKENDS, resolve_backend  # noqa: E402
from sparse_io_attn.integrations import transformers as sia_hf  # noqa: E402


def build_model(vocab_size: int, args) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    sia_hf.register()  # attn_implementation "sparse_io_attn"
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len * 2, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attention_dropout=0.0,
        sparse_attention={"pattern": args.pattern, "block_size": args.block_size, "backend": args.backend},
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation)


def loss_fn(model, x, y) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, corpus: Corpus, args, batches: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same validation windows every time
    return sum(loss_fn(model, *corpus.batch("val", args.batch_size, args.seq_len, gen)).item()
               for _ in range(batches)) / batches


def train(model, corpus: Corpus, args) -> dict:
    """AdamW, linear warm-up and cosine decay; returns train losses, (step, val) pairs and seconds."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    hist = {"train": [], "val": []}
    bar = progress_bar(args.steps)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        loss = loss_fn(model, *corpus.batch("train", args.batch_size, args.seq_len, gen))
        optimizer_step(model, opt, sched, loss)
        hist["train"].append(loss.item())
        val = None
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            val = evaluate(model, corpus, args)
            hist["val"].append((step, val))
        report_step(bar, step, loss, val, t0)
    if bar is not None:
        bar.close()
    hist["seconds"] = time.perf_counter() - t0
    return hist


@torch.no_grad()
def sample(model, corpus: Corpus, args) -> tuple[str, str]:
    """Continue the first ``seq_len // 2`` validation characters with ``model.generate()``."""
    model.eval()
    prompt = corpus.val[: args.seq_len // 2][None]
    torch.manual_seed(args.seed)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.sample_len,
                         do_sample=True, temperature=0.8, top_k=0, top_p=1.0, pad_token_id=0)
    return corpus.decode(prompt[0].tolist()), corpus.decode(out[0, prompt.shape[1]:].tolist())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--pattern", default="strided:stride=64,causal", help="a sparse_io_attn pattern spec")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="block-sparse backend (auto: the library default for the device)")
    p.add_argument("--attn-implementation", default=sia_hf.DEFAULT_NAME,
                   help="sparse_io_attn (default), or sdpa/eager for a dense baseline")
    p.add_argument("--seed", type=int, default=0)
    run_arguments(p, eval_every=100)
    args = parse_run(p, argv)
    import transformers

    torch.manual_seed(args.seed)
    corpus = Corpus(args.data)
    model = build_model(corpus.vocab_size, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"text {args.data.name}: {len(corpus.train)} train / {len(corpus.val)} val chars, vocab "
          f"{corpus.vocab_size}; {type(model).__name__} {n_params / 1e6:.2f} M params ({args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv heads), attn_implementation="
          f"{model.config._attn_implementation!r}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads")
    if model.config._attn_implementation == sia_hf.DEFAULT_NAME:
        layout = sia_hf.pattern_layout(model.config, args.seq_len)
        print(f"config.sparse_attention = {model.config.sparse_attention}  (intersected with causality; "
              f"backend {args.backend!r} -> {resolve_backend(args.backend, torch.device('cpu'))!r})")
        print(layout if layout is not None else "dense")
    print(f"uniform guess: {math.log(corpus.vocab_size):.3f} nats/char")
    before = evaluate(model, corpus, args)
    print(f"validation loss before training: {before:.3f}")
    hist = train(model, corpus, args)
    after = evaluate(model, corpus, args)
    hist["val"].append((args.steps, after))
    hist["before"], hist["after"] = before, after
    print(f"trained {args.steps} steps in {hist['seconds']:.0f} s ({hist['seconds'] / args.steps * 1000:.0f} ms/step)")
    print(f"validation loss: before {before:.3f}, after {after:.3f} nats/char")
    if args.sample_len:
        t0 = time.perf_counter()
        prompt, text = sample(model, corpus, args)
        print(f"---- prompt (last 80 of {len(prompt)} chars) ----\n" + prompt[-80:])
        print(f"---- generate(): {args.sample_len} chars in {time.perf_counter() - t0:.1f} s ----\n" + text)
    return hist


if __name__ == "__main__":
    main()
