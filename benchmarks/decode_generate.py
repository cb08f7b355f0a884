"""``model.generate()`` per-token time with a long prompt (issue 38, item 4): a small random Llama
(2 layers, hidden 512, 8 query / 2 KV heads, head dim 64) in fp32 on CPU, greedy decoding with the
default dynamic cache, attention by SDPA against ``attn_implementation`` = this library's with
``config.sparse_attention`` = a sliding window of 1024 keys and MoBA (blocks of 64, top 8).

Per-token time: a logits processor stamps the clock at every generation step inside one
``generate(max_new_tokens=1 + T)`` call; the time from the first stamp (after the prefill) to the
last, over T, is the decode steps' mean (model forward with the cache, sampling, cache update). Every configuration runs once per round, rounds
interleaved (the starting configuration rotates), after one warm-up round; medians over rounds.
The machine header records threads and the load average at start and end.

    python benchmarks/decode_generate.py --prompts 8192,32768        # writes benchmarks/results/decode_generate.md
    python benchmarks/decode_generate.py --quick --out /tmp/gen      # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"sdpa": None, "window 1024": "sliding_window:window=1024", "moba 64/8": "moba:block=64,top_k=8"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="8192,32768")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens timed after the first (default 16)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="prompt 512, 4 tokens, 1 round")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_generate")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.rounds = "512", 4, 1
    return args


def build(spec, n_pos: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparse_io_attn.integrations import transformers as sia_hf

    cfg = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=n_pos)
    torch.manual_seed(0)
    if spec is None:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    cfg.sparse_attention = spec
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=sia_hf.register()).eval()


def decode_ms(model, ids, new: int) -> float:
    """Mean ms per decode step of one greedy ``generate`` (the prefill excluded)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores
    stamp = Stamp()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([stamp]))
    t = stamp.times
    return (t[-1] - t[0]) / (len(t) - 1) * 1e3


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [c for c in args.configs.split(",") if c]
    load0 = os.getloadavg()
    rows = []
    for n in (int(x) for x in args.prompts.split(",")):
        models = {c: build(CONFIGS[c], n + args.new_tokens + 8) for c in names}
        ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
        per = {c: [] for c in names}
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for c in order:
                ms = decode_ms(models[c], ids, args.new_tokens)
                if r > 0:
                    per[c].append(ms)
        for c in names:
            ms = statistics.median(per[c])
            rows.append({"prompt": n, "config": c, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
                         "rounds_ms": per[c]})
            print(json.dumps(rows[-1]), flush=True)
    header = {"cpu": _cpu(), "threads": args.threads, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "load_start": load0,
              "load_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "new_tokens": args.new_tokens, "rounds": args.rounds}
    if str(args.out) != "none":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        base = {r["prompt"]: r["ms_per_token"] for r in rows if r["config"] == "sdpa"}
        lines = ["# generate(): ms per token after a long prompt (CPU)", "",
                 *(f"- {k}: {v}" for k, v in header.items()), "",
                 "| prompt | attention | ms / token | tokens / s | vs SDPA |", "|---|---|---|---|---|"]
        for r in rows:
            ratio = f"{base[r['prompt']] / r['ms_per_token']:.2f}x" if r["prompt"] in base else "-"
            lines.append(f"| {r['prompt']:,} | {r['config']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {ratio} |")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}.md")


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return sys.platform


if __name__ == "__main__":
    main()
