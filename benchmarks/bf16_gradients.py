"""bf16 gradients of ``selection_attention`` against float64, on native-sparse-attention's test data.

fla-org/native-sparse-attention ``tests/test_nsa.py::test_parallel`` (the selection branch,
``window_size = 0``): ``B = 1``, ``T`` in {256, 1024, 2000}, ``H = 4`` KV heads, ``HQ = 64`` query
heads, ``D`` in {100, 64}, ``S = 16`` blocks of 32 keys per token chosen at random among the
token's earlier blocks (``randperm(max(1, cdiv(t, 32)))[:S]``, sorted, padding ``T``), a random
count ``1..S`` per token, bf16, ``scale = 0.1``; q/k/v ``linspace(0, 1, T)`` permuted along the
sequence and broadcast over heads and head dim, ``do`` standard normal. The peer asserts
``rms(ref - x) / rms(ref) < 5e-3`` for o, dq, dk, dv (its ``get_err_ratio``); here the reference is
the float64 reference of the same selection (:func:`sparse_io_attn.selection.reference.selection_reference`),
and the ratio of each backend's bf16 result is printed per tensor.

    python benchmarks/bf16_gradients.py                       # T = 256, 1024; backends torch, cpu
    python benchmarks/bf16_gradients.py --T 256 1024 2000 --out benchmarks/results/bf16_gradients.md
    python benchmarks/bf16_gradients.py --device cuda --backends triton torch      # on a GPU (gpu_session.py)

``--device cuda``: the inputs on the GPU (the float64 reference stays on the CPU); ``--dry-run``: a tiny case
(T 64, D 32) on the CPU, Triton through its interpreter (whose bf16 dots do not round as a GPU's: the
numbers of a dry run say nothing)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.cli._common import format_header, format_table, machine_header
from sparse_io_attn.selection.reference import selection_reference

H, HQ, S, BLOCK, SCALE = 4, 64, 16, 32, 0.1


def err_ratio(ref: torch.Tensor, x: torch.Tensor) -> float:
    """native-sparse-attention's ``get_err_ratio``: ``rms(ref - x) / rms(ref)``."""
    ref = ref.double()
    return ((ref - x.double()).square().mean().sqrt() / ref.square().mean().sqrt()).item()


def nsa_case(T: int, D: int, seed: int = 42):
    """The peer's inputs (``[B, T, H, D]`` there, ``[B, H, T, D]`` here) and its selection."""
    g = torch.Generator().manual_seed(seed)
    line = lambda n_heads: torch.linspace(0, 1, T, dtype=torch.bfloat16)[torch.randperm(T, generator=g)] \
        .view(1, 1, T, 1).expand(1, n_heads, T, D).clone()                              # noqa: E731
    q, k, v = line(HQ), line(H), line(H)
    do = torch.randn(1, HQ, T, D, generator=g).to(torch.bfloat16)
    idx = torch.full((1, H, T, S), T, dtype=torch.long)
    for t in range(T):
        for h in range(H):
            pick = torch.randperm(max(1, math.ceil(t / BLOCK)), generator=g)[:S]
            idx[0, h, t, :len(pick)] = pick
    idx = idx.sort(-1).values
    counts = torch.randint(1, S + 1, (1, H, T), generator=g)
    return q, k, v, do, Selection(idx, BLOCK, counts)


def reference(q, k, v, do, sel):
    """The float64 reference, one KV head (its GQA group, its selection) at a time (memory)."""
    g = HQ // H
    parts = []
    for h in range(H):
        qs, dos = q[:, h * g:(h + 1) * g], do[:, h * g:(h + 1) * g]
        part = Selection(sel.indices[:, h:h + 1], BLOCK, sel.counts[:, h:h + 1])
        parts.append(selection_reference(qs, k[:, h:h + 1], v[:, h:h + 1], part, causal=True, sm_scale=SCALE, do=dos))
    out, _, dq, dk, dv = (torch.cat(x, dim=1) for x in zip(*parts))
    return out, None, dq, dk, dv


def measure(T: int, D: int, backends, device: str = "cpu") -> list[dict]:
    q, k, v, do, sel = nsa_case(T, D)
    ref = reference(q, k, v, do, sel)
    rows = []
    for backend in backends:
        qg, kg, vg = (t.to(device).clone().requires_grad_() for t in (q, k, v))
        sel_d = Selection(sel.indices.to(device), BLOCK, sel.counts.to(device))
        out = selection_attention(qg, kg, vg, sel_d, causal=True, sm_scale=SCALE, backend=backend, check=False)
        out.backward(do.to(device))
        errs = [err_ratio(r, x) for r, x in zip((ref[0], ref[2], ref[3], ref[4]), (out, qg.grad, kg.grad, vg.grad))]
        rows.append({"T": T, "D": D, "backend": backend, **dict(zip(("o", "dq", "dk", "dv"), errs))})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--D", type=int, nargs="+", default=[100, 64])
    ap.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    ap.add_argument("--device", default="cpu", help="where the inputs live (the reference is on the CPU)")
    ap.add_argument("--dry-run", action="store_true", help="T 64, D 32 on the CPU (Triton: its interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="write a markdown table here")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.T, args.D, args.device = [64], [32], "cpu"
    rows = [r for T in args.T for D in args.D for r in measure(T, D, args.backends, args.device)]
    fmt = [{**r, **{c: f"{r[c]:.2e}" for c in ("o", "dq", "dk", "dv")}} for r in rows]
    table = format_table(fmt, [(c, c) for c in ("T", "D", "backend", "o", "dq", "dk", "dv")])
    text = format_header(machine_header(torch.bfloat16)) + "\n\n" + table + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
