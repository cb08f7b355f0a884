"""sparse_operands.attention batched (one call for every batch element and head) against the per-head Python
loop it replaces, on the ``torch`` path (CPU, fp32, forward + backward).

The batched call takes ``A1 = A2 = A3 = x [B, N, E]``, per-head block-sparse ``X`` (a list of ``H``
BlockSparseMatrix, block density 0.5, one pattern per head) and dense ``Y [H, E, E]``; the loop calls
the single-head form ``B * H`` times (``x[b]``, ``X[h]``, ``Y[h]``) and stacks the outputs. Both run
forward and backward (gradients into the same leaves); timings are medians of interleaved rounds in
one process (``_cpu_timing.time_interleaved``).

    python benchmarks/sparse_operands_batched.py            # writes results/sparse_operands_batched.md
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

import torch

from sparse_io_attn import sparse_operands
from sparse_io_attn.cli._common import format_header, format_table, machine_header
from sparse_io_attn.layout.matrix import BlockSparseMatrix

sys.path.insert(0, str(Path(__file__).parent))
from _cpu_timing import time_interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sparse_operands_batched.md"
#: (B, H, N, E): B * H from 8 to 32
SIZES = ((2, 4, 256, 64), (4, 4, 256, 64), (4, 8, 128, 64), (2, 16, 128, 32))


def case(B: int, H: int, N: int, E: int, block: int, density: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, E, generator=g)
    R = math.ceil(E / block)
    X = []
    for _ in range(H):
        keep = torch.rand(R, R, generator=g) < density
        keep[0, 0] = True
        X.append(BlockSparseMatrix.random(keep, block, shape=(E, E), generator=g))
    Y = torch.randn(H, E, E, generator=g) / math.sqrt(E)
    do = torch.randn(B, H, N, E, generator=g)
    return x, X, Y, do


def methods(x, X, Y, do, scale):
    leaves = [x.clone().requires_grad_()] + [m.values.detach().clone().requires_grad_() for m in X] + \
        [Y.clone().requires_grad_()]
    xs, ys = leaves[0], leaves[-1]
    Xs = [BlockSparseMatrix(m.crow_indices, m.col_indices, v, m.shape, m.block_size, validate=False)
          for m, v in zip(X, leaves[1:-1])]
    B, H = x.shape[0], len(X)

    def zero():
        for t in leaves:
            t.grad = None

    def batched():
        zero()
        sparse_operands.attention(xs, xs, xs, Xs, ys, scale=scale, backend="torch").backward(do)

    def loop():
        zero()
        out = torch.stack([torch.stack([sparse_operands.attention(xs[b], xs[b], xs[b], Xs[h], ys[h], scale=scale,
                                                        backend="torch") for h in range(H)]) for b in range(B)])
        out.backward(do)

    return {"batched": batched, "loop": loop}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    header = machine_header(torch.float32)
    load0 = os.getloadavg()[0]
    rows = []
    for B, H, N, E in SIZES:
        x, X, Y, do = case(B, H, N, E, args.block, args.density)
        times = time_interleaved(methods(x, X, Y, do, E ** -0.5), args.repeats)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append(dict(B=B, H=H, BH=B * H, N=N, E=E, batched_ms=round(med["batched"], 2),
                         loop_ms=round(med["loop"], 2), ratio=round(med["loop"] / med["batched"], 2)))
        print(rows[-1], flush=True)
    load1 = os.getloadavg()[0]
    table = format_table(rows, [("B", "B"), ("H", "H"), ("BH", "B*H"), ("N", "N"), ("E", "E = d"),
                                ("batched_ms", "batched ms"), ("loop_ms", "per-head loop ms"),
                                ("ratio", "loop / batched")])
    text = (f"```\n{format_header(header)}\n# nproc {os.cpu_count()}, uptime load average {load0:.2f} -> "
            f"{load1:.2f} after\n# sparse_operands.attention backend torch, fp32, forward + backward, X per head "
            f"block-sparse (block {args.block}, density {args.density}), Y dense [H, E, E], no QK layout; "
            f"median of {args.repeats} interleaved rounds\n\n{table}\n```\n")
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
