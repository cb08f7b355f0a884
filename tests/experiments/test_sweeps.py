"""experiments.sweeps: the numbers behind ``sparse-io-attn sweep`` (the CLI's own tests run the commands)."""
import pytest

from sparse_io_attn.dense.buffers import nn_buffer_bytes
from sparse_io_attn.experiments import figure1
from sparse_io_attn.experiments import sparsity_stress, sweeps


@pytest.mark.parametrize("count_n", [0, 32], ids=["model-only", "counted"])
def test_cache_plan_steps_match_the_progress_calls(count_n):
    """``cache_plan``'s step count is exactly how often ``cache_sweep`` reports progress."""
    d = 32
    Ms, count_Ms, steps = sweeps.cache_plan(d, d * d // 4, 4 * d * d, 1, count_n, 4096)
    assert Ms == figure1.cache_grid(d, d * d // 4, 4 * d * d, 1)
    assert (count_Ms == []) == (count_n == 0)
    calls = []
    rows, crossings, notes = sweeps.cache_sweep(128, d, Ms, count_n, count_Ms, progress=calls.append)
    assert len(calls) == steps
    assert [r["M"] for r in rows] == Ms
    assert crossings == figure1.crossings(128, d)
    assert notes[-len(figure1.crossing_lines(crossings, d)):] == figure1.crossing_lines(crossings, d)


def test_dim_sweep_steps_and_one_device_row_per_d():
    calls = []
    rows, notes = sweeps.dim_sweep(256, [32, 64], 16384, progress=lambda *a, **k: calls.append(1))
    assert len(calls) == sweeps.dim_steps([32, 64])
    assert sorted(r["d"] for r in rows if r["at_device_M"]) == [32, 64]
    assert any(line.startswith("d=32: device M/d^2 = ") for line in notes)


def test_sparsity_sweep_passes_the_stress_rows_through():
    rows, notes = sweeps.sparsity_sweep(256, 32, densities=[0.25, 1.0], axes=("A",), block_n=64, block_d=16,
                                        count=False)
    want = sparsity_stress.sparsity_sweep(256, 32, densities=(0.25, 1.0), axes=("A",))
    assert rows == want
    assert notes == sweeps.sparsity_findings(want)
    sparsest = min(rows, key=lambda r: r["density"])
    assert sweeps.lemma_f2_kept_term(sparsest) == (sparsest["Z_AX"] + sparsest["Z_A"]) ** 2 / sparsest["M_words"]
    assert any("Lemma F.2 drops nnz(A1 X)" in line for line in notes)


@pytest.mark.parametrize("n,head_dim,heads", [(384, 64, 2), (1000, 48, 3)])
def test_small_cache_need_is_the_kernels_buffers(n, head_dim, heads):
    assert sweeps.small_cache_need(n, head_dim, heads) == int(nn_buffer_bytes(n, head_dim, heads))
