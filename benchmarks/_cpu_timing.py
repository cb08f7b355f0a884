"""Shared by the CPU benchmarks (``bench_cpu_kernel.py``, ``bench_cpu_torch_path.py``): the
benchmark patterns, forward+backward closures, and interleaved timing rounds."""
from __future__ import annotations

import argparse
import time

from sparse_io_attn import patterns

PATTERNS = ("sliding_window", "bigbird", "causal", "dense")


def build(name: str, N: int, block: int):
    """``(layout, causal)`` for a pattern name."""
    if name == "sliding_window":
        return patterns.sliding_window(N, block), False
    if name == "bigbird":
        return patterns.bigbird(N, block), False
    if name == "causal":
        return patterns.causal(N, block), True
    if name == "dense":
        return patterns.dense(N, block), False
    raise ValueError(f"unknown pattern {name!r}; choose from {', '.join(PATTERNS)}")


def fwd_bwd(fn, q, k, v, do):
    """A closure running ``fn`` forward and backward on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(do)
    return run


def time_interleaved(methods: dict, repeats: int) -> dict:
    """``{name: [seconds per round]}``: one warm-up round, then ``repeats`` rounds calling every
    method once per round (the first method of a round rotates)."""
    for fn in methods.values():
        fn()
    names = list(methods)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def shape_arguments(p: argparse.ArgumentParser, repeats: int) -> argparse.ArgumentParser:
    """The problem-size options every CPU benchmark takes (B = 1, H heads, N tokens, D, block)."""
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds after one warm-up round")
    return p
