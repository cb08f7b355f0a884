"""sparse_io_attn.dense public API: the autograd Function, regime choice, tile sizes and working
sets, and the errors a user can act on."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_io_attn import dense
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.bounds import DEFAULT_CPU_FAST_MEMORY_BYTES
from sparse_io_attn.dense import tiling


def _inputs(batch, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(*batch, n, d) * 0.5, r(*batch, n, d) * 0.5, r(*batch, n, d) * 0.5,
            r(d, d) / math.sqrt(d), r(d, d) / math.sqrt(d), r(*batch, n, d))


def _autograd_ref(A1, A2, A3, X, Y, dO, scale):
    ts = [t.double().requires_grad_(True) for t in (A1, A2, A3, X, Y)]
    O = torch.softmax(scale * (ts[0] @ ts[3] @ ts[1].transpose(-1, -2)), -1) @ (ts[2] @ ts[4])
    O.backward(dO.double())
    return O.detach(), [t.grad for t in ts]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _kernel_family(report) -> set:
    return {name.split(".")[0] for name in report.kernels}


@pytest.mark.parametrize("M, expect", [
    pytest.param(1024, "small", id="M1024-small"),
    pytest.param(8192, "large", id="M8192-large"),
])
def test_attention_autograd_uses_the_regimes_kernel(M, expect):
    A1, A2, A3, X, Y, dO = _inputs((2,), 30, 32)
    leaves = [t.clone().requires_grad_(True) for t in (A1, A2, A3, X, Y)]
    with IOCounter() as io:
        O = dense.attention(*leaves, M=M, scale=32 ** -0.5)
        O.backward(dO)
    O_ref, grads_ref = _autograd_ref(A1, A2, A3, X, Y, dO, 32 ** -0.5)
    assert _rel(O.detach(), O_ref) <= 1e-5
    for leaf, ref in zip(leaves, grads_ref):
        assert _rel(leaf.grad, ref) <= 1e-5
    assert _kernel_family(io.report) == {"fwd", expect}


def test_backward_default_M_and_forward_on_demand():
    """M=None on CPU: DEFAULT_CPU_FAST_MEMORY_BYTES / 4 words (large regime for d=16); O and lse are
    computed when not given."""
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16, seed=1)
    assert dense.default_M(torch.float32) == DEFAULT_CPU_FAST_MEMORY_BYTES // 4
    with IOCounter() as io:
        g = dense.backward(A1, A2, A3, X, Y, dO)
    assert _kernel_family(io.report) == {"fwd", "large"}
    _, ref = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    for got, want in zip((g.dA1, g.dA2, g.dA3, g.dX, g.dY), ref):
        assert _rel(got, want) <= 1e-5


def test_regime_forced_small_at_large_M():
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16, seed=2)
    with IOCounter() as io:
        dense.backward(A1, A2, A3, X, Y, dO, M=1 << 16, regime="small")
    assert _kernel_family(io.report) == {"small"}


@pytest.mark.parametrize("d, M, variant, expect", [
    pytest.param(256, 65535, "faithful", "small", id="d256-below_d2"),
    pytest.param(256, 65536, "faithful", "small", id="d256-at_d2-faithful_does_not_fit"),
    pytest.param(256, 94752, "faithful", "large", id="d256-faithful_min"),
    pytest.param(256, 65536, "fa2", "large", id="d256-at_d2-fa2"),
    pytest.param(128, 1 << 15, "faithful", "large", id="d128-2d2"),
    pytest.param(32, 1023, "faithful", "small", id="d32-below_d2"),
])
def test_choose_regime(d, M, variant, expect):
    assert dense.choose_regime(d, M, "auto", variant) == expect


def test_min_large_cache_M_is_tight():
    for d in (8, 12, 16, 24, 32, 128, 256):
        for variant in ("faithful", "fa2"):
            m = dense.min_large_cache_M(d, variant)
            for k in tiling.large_cache_kernels(variant):
                dense.large_cache_blocks(k, m, d)
            with pytest.raises(ValueError):
                for k in tiling.large_cache_kernels(variant):
                    dense.large_cache_blocks(k, m - tiling.MIN_BLOCK, d)


# every M the dense tests use (test_dense_kernels.py, this file) and the Figure-1 sweep
_TEST_MS = sorted({1024, 2048, 2080, 2592, 3072, 4096, 8192, 12832, 32768, 65536, 94752} | {1 << k for k in range(10, 22)})


@pytest.mark.parametrize("d", [8, 12, 16, 24, 32, 128, 256])
def test_working_sets_fit_M(d):
    """Each kernel's declared per-program working set (words) is <= M for every M it runs at, and
    the tiles follow the paper: B = pow2 <= sqrt(M/4); B_r <= B_c <= M/(4d), B_r <= d."""
    ran = 0
    for M in _TEST_MS:
        B = dense.small_cache_block(M)
        assert 4 * B * B <= M < 16 * (4 * B * B) and B & (B - 1) == 0
        for k in tiling.SMALL_KERNELS:
            assert dense.working_set_words(k, d, B=B) <= M
        for k in tiling.LARGE_KERNELS:
            try:
                long, short = dense.large_cache_blocks(k, M, d)
            except ValueError:
                continue
            ran += 1
            assert dense.working_set_words(k, d, long=long, short=short) <= M, (k, M, long, short)
            assert short <= long <= M / (4 * d) and short <= max(d, tiling.MIN_BLOCK)
            assert long >= tiling.MIN_BLOCK and short >= tiling.MIN_BLOCK
    assert ran > 0


def test_large_cache_tiles_grow_with_M():
    """B_c doubles with M once the working set allows it (the source of the 1/M scaling), and the
    faithful row block stops at d."""
    d = 128
    longs = [dense.large_cache_blocks("large.dq", 1 << k, d)[0] for k in range(15, 21)]
    assert all(b == 2 * a for a, b in zip(longs, longs[1:]))
    shorts = [dense.large_cache_blocks("large.phase2", 1 << k, d)[1] for k in range(15, 22)]
    assert max(shorts) == d and shorts[-1] == d


@pytest.mark.parametrize("bad, match", [
    pytest.param(dict(M=1000), "at least 1024", id="M-too-small"),
    pytest.param(dict(M=0), "positive", id="M-zero"),
    pytest.param(dict(M=2048.0), "int", id="M-float"),
])
def test_small_cache_bad_M(bad, match):
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        dense.backward_small_cache(A1, A2, A3, X, Y, dO, **bad)


def test_small_cache_refuses_when_nn_buffers_do_not_fit(monkeypatch):
    from sparse_io_attn.dense import small_cache
    monkeypatch.setattr(small_cache, "available_memory_bytes", lambda device: (1000, "test"))
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16)
    need = small_cache.nn_buffer_bytes(20, 16)
    with pytest.raises(ValueError, match=f"{need:,} bytes"):
        dense.backward_small_cache(A1, A2, A3, X, Y, dO, M=1024)


def test_large_cache_bad_M_names_minimum():
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16)
    O, lse = dense.forward(A1, A2, A3, X, Y, M=4096)
    with pytest.raises(ValueError, match="too small for kernel 'large.phase2'.*at least"):
        dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=2048)
    with pytest.raises(ValueError, match="variant"):
        dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=4096, variant="fa3")
    with pytest.raises(TypeError, match="lse has dtype"):
        dense.backward_large_cache(A1, A2, A3, X, Y, dO, O, lse.double(), M=4096)


def test_input_errors():
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16)
    with pytest.raises(ValueError, match="A2 has shape"):
        dense.forward(A1, A2[:10], A3, X, Y)
    with pytest.raises(ValueError, match=r"X must be \[d, d\]"):
        dense.forward(A1, A2, A3, X[:8], Y)
    with pytest.raises(TypeError, match="share one dtype"):
        dense.forward(A1, A2, A3, X.double().float().to(torch.bfloat16), Y)
    with pytest.raises(TypeError, match="dtype"):
        dense.forward(A1.int(), A2, A3, X, Y)
    with pytest.raises(ValueError, match="dO must have shape"):
        dense.backward_small_cache(A1, A2, A3, X, Y, dO[:5], M=1024)
    with pytest.raises(ValueError, match="regime"):
        dense.backward(A1, A2, A3, X, Y, dO, M=4096, regime="medium")
    with pytest.raises(ValueError, match="both O and lse"):
        dense.backward(A1, A2, A3, X, Y, dO, O=A1, M=8192, regime="large")
