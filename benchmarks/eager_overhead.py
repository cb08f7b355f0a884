"""Eager per-call cost of ``block_sparse_attention`` and ``selection_attention`` at a small shape, where
Python overhead shows.

B 1, H 4, N 256, D 64, fp32, blocks of 64, ``backend="cpu"``, ``--threads`` torch threads (1 by
default: with 2, another process on a 2-core machine makes OpenMP's waits dominate): forward, and
forward + backward, for a sliding window and a causal layout, and (``--ops selection`` or ``all``) a
per-token selection of 2 blocks of 64 per token (causal, one selection per KV head, a fixed
``Selection``); the median over ``--repeats`` interleaved calls of each. Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare versions; the committed
numbers are in ``benchmarks/results/eager_overhead.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import sparse_io_attn
from sparse_io_attn import Selection, block_sparse_attention, patterns, selection_attention


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ops", choices=("block_sparse", "selection", "all"), default="block_sparse")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    B, H, N, D = 1, 4, 256, 64
    q, k, v, do = (torch.randn(B, H, N, D) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cases = {"sliding_window": (patterns.sliding_window(N, 64, 128), False),
             "causal": (patterns.causal(N, 64), True)}
    if args.ops == "selection":
        cases = {}
    runs = {}
    if args.ops != "block_sparse":
        t = torch.arange(N)
        own = t // 64
        indices = torch.stack([own, torch.clamp(own - 1, min=0)], -1).expand(B, H, N, 2).contiguous()
        sel = Selection(indices, 64)

        def sel_fwd():
            with torch.no_grad():
                selection_attention(q, k, v, sel, causal=True, backend="cpu", check=False)

        def sel_fwd_bwd():
            for t in leaves:
                t.grad = None
            selection_attention(*leaves, sel, causal=True, backend="cpu", check=False).backward(do)
        runs["selection fwd"] = sel_fwd
        runs["selection fwd+bwd"] = sel_fwd_bwd
    for name, (layout, causal) in cases.items():
        def fwd(layout=layout, causal=causal):
            with torch.no_grad():
                block_sparse_attention(q, k, v, layout, causal=causal, backend="cpu")

        def fwd_bwd(layout=layout, causal=causal):
            for t in leaves:
                t.grad = None
            block_sparse_attention(*leaves, layout, causal=causal, backend="cpu").backward(do)
        runs[f"{name} fwd"] = fwd
        runs[f"{name} fwd+bwd"] = fwd_bwd
    for fn in runs.values():
        for _ in range(20):
            fn()
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    result = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    header = {"checkout": os.path.dirname(os.path.dirname(sparse_io_attn.__file__)),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"header": header, "median_us": result}))
    else:
        print(header)
        for name, us in result.items():
            print(f"{name:24s} {us:9.1f} us")


if __name__ == "__main__":
    main()
