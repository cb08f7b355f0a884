"""The small-cache forward on the executor (Table 1, Saha & Ye), and the executor's exact counts
against the lower bounds: never below a bound that is proven for the run (constant >= 1), with the
measured ratios to the unit-constant bounds per regime (benchmarks/results/pebble_bounds.md)."""
import numpy as np
import pytest
import torch

from sparse_io_attn.bounds import dense_forward
from sparse_io_attn.experiments import pebble
from sparse_io_attn.experiments.pebble import versus_bounds
from sparse_io_attn.experiments.slopes import loglog_slope
from sparse_io_attn.experiments import figure1
from sparse_io_attn.dense.reference import paper_forward

CONFIGS = [pytest.param(*c, id=f"n{c[0]}-d{c[1]}-M{c[2]}") for c in versus_bounds.SMALL_TEST_CONFIGS + versus_bounds.LARGE_TEST_CONFIGS]


def _inputs(n, d):
    A1, A2, A3 = (torch.randn(n, d, dtype=torch.float64) for _ in range(3))
    X, Y = torch.randn(d, d, dtype=torch.float64) / d, torch.randn(d, d, dtype=torch.float64)
    return A1, A2, A3, X, Y


@pytest.mark.parametrize("n,d,M", CONFIGS)
def test_small_cache_forward_executor(n, d, M):
    """O against the float64 reference; reads, writes and peak equal the closed form; fits M."""
    A1, A2, A3, X, Y = _inputs(n, d)
    run = pebble.run_small_cache_forward(A1, A2, A3, X, Y, M)
    O, _ = paper_forward(A1, A2, A3, X, Y)
    assert np.linalg.norm(run.g - O.numpy()) <= 1e-10 * np.linalg.norm(O.numpy())
    c = pebble.small_forward_counts(n, d, M)
    assert (run.reads, run.writes, run.peak) == (c.reads, c.writes, c.peak) and run.peak <= M
    assert run.writes_by_array == {"S": n * d, "A": n * n, "l": n, "f": n * n, "h": n * d, "O": n * d}


def test_small_cache_forward_slope():
    """M < d^2: the forward less its M-independent 3n^2 + 3nd + n words falls as M^(-1/2)."""
    n, d = 512, 64
    Ms = [4 * b * b for b in (1, 2, 4, 8, 16)]
    ys = [pebble.small_forward_io(n, d, M) - pebble.small_forward_m_independent(n, d) for M in Ms]
    assert loglog_slope(Ms, ys) == pytest.approx(-0.5, abs=1e-3)


@pytest.mark.parametrize("n,d,M", CONFIGS)
def test_executor_runs_respect_the_proven_bounds(n, d, M):
    """Every algorithm, run on the executor at the five small-cache and five large-cache test
    configurations, moves at least the proven floor (compulsory traffic and the Kwasniewski-derived
    2(n^2 d + n d^2)/sqrt(C) + nd at the capacity C it used) and so at least Theorem 1.1 / Saha & Ye
    with unit constants at C."""
    inputs = _inputs(n, d)
    dO = torch.randn(n, d, dtype=torch.float64)
    runs = {"alg6": pebble.run_small_cache(*inputs, dO, M), "alg9": pebble.run_large_cache(*inputs, dO, M),
            "alg9_fa2": pebble.run_large_cache(*inputs, dO, M, variant="fa2"),
            "fwd_small": pebble.run_small_cache_forward(*inputs, M)}
    for alg, run in runs.items():
        r = versus_bounds.row(alg, n, d, M)
        assert run.total == r["words"] and run.capacity == r["capacity"], alg
        assert versus_bounds.check(r) == [], versus_bounds.check(r)
        assert run.total >= r["proven_floor"] >= 2 * r["bound_at_capacity"] - 1e-9 * r["bound_at_capacity"]
        assert run.total >= r["compulsory"]


def _grid():
    pts = [(2048, 128, M) for M in figure1.cache_grid(128, 1024, 16 * 128 * 128, 2)]   # sweep cache's grid
    pts += [(n, 64, M) for n in (512, 4096) for M in figure1.executor_points(64)]       # pebble_figure1's
    return pts


def test_sweep_grid_respects_the_proven_bounds():
    rows = versus_bounds.rows(_grid())
    assert len(rows) == 4 * 39
    bad = [b for r in rows for b in versus_bounds.check(r)]
    assert bad == []
    assert min(r["ratio_to_floor"] for r in rows) > 1


def test_measured_constants_per_regime():
    """The constants the paper leaves open, measured (benchmarks/results/pebble_bounds.md): on the
    sweep grid the best backward algorithm sits 13-45x above Theorem 1.1 with unit constants at the
    capacity it used (8-94x at the nominal M), the small-cache forward 8.5-12x above Saha & Ye for
    M < d^2."""
    s = versus_bounds.regime_summary(versus_bounds.rows(_grid()))
    assert s[("best backward", "small")]["min_at_capacity"] == pytest.approx(13.04, abs=0.01)
    assert s[("best backward", "large")]["min_at_capacity"] == pytest.approx(17.59, abs=0.01)
    assert s[("fwd_small", "small")]["min_at_capacity"] == pytest.approx(8.51, abs=0.01)
    # Algorithm 9 overfills M: measured against the nominal M its ratio is lower (not a proven bound there)
    assert s[("alg9", "large")]["min_at_M"] < s[("alg9", "large")]["min_at_capacity"]
    assert all(v["min_at_capacity"] > 1 for v in s.values())


def test_forward_bound_is_saha_ye():
    r = versus_bounds.row("fwd_small", 2048, 128, 4096)
    assert r["bound_at_M"] == dense_forward(2048, 128, 4096, form="paper").value_words
    with pytest.raises(ValueError, match="alg"):
        versus_bounds.counts("alg7", 8, 4, 16)
