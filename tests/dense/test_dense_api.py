"""sparse_io_attn.dense public API: the autograd Function, regime choice, tile sizes and working
sets, and the errors a user can act on."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_io_attn import dense
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.bounds import DEFAULT_CPU_FAST_MEMORY_BYTES
from sparse_io_attn.dense import tiles


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


@pytest.mark.parametrize("M, regime, expect", [
    pytest.param(1024, "auto", "small", id="M1024-auto-small_only_fits"),
    pytest.param(8192, "large", "large", id="M8192-large"),
    pytest.param(8192, "auto", None, id="M8192-auto-argmin"),
])
def test_attention_autograd_uses_the_chosen_kernel(M, regime, expect):
    A1, A2, A3, X, Y, dO = _inputs((2,), 30, 32)
    if expect is None:   # auto: the family of choose_backward's pick (forward outputs given)
        expect = dense.choose_backward(30, 32, M, batch=2).regime
    leaves = [t.clone().requires_grad_(True) for t in (A1, A2, A3, X, Y)]
    with IOCounter() as io:
        O = dense.attention(*leaves, M=M, regime=regime, scale=32 ** -0.5)
        O.backward(dO)
    O_ref, grads_ref = _autograd_ref(A1, A2, A3, X, Y, dO, 32 ** -0.5)
    assert _rel(O.detach(), O_ref) <= 1e-5
    for leaf, ref in zip(leaves, grads_ref):
        assert _rel(leaf.grad, ref) <= 1e-5
    assert _kernel_family(io.report) == {"fwd", expect}


def test_backward_default_M_and_forward_on_demand():
    """M=None on CPU: DEFAULT_CPU_FAST_MEMORY_BYTES / 4 words; auto runs the argmin (at n = 20 the
    small-cache kernel: its n x n buffers are tiny); a forced large-cache backward computes O and lse
    first when they are not given."""
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16, seed=1)
    M = dense.default_M(torch.float32)
    assert M == DEFAULT_CPU_FAST_MEMORY_BYTES // 4
    choice = dense.backward_choice(A1, dO, None)
    assert choice.includes_forward and choice.kernel == "small"
    _, ref = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    for regime, families in (("auto", {"small"}), ("large", {"fwd", "large"})):
        with IOCounter() as io:
            g = dense.backward(A1, A2, A3, X, Y, dO, regime=regime)
        assert _kernel_family(io.report) == families
        for got, want in zip((g.dA1, g.dA2, g.dA3, g.dX, g.dY), ref):
            assert _rel(got, want) <= 1e-5


def test_regime_forced_small_at_large_M():
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16, seed=2)
    with IOCounter() as io:
        dense.backward(A1, A2, A3, X, Y, dO, M=1 << 16, regime="small")
    assert _kernel_family(io.report) == {"small"}


# --------------------------------------------------------------------------- auto = fewest predicted bytes
def test_auto_picks_large_cache_at_h100_fp32_d256():
    """H100's 227 KiB in fp32 at d = 256: M = 58,112 = 0.89 d^2, the paper's small-cache regime, but
    the FA2-order large-cache backward moves fewer bytes (1.7x over all five gradients, 2.0x on the
    dX path); Algorithm 9 as written does not fit there."""
    M = DEFAULT_CPU_FAST_MEMORY_BYTES // 4
    c = dense.choose_backward(8192, 256, M, dtype=torch.float32)
    assert (c.paper_regime, c.kernel, c.variant) == ("small", "large-fa2", "fa2")
    assert dense.choose_regime(256, M) == "small"                        # the paper's split, unchanged
    assert not c.candidates["large-faithful"]["feasible"]
    ratio = c.candidates["small"]["bytes"] / c.predicted_bytes
    assert ratio == pytest.approx(1.72, abs=0.01)
    assert c.summary() == ("paper regime: small; kernel chosen: large-cache FA2 order, 1.7x fewer bytes than "
                           "small-cache")
    from sparse_io_attn.dense import traffic
    g = [traffic.small_cache_traffic(8192, 256, M, g_only=True).total_bytes,
         traffic.large_cache_traffic(8192, 256, M, variant="fa2", g_only=True).total_bytes]
    assert g[0] / g[1] == pytest.approx(1.98, abs=0.01)
    f = dense.choose_forward(8192, 256, M, dtype=torch.float32)
    assert (f.paper_regime, f.kernel) == ("small", "large")


@pytest.mark.parametrize("d", [128, 256])
def test_auto_picks_small_cache_at_a_tenth_of_d2(d):
    M = d * d // 10
    for c in (dense.choose_backward(8192, d, M), dense.choose_forward(8192, d, M)):
        assert c.kernel == "small" and c.paper_regime == "small"


def test_auto_follows_the_bytes_not_the_paper():
    """A100 fp32, d = 256 (M = 0.64 d^2): here the small-cache backward is the cheaper one (1.1x)."""
    c = dense.choose_backward(8192, 256, 163 * 1024 // 4)
    assert c.kernel == "small" and c.bytes_of("small") < c.bytes_of("large-fa2")


_GRID = [(n, d, M, dt) for n in (64, 1000, 8192) for d in (16, 64, 128, 256)
         for M in (1024, 3000, 12832, 25120, 58112, 116224, 1 << 20) for dt in (torch.float32, torch.bfloat16)]


def test_auto_is_the_argmin_among_feasible_kernels():
    """Over a grid of (n, d, M, dtype): auto takes the feasible candidate with the fewest predicted
    bytes; feasible = the traffic model (hence the kernels) can tile M; bytes = the model's total."""
    from sparse_io_attn.dense import traffic
    from sparse_io_attn.dense.regime import forward_traffic
    checked = 0
    for n, d, M, dt in _GRID:
        for with_forward in (False, True):
            c = dense.choose_backward(n, d, M, dtype=dt, with_forward=with_forward)
            fwd = dense.choose_forward(n, d, M, dtype=dt)
            feas = {k: v["bytes"] for k, v in c.candidates.items() if v["feasible"]}
            assert c.kernel in feas and c.predicted_bytes == min(feas.values())
            for k, v in c.candidates.items():
                try:
                    b = (traffic.small_cache_traffic(n, d, M, dtype=dt) if k == "small" else
                         traffic.large_cache_traffic(n, d, M, dtype=dt, variant=k.split("-")[1])).total_bytes
                except ValueError:
                    b = None
                assert v["feasible"] == (b is not None), (n, d, M, k)
                if b is not None:
                    extra = fwd.predicted_bytes if with_forward and k != "small" else 0
                    assert v["bytes"] == b + extra
            checked += 1
        ffeas = {k: v["bytes"] for k, v in fwd.candidates.items() if v["feasible"]}
        assert fwd.predicted_bytes == min(ffeas.values())
        assert forward_traffic(n, d, M, dtype=dt).total_bytes == fwd.predicted_bytes
    assert checked == 2 * len(_GRID)


def test_auto_respects_memory_and_variant():
    big = dense.choose_backward(65536, 256, 58112, memory_bytes=10 ** 9)   # f, q, p need 51.6 GB
    assert not big.candidates["small"]["feasible"] and big.kernel == "large-fa2"
    assert "need" in big.candidates["small"]["why"]
    only = dense.choose_backward(8192, 128, 1 << 17, variant="faithful")
    assert only.kernel == "large-faithful" and not only.candidates["large-fa2"]["feasible"]
    with pytest.raises(ValueError, match="no backward kernel fits"):
        dense.choose_backward(8192, 256, 2048, memory_bytes=1000)
    with pytest.raises(ValueError, match="no forward kernel fits"):
        dense.choose_forward(64, 16, 512)
    forced = dense.choose_backward(8192, 256, 58112, regime="large")
    assert forced.forced and forced.kernel == "large-faithful" and forced.predicted_bytes is None
    assert "forced" in forced.summary()


@pytest.mark.parametrize("n, d, M", [
    pytest.param(20, 24, 4096, id="N20-D24-M4096-fwd_small-bwd_fa2"),
    pytest.param(8, 16, 2592, id="N8-D16-M2592-bwd_faithful"),
    pytest.param(40, 16, 1024, id="N40-D16-M1024-small_only"),
    pytest.param(64, 32, 4096, id="N64-D32-M4096-fwd_large-bwd_fa2"),
])
def test_auto_runs_the_chosen_kernel_and_moves_the_predicted_bytes(n, d, M):
    """dense.forward / dense.backward with regime="auto": the launched kernels are the chosen ones
    and their counted bytes equal the choice's prediction exactly."""
    A1, A2, A3, X, Y, dO = _inputs((), n, d, seed=5)
    fc = dense.choose_forward(n, d, M)
    expect = {(20, 4096): ("small", "large-fa2"), (8, 2592): ("large", "large-faithful"),
              (40, 1024): ("small", "small"), (64, 4096): ("large", "large-fa2")}[(n, M)]
    assert (fc.kernel, dense.choose_backward(n, d, M).kernel) == expect
    with IOCounter() as fio:
        O, lse = dense.forward(A1, A2, A3, X, Y, M=M)
    assert fio.report.total_bytes == fc.predicted_bytes
    assert any(k.startswith("fwd.small") for k in fio.report.kernels) == (fc.kernel == "small")
    bc = dense.choose_backward(n, d, M)
    with IOCounter() as bio:
        g = dense.backward(A1, A2, A3, X, Y, dO, O, lse, M=M)
    assert bio.report.total_bytes == bc.predicted_bytes
    names = set(bio.report.kernels)
    assert {"small": "small.phase1.f", "large-faithful": "large.phase2", "large-fa2": "large.dq"}[bc.kernel] in names
    _, ref = _autograd_ref(A1, A2, A3, X, Y, dO, 1.0)
    for got, want in zip((g.dA1, g.dA2, g.dA3, g.dX, g.dY), ref):
        assert _rel(got, want) <= 1e-5


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
            for k in tiles.large_cache_kernels(variant):
                dense.large_cache_blocks(k, m, d)
            with pytest.raises(ValueError):
                for k in tiles.large_cache_kernels(variant):
                    dense.large_cache_blocks(k, m - tiles.MIN_BLOCK, d)


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
        for k in tiles.SMALL_KERNELS:
            assert dense.working_set_words(k, d, B=B) <= M
        for k in tiles.LARGE_KERNELS:
            try:
                long, short = dense.large_cache_blocks(k, M, d)
            except ValueError:
                continue
            ran += 1
            assert dense.working_set_words(k, d, long=long, short=short) <= M, (k, M, long, short)
            assert short <= long <= M / (4 * d) and short <= max(d, tiles.MIN_BLOCK)
            assert long >= tiles.MIN_BLOCK and short >= tiles.MIN_BLOCK
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
    from sparse_io_attn.dense import buffers
    monkeypatch.setattr(buffers, "available_memory_bytes", lambda device: (1000, "test"))
    A1, A2, A3, X, Y, dO = _inputs((), 20, 16)
    need = buffers.nn_buffer_bytes(20, 16)
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
    with pytest.raises(ValueError, match="regime"):
        dense.forward(A1, A2, A3, X, Y, M=4096, regime="medium")
    with pytest.raises(ValueError, match="variant"):
        dense.attention(A1, A2, A3, X, Y, M=4096, variant="fa3")
    with pytest.raises(ValueError, match="both O and lse"):
        dense.backward(A1, A2, A3, X, Y, dO, O=A1, M=8192, regime="large")
