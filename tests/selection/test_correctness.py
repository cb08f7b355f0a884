"""Every backend of ``selection_attention`` against the float64 reference (straight from the raw
indices): outputs, lse and all three gradients on fresh random inputs, for G in {1, Hkv, Hq}, block
sizes 1, 4, 16, 64 with ragged key lengths, repeated entries, empty slots, counts, both causal
alignments, GQA/MQA/MHA, rows with no allowed key, shared and per-batch selections, the three ways
of passing a selection, low precision against a same-precision baseline, determinism. One matrix,
parametrised over the backends (``triton`` runs through Triton's interpreter on CPU: fp32, tiny
shapes, a few hundred tiles per case)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import check_close, check_repeatable, check_within_baseline, make_inputs, skip_cpu_backend_if_unbuilt
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_mask, selection_reference

SELECTION_BACKENDS = ["torch", "cpu", "triton"]
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def _cpu_kernel_present(request):
    """The C++ backend runs on CPU tensors, and only where it could be built (a C++ compiler)."""
    skip_cpu_backend_if_unbuilt(request)


def device_of(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def random_indices(lead: tuple, Nq: int, Nk: int, K: int, block_size: int, *, causal=False, empty: float = 0.25,
                   repeats: bool = True, own_block: bool = True, device="cpu") -> torch.Tensor:
    """int64 ``[*lead, Nq, K]``: random key blocks, a fraction ``empty`` of ``-1`` slots, slot 1
    repeating slot 0 in about a third of the rows, and (``own_block``) slot 0 the block of the
    token's causal diagonal (MoBA keeps its own block), so that most rows have keys."""
    nkb = math.ceil(Nk / block_size)
    idx = torch.randint(0, nkb, (*lead, Nq, K))
    if own_block:
        delta = causal_offset(causal, Nq, Nk) or 0
        idx[..., 0] = ((torch.arange(Nq) + delta).clamp(0, Nk - 1) // block_size)
    idx = torch.where(torch.rand(idx.shape) < empty, -1, idx)
    if repeats and K > 1:
        idx[..., 1] = torch.where(torch.rand(idx.shape[:-1]) < 0.35, idx[..., 0], idx[..., 1])
    return idx.to(device)


def run_selection(q, k, v, do, indices, *, backend, causal=False, sm_scale=None, **kwargs):
    """Forward + backward through the public API: ``(out, lse, dq, dk, dv)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = selection_attention(q, k, v, indices, causal=causal, sm_scale=sm_scale, return_lse=True,
                                   backend=backend, **kwargs)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def check_empty_rows(got, selection, causal):
    """Rows with no allowed key: output 0, lse -inf, zero dq (and no NaN anywhere: check_close)."""
    out, lse, dq = got[0], got[1], got[2]
    B, Hq, Nq, _ = out.shape
    mask = selection_mask(selection, B, Hq, got[3].shape[2], causal=causal, device=out.device)
    empty = ~mask.any(-1)
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    return int(empty.sum())


# (B, Hq, Hkv, G, Nq, Nk, D, block_size, K, causal, options)
CASES = [
    pytest.param(2, 4, 2, 1, 37, 53, 16, 4, 5, False, {}, id="G1-shared-gqa-bs4-ragged"),
    pytest.param(2, 4, 2, 2, 40, 150, 32, 64, 2, True, {"batched": True}, id="Ghkv-per-batch-bs64-ragged-causal"),
    pytest.param(1, 4, 2, 4, 20, 45, 16, 1, 12, "bottom_right", {}, id="Ghq-bs1-bottom-right-Nq<Nk"),
    pytest.param(2, 2, 2, 2, 33, 33, 16, 4, 6, True, {"batched": True, "counts": True}, id="mha-Ghq-counts-causal"),
    pytest.param(1, 2, 2, 1, 48, 30, 16, 16, 2, "bottom_right", {}, id="bottom-right-Nq>Nk-empty-rows"),
    pytest.param(1, 3, 1, 3, 24, 40, 16, 4, 3, True, {}, id="mqa-Ghq-causal"),
    pytest.param(2, 3, 1, 1, 24, 40, 16, 4, 3, False, {"batched": True}, id="mqa-G1-per-batch"),
    pytest.param(1, 4, 2, 2, 30, 50, 16, 4, 4, True, {"counts": True}, id="Ghkv-top-left-Nq<Nk-counts"),
    pytest.param(1, 2, 1, 2, 25, 40, 32, 64, 1, False, {}, id="bs64-one-ragged-block-K1"),
    pytest.param(1, 4, 4, 4, 16, 64, 16, 1, 24, False, {"empty": 0.5}, id="mha-bs1-half-empty-slots"),
    pytest.param(1, 2, 2, 2, 1, 77, 16, 4, 6, "bottom_right", {}, id="decode-Nq1-bottom-right"),
    pytest.param(1, 2, 1, 1, 32, 32, 48, 4, 4, True, {"empty_rows": (0, 5, 17)}, id="D48-empty-rows-causal"),
]


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
@pytest.mark.parametrize("B,Hq,Hkv,G,Nq,Nk,D,bs,K,causal,opts", CASES)
def test_matches_float64_reference(backend, B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, opts):
    dev = device_of(backend)
    lead = (B, G) if opts.get("batched") else (G,)
    idx = random_indices(lead, Nq, Nk, K, bs, causal=causal, empty=opts.get("empty", 0.25), device=dev)
    for t in opts.get("empty_rows", ()):
        idx[..., t, :] = -1
    counts = torch.randint(0, K + 1, idx.shape[:-1], device=dev) if opts.get("counts") else None
    sel = Selection(idx, bs, counts)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=dev)
    got = run_selection(q, k, v, do, sel, backend=backend, causal=causal)
    check_close(got, selection_reference(q, k, v, sel, causal=causal, do=do))
    empty = check_empty_rows(got, sel, causal)
    if opts.get("empty_rows") or (causal == "bottom_right" and Nq > Nk):
        assert empty > 0


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_no_allowed_key_anywhere(backend):
    """Every slot empty, or every block in the causal future: output 0, lse -inf, zero gradients."""
    dev = device_of(backend)
    q, k, v, do = make_inputs(1, 2, 1, 16, 40, 16, device=dev)
    for idx, causal in ((torch.full((1, 16, 3), -1, device=dev), False),
                        (torch.full((1, 16, 3), 9, device=dev), True)):      # block 9 = keys 36..39
        got = run_selection(q, k, v, do, idx, block_size=4, backend=backend, causal=causal)
        assert torch.isneginf(got[1]).all()
        for x in (got[0],) + got[2:]:
            assert (x == 0).all()


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_selection_indices_and_plan_give_the_same_result(backend):
    """A ``Selection``, raw indices with ``block_size`` and ``counts``, and a ``SelectionPlan`` built for
    the call: one result, bitwise."""
    dev = device_of(backend)
    B, Hq, Hkv, Nq, Nk, bs, K = 2, 4, 2, 29, 61, 8, 4
    idx = random_indices((B, Hkv), Nq, Nk, K, bs, causal=True, device=dev)
    counts = torch.randint(0, K + 1, (B, Hkv, Nq), device=dev)
    sel = Selection(idx, bs, counts)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, 16, device=dev)
    by_selection = run_selection(q, k, v, do, sel, backend=backend, causal=True)
    by_indices = run_selection(q, k, v, do, idx, block_size=bs, counts=counts, backend=backend, causal=True)
    plan = plan_selection(sel, Nk, causal_offset=causal_offset(True, Nq, Nk))
    by_plan = run_selection(q, k, v, do, plan, backend=backend, causal=True)
    check_close(by_selection, selection_reference(q, k, v, sel, causal=True, do=do))
    for a, b, c in zip(by_selection, by_indices, by_plan):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_shared_selection_equals_per_batch_copies(backend):
    """``[G, Nq, K]`` shared by the batch computes what ``[B, G, Nq, K]`` with equal rows does."""
    dev = device_of(backend)
    B, Hq, Hkv, Nq, Nk, bs, K = 3, 2, 2, 21, 40, 4, 5
    idx = random_indices((Hq,), Nq, Nk, K, bs, device=dev)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, 16, device=dev)
    shared = run_selection(q, k, v, do, Selection(idx, bs), backend=backend)
    copies = run_selection(q, k, v, do, Selection(idx.expand(B, *idx.shape).contiguous(), bs), backend=backend)
    check_close(shared, selection_reference(q, k, v, Selection(idx, bs), do=do))
    for a, b in zip(shared, copies):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_noncontiguous_inputs_and_sm_scale(backend):
    dev = device_of(backend)
    q, k, v, do = (torch.randn(2, 30, h, 16, device=dev).transpose(1, 2) for h in (4, 2, 2, 4))
    idx = random_indices((2,), 30, 30, 4, 4, causal=True, device=dev)
    got = run_selection(q, k, v, do, idx, block_size=4, backend=backend, causal=True, sm_scale=0.3)
    check_close(got, selection_reference(q, k, v, Selection(idx, 4), causal=True, sm_scale=0.3, do=do))


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_backward_is_deterministic(backend):
    """Two runs, bitwise equal: many tokens choose the same blocks (dK/dV sums with many terms)."""
    dev = device_of(backend)
    N = 24 if backend == "triton" else 64          # the interpreter runs one program at a time
    B, Hq, Hkv, Nq, Nk, bs, K = 1, 4, 2, N, N, 4, 8
    idx = random_indices((B, Hq), Nq, Nk, K, bs, causal=True, device=dev)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, 16, device=dev)
    check_repeatable(lambda: run_selection(q, k, v, do, idx, block_size=bs, backend=backend, causal=True))


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_vs_same_precision_baseline(backend, dtype, causal):
    """flash-attention's rule: error vs float64 at most 2x (outputs) / 3x (gradients) the error of
    plain PyTorch attention with the same element mask, run in the same dtype."""
    dev = device_of(backend)
    B, Hq, Hkv, N, D, bs, K = 1, 4, 2, (24 if backend == "triton" else 48), 32, 4, 6
    idx = random_indices((Hkv,), N, N, K, bs, causal=causal, device=dev)
    sel = Selection(idx, bs)
    q, k, v, do = make_inputs(B, Hq, Hkv, N, N, D, dtype=dtype, device=dev)
    out, lse, dq, dk, dv = run_selection(q, k, v, do, sel, backend=backend, causal=causal)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32
    ref = selection_reference(q, k, v, sel, causal=causal, do=do)
    mask = selection_mask(sel, B, Hq, N, causal=causal, device=q.device)
    check_within_baseline((out, lse, dq, dk, dv), ref, q, k, v, do, mask)


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_unselected_blocks_are_never_read(backend):
    """NaN in K/V blocks no token selected reaches no output or gradient (empty slots read nothing)."""
    dev = device_of(backend)
    q, k, v, do = make_inputs(1, 2, 1, 24, 48, 16, device=dev)
    idx = torch.randint(0, 4, (2, 24, 3), device=dev)            # blocks 0..3 = keys 0..31
    idx[:, ::3, 1] = -1
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    got = run_selection(q, k, v, do, idx, block_size=8, backend=backend)
    for name, x in zip(("out", "lse", "dq"), got[:3]):
        assert torch.isfinite(x).all(), f"non-finite {name}"
    assert torch.isfinite(got[3][:, :, :32]).all() and torch.isfinite(got[4][:, :, :32]).all()
    check_close(got[:3] + (got[3][:, :, :32], got[4][:, :, :32]),
                tuple(r if i < 3 else r[:, :, :32] for i, r in enumerate(selection_reference(
                    q, k.nan_to_num(), v.nan_to_num(), Selection(idx, 8), do=do))))


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
@pytest.mark.parametrize("sm_scale", [1e6, 1e9, 1e12])
@pytest.mark.parametrize("block_size,D", [(16, 24), (1, 32)])
def test_finite_gradients_at_any_sm_scale(backend, block_size, D, sm_scale):
    """``sm_scale`` alone up to 1e12: finite outputs, lse and gradients on every backend (the backward's
    recomputed probabilities are capped at 1), each output row a convex combination of value rows."""
    dev = device_of(backend)
    q, k, v, do = make_inputs(1, 4, 2, 60, 60, D, device=dev)
    idx = random_indices((1, 2), 60, 60, 3, block_size, causal=True, device=dev)
    got = run_selection(q, k, v, do, idx, block_size=block_size, backend=backend, causal=True, sm_scale=sm_scale)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert torch.isfinite(x[torch.isfinite(got[1])] if name == "lse" else x).all(), \
            f"non-finite {name} on {backend} at sm_scale {sm_scale:g}"
    assert got[0].abs().max() <= v.abs().max() * (1 + 1e-6)
