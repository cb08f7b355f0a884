"""Seeded randomized correctness of backend "cpu" (and a small subset on "triton"): a few hundred
small random problems against backend "torch" and the float64 reference, forward and backward,
plus bitwise determinism of the cpu backward across two runs.

Each case is drawn from ``random.Random(case)``, so a failure names its case id and reproduces
alone (``pytest "tests/block_sparse/test_fuzz.py::test_cpu_case[17]"``). The cases cover fp32/bf16/fp16, lengths 1-300 with Nq != Nk,
square and rectangular blocks of 1-200, element masks shared/per head/per batch, empty layouts and
empty rows, non-contiguous and expanded (stride-0) inputs, GQA and both causal alignments.

``SPARSE_IO_ATTN_FUZZ_CASES=N`` runs N cpu cases instead of the default (``make fuzz-sanitize``
runs thousands under AddressSanitizer/UBSan).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse import cpu
from sparse_io_attn.block_sparse.reference import element_mask, masked_attention, rel_err

CPU_CASES = int(os.environ.get("SPARSE_IO_ATTN_FUZZ_CASES", "200"))
TRITON_CASES = 12
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
BLOCKS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 48, 64, 100, 128, 200)
MAX_BLOCKS = 600   # query blocks x key blocks per case: keeps block size 1 to short sequences


@dataclass
class Case:
    """One random problem: inputs are views (``view``) of leaf tensors that receive the gradients."""
    name: str
    layout: BlockSparseLayout
    causal: bool | str
    sm_scale: float | None
    leaves: tuple
    views: tuple
    do: torch.Tensor


def _length(rng: random.Random, hi: int) -> int:
    return min(hi, max(1, int(2 ** rng.uniform(0, 8.3))))   # log-uniform in [1, 300]


def _input(rng: random.Random, B, H, N, D, dtype, kinds):
    """A leaf and a [B, H, N, D] view of it: contiguous, transposed, strided head dim or expanded."""
    kind = rng.choice(kinds)
    if kind == "transposed":
        leaf = torch.randn(B, N, H, D, dtype=dtype)
        return leaf, (lambda t: t.transpose(1, 2)), kind
    if kind == "strided":
        leaf = torch.randn(B, H, N, 2 * D, dtype=dtype)
        return leaf, (lambda t: t[..., ::2]), kind
    if kind == "expand-batch":
        leaf = torch.randn(1, H, N, D, dtype=dtype)
        return leaf, (lambda t: t.expand(B, H, N, D)), kind
    if kind == "expand-seq":
        leaf = torch.randn(B, H, 1, D, dtype=dtype)
        return leaf, (lambda t: t.expand(B, H, N, D)), kind
    return torch.randn(B, H, N, D, dtype=dtype), (lambda t: t), "contiguous"


def _mask(rng: random.Random, gen: torch.Generator, lead: tuple, Nq, Nk, bq, bk, kind) -> torch.Tensor:
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    if kind == "empty":
        return torch.zeros(*lead, Nq, Nk, dtype=torch.bool)
    keep = torch.rand(*lead, nqb, nkb, generator=gen) < rng.uniform(0.2, 1.0)
    if kind == "empty-rows":
        keep[..., rng.randrange(nqb), :] = False
    elem = keep.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :Nq, :Nk]
    if kind in ("element", "empty-rows"):
        elem &= torch.rand(elem.shape, generator=gen) < rng.uniform(0.3, 1.0)
    return elem


def make_case(case: int, *, triton: bool = False) -> Case:
    rng = random.Random(case + (10_000 if triton else 0))
    gen = torch.Generator().manual_seed(case)
    torch.manual_seed(case)
    if triton:   # few tiles of the kernels' power-of-two blocks, fp32
        dtype = torch.float32
        bq, bk = rng.choice((16, 32)), rng.choice((16, 32))
        Nq, Nk = rng.randint(1, 96), rng.randint(1, 96)
        D = rng.choice((16, 32))
    else:
        dtype = rng.choice((torch.float32, torch.float32, torch.bfloat16, torch.float16))
        bq, bk = rng.choice(BLOCKS), rng.choice(BLOCKS) if rng.random() < 0.6 else None
        bk = bk or bq
        Nq, Nk = _length(rng, 300), _length(rng, 300)
        while -(-Nq // bq) * -(-Nk // bk) > MAX_BLOCKS:
            Nq, Nk = max(1, Nq // 2), max(1, Nk // 2)
        D = rng.choice((1, 8, 16, 24, 32, 64))
    Hkv = rng.choice((1, 2))
    Hq = Hkv * rng.choice((1, 2))
    B = rng.choice((1, 2))
    per = rng.choice(("shared", "head", "batch"))
    lead = {"shared": (), "head": (Hq,), "batch": (B, Hq)}[per]
    kind = rng.choice(("block", "element", "element", "empty-rows", "empty") if not triton else
                      ("block", "element", "empty-rows"))
    layout = BlockSparseLayout.from_dense_mask(_mask(rng, gen, lead, Nq, Nk, bq, bk, kind), (bq, bk))
    causal = rng.choice((False, False, True, "bottom_right"))
    sm_scale = rng.choice((None, None, 0.5, -0.3))
    kinds = ("contiguous",) if triton else ("contiguous", "contiguous", "transposed", "strided",
                                            "expand-batch", "expand-seq")
    shapes = ((Hq, Nq), (Hkv, Nk), (Hkv, Nk))
    # expand-seq (all rows equal) only for q: equal keys or values make dQ, dK vanish (rounding noise)
    built = [_input(rng, B, H, N, D, dtype, kinds if i == 0 else tuple(x for x in kinds if x != "expand-seq"))
             for i, (H, N) in enumerate(shapes)]
    leaves = tuple(leaf.requires_grad_() for leaf, _, _ in built)
    views = tuple(view for _, view, _ in built)
    do = torch.randn(B, Hq, Nq, D, dtype=dtype)
    name = (f"case {case}: B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} D={D} block=({bq}, {bk}) {dtype} "
            f"mask={kind}/{per} causal={causal} sm_scale={sm_scale} inputs={[k for _, _, k in built]}")
    return Case(name, layout, causal, sm_scale, leaves, views, do)


def run_case(c: Case, backend: str, *, twice: bool = False):
    """``(out, lse, dq, dk, dv)`` with gradients on the leaves; ``twice``: also a second backward."""
    leaves = tuple(t.detach().clone().requires_grad_() for t in c.leaves)
    q, k, v = (view(t) for view, t in zip(c.views, leaves))
    out, lse = block_sparse_attention(q, k, v, c.layout, causal=c.causal, sm_scale=c.sm_scale,
                                      return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, leaves, c.do, retain_graph=twice)
    again = torch.autograd.grad(out, leaves, c.do) if twice else None
    return (out.detach(), lse.detach(), *grads), again


def reference(c: Case):
    """Float64 ``(out, lse, dq, dk, dv)``, gradients on the leaves (through the same views)."""
    leaves = tuple(t.detach().double().requires_grad_() for t in c.leaves)
    q, k, v = (view(t) for view, t in zip(c.views, leaves))
    B, Hq, Nq, D = q.shape
    mask = element_mask(c.layout, B, Hq, Nq, k.shape[2], causal=c.causal)
    out, lse = masked_attention(q, k, v, mask, D ** -0.5 if c.sm_scale is None else c.sm_scale)
    grads = torch.autograd.grad(out, leaves, c.do.double())
    return (out.detach(), lse.detach(), *grads)


def compare(c: Case, got, ref, tol, what: str) -> None:
    names = ("out", "lse", "dq", "dk", "dv")
    for name, x in zip(names, got):
        assert not torch.isnan(x).any(), f"{c.name}: NaN in {what} {name}"
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1])), f"{c.name}: {what} lse -inf rows differ"
    fin = torch.isfinite(ref[1])
    errs = {name: rel_err(x[fin] if name == "lse" else x, y[fin] if name == "lse" else y)
            for name, x, y in zip(names[:2], got, ref)}
    # gradients: relative to their norm, or to their natural size (|sm_scale| per element) where the
    # exact gradient vanishes (rows of one key, equal keys): dQ, dK are then rounding noise
    D = c.do.shape[-1]
    sm = abs(D ** -0.5 if c.sm_scale is None else c.sm_scale)
    for name, x, y, floor in zip(names[2:], got[2:], ref[2:], (sm, sm, 0.0)):
        x, y = x.double(), y.double()
        den = max(y.norm().item(), floor * y.numel() ** 0.5)
        errs[name] = (x - y).norm().item() / den if den > 0 else (x - y).norm().item()
    bad = {name: e for name, e in errs.items() if not e <= tol}
    assert not bad, f"{c.name}: {what} relative errors above {tol}: {bad}"


@pytest.mark.skipif(not cpu.is_available(), reason=f"CPU kernel unavailable: {cpu.unavailable_reason()}")
@pytest.mark.slow
@pytest.mark.parametrize("case", range(CPU_CASES))
def test_cpu_case(case):
    c = make_case(case)
    tol = TOL[c.do.dtype]
    got, again = run_case(c, "cpu", twice=True)
    compare(c, got, reference(c), tol, "cpu vs float64")
    want, _ = run_case(c, "torch")
    compare(c, got, tuple(t.double() for t in want), 2 * tol, "cpu vs torch")
    for name, x, y in zip(("dq", "dk", "dv"), got[2:], again):
        assert torch.equal(x, y), f"{c.name}: cpu {name} differs between two backward runs"


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.slow
@pytest.mark.parametrize("case", range(TRITON_CASES))
def test_triton_case(case):
    c = make_case(case, triton=True)
    if not INTERPRET:
        c.leaves = tuple(t.detach().cuda().requires_grad_() for t in c.leaves)
        c.do = c.do.cuda()
        c.layout = c.layout.to("cuda")
    got, _ = run_case(c, "triton")
    got = tuple(t.cpu() for t in got)
    c.leaves = tuple(t.detach().cpu().requires_grad_() for t in c.leaves)
    c.do, c.layout = c.do.cpu(), c.layout.to("cpu")
    compare(c, got, reference(c), 1e-4, "triton vs float64")
