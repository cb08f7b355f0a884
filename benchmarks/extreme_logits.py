"""Backward accuracy at extreme logits: dQ, dK, dV of ``backend="triton"`` against float64, for the two
score forms of the dK/dV kernel (``EXACT_SCORES``; ``sparse_io_attn.block_sparse.tiles``):

* ``direct``: ``S^T = K Q^T`` formed in the dK/dV kernel (the default since issue 46: every product on
  Hopper's wgmma, no fp32 transpose);
* ``exact``: the forward's ``Q K^T`` transposed, so the recomputed probabilities round exactly as the
  forward's (the configurations before issue 46, kept as autotuning candidates).

Each form runs at the same tiles (64 queries x 128 keys, the default at head dims 64-128 in bf16/fp16;
and 16 x 32, the fp32 default), forced through the launcher's configuration list, under Triton's
interpreter in fp32 (``tl.dot`` is a NumPy float32 matmul there, whose rounding of a score depends on
the tile's shape: the forward's 64 x 32 tiles and dK/dV's tiles round ``q.k`` differently in either
form; a GPU's tensor cores may round ``K Q^T`` and ``Q K^T`` alike or not: not measured).
``backend="torch"`` (``q @ k^T``, as the forward) is shown for reference. B 1, 2 query heads on 1 KV
head, N 256, D 64, blocks of 128, causal (partial diagonal blocks and full blocks); the largest relative
error ``||x - ref|| / ||ref||`` over the seeds. Two input families at logit size ``L``:

* ``scaled``: ``q, k ~ N(0, L)``, logits ``q.k / sqrt(D)`` of standard deviation ``L``: past ``L ~ 10``
  each row's softmax is one-hot, so float64's dQ and dK vanish (``||ref||`` below ``1e-9 ||dV||``: shown
  as ``-``); dV is the measure there.
* ``offset``: ``k`` shares a component ``L sqrt(D)`` along one axis: every row's logits carry an offset
  of size ``L`` (``L q_i0``) while their spread stays of order 1, so the softmax keeps many terms and
  every gradient is of order 1: the scores' fp32 rounding (``L * 2^-24``) against O(1) differences.

    python benchmarks/extreme_logits.py          # writes benchmarks/results/extreme_logits.{md,json}
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

from sparse_io_attn import block_sparse_attention, patterns
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.block_sparse.tiles import DIRECT, EXACT, KernelConfig, dkdv_part_rows
from sparse_io_attn.block_sparse.triton import launch
from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_json

OUT = Path(__file__).resolve().parent / "results" / "extreme_logits"
SCALES = (1.0, 1e3, 1e4, 1e5, 1e6)
TILES = {"64x128": (64, 128, 8, 3), "16x32": (16, 32, 8, 2)}   # (block_m, block_n, warps, stages)
B, HQ, HKV, N, D, BLOCK = 1, 2, 1, 256, 64, 128


def forced(dkdv: KernelConfig):
    """The launcher's configuration lists with dK/dV's replaced by ``dkdv`` alone."""
    configs = launch.kernel_configs

    def kernel_configs(kernel, block_size, head_dim, dtype=torch.bfloat16):
        return [dkdv] if kernel == "dkdv" else configs(kernel, block_size, head_dim, dtype)
    return mock.patch.object(launch, "kernel_configs", kernel_configs)


def gradients(q, k, v, do, layout, backend):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    block_sparse_attention(q, k, v, layout, causal=True, backend=backend).backward(do)
    return q.grad, k.grad, v.grad


def make_inputs(family: str, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    if family == "scaled":
        q, k = (torch.randn(B, h, N, D, generator=g) * scale ** 0.5 for h in (HQ, HKV))
    else:
        q, k = torch.randn(B, HQ, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g)
        k[..., 0] += scale * D ** 0.5
    return q, k, torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HQ, N, D, generator=g)


def measure(seeds: int) -> list[dict]:
    layout = patterns.dense(N, BLOCK)
    runs = [("torch", None, "torch")] + [(f"triton {form} {name}",
                                          KernelConfig(*t, exact_scores=exact, part_m=dkdv_part_rows(t[0])), "triton")
                                         for name, t in TILES.items()
                                         for form, exact in (("direct", DIRECT), ("exact", EXACT))]
    rows = []
    for family in ("scaled", "offset"):
        for scale in SCALES:
            errs: dict[str, list] = {name: [] for name, _, _ in runs}
            top = 0.0
            for seed in range(seeds):
                q, k, v, do = make_inputs(family, scale, seed)
                top = max(top, float((q.double() @ k.double().transpose(-1, -2)).abs().max()) * D ** -0.5)
                ref = attention_reference(q, k, v, layout, causal=True, do=do)[2:]
                tiny = [r.norm() < 1e-9 * ref[2].norm() for r in ref]   # float64's dQ / dK vanish (one-hot)
                for name, cfg, backend in runs:
                    with forced(cfg) if cfg is not None else contextlib.nullcontext():
                        got = gradients(q, k, v, do, layout, backend)
                    errs[name].append([None if t else rel_err(x, r) for x, r, t in zip(got, ref, tiny)])
            for name, _, _ in runs:
                worst = [None if any(e[i] is None for e in errs[name]) else max(e[i] for e in errs[name])
                         for i in range(3)]
                rows.append({"inputs": family, "logit_size": scale, "max_logit": top, "run": name,
                             "dq": worst[0], "dk": worst[1], "dv": worst[2]})
                print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    header = machine_header(torch.float32)
    rows = measure(args.seeds)
    cols = [("inputs", "inputs"), ("logit_size", "L"), ("max_logit", "max |logit|"), ("run", "run"),
            ("dq", "dq rel err"), ("dk", "dk rel err"), ("dv", "dv rel err")]
    text = (f"{format_header(header)}\n\n# Backward at extreme logits against float64 (benchmarks/extreme_logits.py)\n\n"
            f"B {B}, {HQ} query heads on {HKV} KV head, N {N}, D {D}, blocks of {BLOCK}, causal, fp32 inputs, "
            f"Triton's interpreter; the largest of {args.seeds} seeds. Inputs: `scaled` q, k ~ N(0, L) (one-hot "
            f"softmax past L ~ 10: float64's dQ, dK vanish, shown as -); `offset` every row's logits offset by "
            f"~L, spread O(1).\n\n```\n{format_table(rows, cols)}\n```\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".md").write_text(text)
    write_json(OUT.with_suffix(".json"), {"header": header, "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
