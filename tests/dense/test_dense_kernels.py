"""sparse_io_attn.dense kernels through the Triton interpreter: all five gradients against the
float64 references (the paper's definitions and autograd), counted traffic == traffic model."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from sparse_io_attn import dense
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.dense import traffic
from sparse_io_attn.dense.regime import forward_traffic
from sparse_io_attn.dense.reference import paper_forward, paper_gradients

GRADS = ("dX", "dY", "dA1", "dA2", "dA3")
TOL_FP32 = 1e-5


def _inputs(batch, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    A1, A2, A3 = (r(*batch, n, d) * 0.5 for _ in range(3))
    X, Y = r(d, d) * (0.7 / math.sqrt(d)), r(d, d) * (1.0 / math.sqrt(d))
    dO = r(*batch, n, d)
    return tuple(t.to(dtype) for t in (A1, A2, A3, X, Y, dO))


def _autograd_ref(A1, A2, A3, X, Y, dO, scale):
    """Dense float64 autograd over the whole batch (X, Y shared: their gradients sum over it)."""
    ts = [t.double().requires_grad_(True) for t in (A1, A2, A3, X, Y)]
    A1, A2, A3, X, Y = ts
    O = torch.softmax(scale * (A1 @ X @ A2.transpose(-1, -2)), dim=-1) @ (A3 @ Y)
    O.backward(dO.double())
    return O.detach(), dict(zip(("dA1", "dA2", "dA3", "dX", "dY"), (t.grad for t in ts)))


def _paper_ref(A1, A2, A3, X, Y, dO, scale):
    """The paper's definitions (paper_reference, 2-D) per batch element; dX, dY summed."""
    n, d = A1.shape[-2:]
    flat = [t.reshape(-1, n, d) for t in (A1, A2, A3, dO)]
    out = {k: [] for k in GRADS}
    for a1, a2, a3, do in zip(*flat):
        g = paper_gradients(a1, a2, a3, X, Y, do, scale=scale)
        for k in GRADS:
            out[k].append(g[k])
    res = {k: torch.stack(out[k]).sum(0) for k in ("dX", "dY")}
    res.update({k: torch.stack(out[k]).reshape(A1.shape) for k in ("dA1", "dA2", "dA3")})
    return res


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# (id, leading dims, n, d, M, scale, kernel, variant, num_splits)
CASES = [
    pytest.param((), 40, 16, 1024, 1.0, "small", None, 1, id="small-N40-D16-M1024"),
    pytest.param((2,), 31, 24, 1024, 24 ** -0.5, "small", None, 1, id="small-B2-N31-D24-M1024-scaled"),
    pytest.param((1, 2), 50, 32, 4096, 1.0, "small", None, 1, id="small-B1H2-N50-D32-M4096"),
    pytest.param((), 5, 12, 1024, 1.0, "small", None, 1, id="small-N5-D12-tiny"),
    pytest.param((), 5, 12, 3072, 1.0, "large", "faithful", 1, id="faithful-N5-D12-tiny"),
    pytest.param((), 5, 12, 3072, 1.0, "large", "fa2", 1, id="fa2-N5-D12-tiny"),
    pytest.param((), 40, 16, 2592, 1.0, "large", "faithful", 1, id="faithful-N40-D16-Mmin"),
    pytest.param((2,), 45, 24, 8192, 24 ** -0.5, "large", "faithful", 3, id="faithful-B2-N45-D24-M8192-split3"),
    pytest.param((), 70, 32, 32768, 1.0, "large", "faithful", 1, id="faithful-N70-D32-M32768-Br_capped"),
    pytest.param((), 40, 16, 2080, 1.0, "large", "fa2", 1, id="fa2-N40-D16-Mmin"),
    pytest.param((2,), 45, 24, 8192, 24 ** -0.5, "large", "fa2", 1, id="fa2-B2-N45-D24-M8192-scaled"),
    pytest.param((), 20, 128, 12832, 1.0, "large", "fa2", 1, id="fa2-N20-D128-M12832-below_d2"),
]


@functools.lru_cache(maxsize=None)
def _run(batch, n, d, M, scale, kernel, variant, num_splits):
    A1, A2, A3, X, Y, dO = _inputs(batch, n, d)
    with IOCounter() as fwd_io:
        O, lse = dense.forward(A1, A2, A3, X, Y, scale=scale, M=max(M, 4096))
    with IOCounter() as io:
        if kernel == "small":
            grads = dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=M, scale=scale)
        else:
            grads = dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, scale=scale,
                                               variant=variant, num_splits=num_splits)
    return (A1, A2, A3, X, Y, dO), (O, lse), grads, fwd_io.report, io.report


@pytest.mark.parametrize("batch, n, d, M, scale, kernel, variant, num_splits", CASES)
def test_gradients_match_float64_references(batch, n, d, M, scale, kernel, variant, num_splits):
    (A1, A2, A3, X, Y, dO), _, grads, _, _ = _run(batch, n, d, M, scale, kernel, variant, num_splits)
    _, auto = _autograd_ref(A1, A2, A3, X, Y, dO, scale)
    paper = _paper_ref(A1, A2, A3, X, Y, dO, scale)
    for k in GRADS:
        got = getattr(grads, k)
        assert got.shape == auto[k].shape and got.dtype == torch.float32, k
        assert torch.isfinite(got).all(), k
        assert _rel(got, paper[k]) <= TOL_FP32, (k, _rel(got, paper[k]))
        assert _rel(got, auto[k]) <= TOL_FP32, (k, _rel(got, auto[k]))
        assert _rel(paper[k], auto[k]) <= 1e-12, k  # the two references agree


@pytest.mark.parametrize("batch, n, d, M, scale, kernel, variant, num_splits", CASES)
def test_counted_traffic_equals_model(batch, n, d, M, scale, kernel, variant, num_splits):
    _, _, _, fwd_counted, counted = _run(batch, n, d, M, scale, kernel, variant, num_splits)
    Z = math.prod(batch)
    if kernel == "small":
        predicted = traffic.small_cache_traffic(n, d, M, batch=Z)
    else:
        predicted = traffic.large_cache_traffic(n, d, M, batch=Z, variant=variant, num_splits=num_splits)
        # Algorithm 9 never stores or reads an n x n matrix
        assert not set(counted.per_tensor()) & {"f", "q", "p", "T"}
    assert counted.total_bytes > 0
    assert counted == predicted, f"\n{counted}\n{predicted}"
    assert fwd_counted == forward_traffic(n, d, max(M, 4096), batch=Z)


def _check_paper_forward(O, lse, A1, A2, A3, X, Y, scale):
    """``(O, lse)`` of batched ``A1, A2, A3 [*batch, n, d]`` against the paper's forward, one batch element at a
    time (fp32 tolerance)."""
    n, d = A1.shape[-2:]
    flat = [t.reshape(-1, n, d) for t in (A1, A2, A3)]
    for z, (a1, a2, a3) in enumerate(zip(*flat)):
        O_ref, l_ref = paper_forward(a1, a2, a3, X, Y, scale=scale)
        assert _rel(O.reshape(-1, n, d)[z], O_ref) <= TOL_FP32
        assert _rel(lse.reshape(-1, n)[z], torch.log(l_ref)) <= TOL_FP32


@pytest.mark.parametrize("batch, n, d, M, scale", [
    pytest.param((), 40, 16, 4096, 1.0, id="N40-D16"),
    pytest.param((2,), 45, 24, 4096, 24 ** -0.5, id="B2-N45-D24-scaled"),
])
def test_forward_matches_paper_forward(batch, n, d, M, scale):
    A1, A2, A3, X, Y, _ = _inputs(batch, n, d, seed=1)
    O, lse = dense.forward(A1, A2, A3, X, Y, scale=scale, M=M)
    assert O.shape == A1.shape and lse.shape == A1.shape[:-1] and lse.dtype == torch.float32
    _check_paper_forward(O, lse, A1, A2, A3, X, Y, scale)


def test_large_scores_do_not_overflow():
    """Scores above 100 (the paper's exp without the row max would overflow fp32): finite, correct."""
    A1, A2, A3, X, Y, dO = _inputs((), 40, 16, seed=2)
    A1 = A1 * 60.0
    O, lse = dense.forward(A1, A2, A3, X, Y, M=4096)
    max_score = float((A1.double() @ X.double() @ A2.double().T).abs().max())
    assert max_score > 100  # exp(89) already overflows fp32
    _, auto = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    for grads in (dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=1024),
                  dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=2080, variant="fa2")):
        for k in GRADS:
            assert torch.isfinite(getattr(grads, k)).all()
            assert _rel(getattr(grads, k), auto[k]) <= 1e-4, k


@pytest.mark.parametrize("kernel", ["small", "faithful", "fa2"])
def test_bf16_within_3x_of_same_precision_baseline(kernel):
    """bf16 inputs: error vs float64 at most 3x that of PyTorch's bf16 autograd of the same formula."""
    A1, A2, A3, X, Y, dO = _inputs((), 40, 16, dtype=torch.bfloat16, seed=3)
    _, ref = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    ts = [t.clone().requires_grad_(True) for t in (A1, A2, A3, X, Y)]
    (torch.softmax(ts[0] @ ts[3] @ ts[1].T, -1) @ (ts[2] @ ts[4])).backward(dO)
    base = dict(zip(("dA1", "dA2", "dA3", "dX", "dY"), (t.grad for t in ts)))
    if kernel == "small":
        grads = dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=1024)
    else:
        O, lse = dense.forward(A1, A2, A3, X, Y, M=4096)
        grads = dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=4096, variant=kernel)
    for k in GRADS:
        got = getattr(grads, k)
        assert got.dtype == torch.bfloat16
        assert _rel(got, ref[k]) <= 3 * _rel(base[k], ref[k]) + 1e-3, (k, _rel(got, ref[k]), _rel(base[k], ref[k]))


def test_backward_is_deterministic():
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16, seed=4)
    O, lse = dense.forward(A1, A2, A3, X, Y, M=4096)
    for run in (lambda: dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=1024),
                lambda: dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=2592, num_splits=2)):
        a, b = run(), run()
        for k in GRADS:
            assert torch.equal(getattr(a, k), getattr(b, k)), k


# --------------------------------------------------------------------------- small-cache forward (Saha & Ye)
FWD_SMALL = [
    pytest.param((), 40, 16, 1024, 1.0, id="N40-D16-M1024"),
    pytest.param((2,), 31, 24, 1024, 24 ** -0.5, id="B2-N31-D24-M1024-scaled"),
    pytest.param((1, 2), 50, 32, 4096, 1.0, id="B1H2-N50-D32-M4096"),
    pytest.param((), 5, 12, 1024, 1.0, id="N5-D12-tiny"),
    pytest.param((), 70, 48, 1024, 1.0, id="N70-D48-d_not_pow2-B16"),
]


@pytest.mark.parametrize("batch, n, d, M, scale", FWD_SMALL)
def test_small_cache_forward_counted_equals_model_and_matches_reference(batch, n, d, M, scale):
    """The small-cache forward: O and lse against the paper's float64 forward; its counted traffic
    equals traffic.small_forward_traffic exactly (integer equality); no tile exceeds M."""
    A1, A2, A3, X, Y, _ = _inputs(batch, n, d, seed=6)
    with IOCounter() as io:
        O, lse = dense.forward(A1, A2, A3, X, Y, scale=scale, M=M, regime="small")
    Z = math.prod(batch)
    predicted = traffic.small_forward_traffic(n, d, M, batch=Z)
    assert io.report == predicted, f"\n{io.report}\n{predicted}"
    assert set(io.report.kernels) == {"fwd.small.S", "fwd.small.f", "fwd.small.h", "fwd.small.O"}
    B = dense.small_cache_block(M)
    for k in ("small.matmul", "small.softmax"):
        assert dense.working_set_words(k, d, B=B) <= M
    _check_paper_forward(O, lse, A1, A2, A3, X, Y, scale)


def test_small_cache_forward_feeds_the_large_cache_backward():
    """lse from the small-cache forward is the statistic the large-cache backward reads."""
    A1, A2, A3, X, Y, dO = _inputs((), 33, 16, seed=7)
    O, lse = dense.forward(A1, A2, A3, X, Y, M=1024, regime="small")
    O2, lse2 = dense.forward(A1, A2, A3, X, Y, M=4096, regime="large")
    assert _rel(O, O2) <= TOL_FP32 and _rel(lse, lse2) <= TOL_FP32
    g = dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=2080, variant="fa2")
    _, auto = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    for k in GRADS:
        assert _rel(getattr(g, k), auto[k]) <= TOL_FP32, k


def test_small_cache_forward_bf16_and_large_scores():
    A1, A2, A3, X, Y, _ = _inputs((), 40, 16, dtype=torch.bfloat16, seed=8)
    O, lse = dense.forward(A1, A2, A3, X, Y, M=1024, regime="small")
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    O_ref, _ = paper_forward(A1.double(), A2.double(), A3.double(), X.double(), Y.double())
    ts = [t.clone() for t in (A1, A2, A3, X, Y)]
    base = torch.softmax(ts[0] @ ts[3] @ ts[1].T, -1) @ (ts[2] @ ts[4])
    assert _rel(O, O_ref) <= 3 * _rel(base, O_ref) + 1e-3
    A1b, A2b, A3b, Xb, Yb, _ = _inputs((), 40, 16, seed=2)
    O, lse = dense.forward(A1b * 60.0, A2b, A3b, Xb, Yb, M=1024, regime="small")   # scores > 100
    assert torch.isfinite(O).all() and torch.isfinite(lse).all()
    O_ref, l_ref = paper_forward(A1b * 60.0, A2b, A3b, Xb, Yb)
    assert _rel(O, O_ref) <= 1e-4
