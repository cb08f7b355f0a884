"""The Theorem 4.5 sparsity stress test (sparse_io_attn.experiments.sparsity_stress): each pass of the
sparse-operand kernels above max(compulsory, bound) at n = 2048 (the traffic model, equal to the
counters: tests/sparse_operands/test_sparse_operands_attention.py), the sweep's rows and table, and a
counted point equal to the predicted one."""
import pytest

from sparse_io_attn.experiments.sparsity_stress import (AXES, COLUMNS, format_table, make_operands, sparsity_sweep,
                                                        stress_point)
from sparse_io_attn.layout.matrix import BlockSparseMatrix


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("density", [0.05, 0.3, 1.0])
def test_each_pass_is_above_compulsory_and_theorem_4_5_at_n2048(axis, density):
    """Theorems F.3 (forward) and F.4 (backward) bound each pass alone; the model (== counters)
    must sit above max(compulsory, bound) at M = the kernels' per-program fast memory."""
    r = stress_point(2048, 128, axis, density, seed=int(density * 100) + AXES.index(axis))
    assert r["source"] == "predicted"
    floor = max(r["compulsory_words"], r["bound_words"])
    assert r["bound_words"] > 0
    assert r["fwd_words"] >= floor and r["bwd_words"] >= floor, r
    assert r["fwd_ratio"] >= 1 and r["bwd_ratio"] >= 1


def test_sparser_qk_pattern_moves_fewer_bytes():
    totals = [stress_point(1024, 64, "QK", rho, seed=3)["total_words"] for rho in (0.1, 0.5, 1.0)]
    assert totals[0] < totals[1] < totals[2]


def test_sweep_rows_and_table():
    rows = sparsity_sweep(256, 64, densities=(0.25, 1.0), axes=("A", "X"))
    assert len(rows) == 4 and all(set(COLUMNS) <= set(r) for r in rows)
    assert [r["axis"] for r in rows] == ["A", "A", "X", "X"]
    A1 = make_operands(256, 64, 64, 16, "A", 0.25, seed=0)[0]
    assert isinstance(A1, BlockSparseMatrix) and A1.nnz_blocks < A1.num_block_rows * A1.num_block_cols
    table = format_table(rows)
    assert table.count("\n") == 5 and "| A | 0.25 | 256 | predicted |" in table


def test_counted_stress_point_equals_predicted():
    counted = stress_point(64, 32, "A", 0.5, block_n=16, count=True, seed=4)
    predicted = stress_point(64, 32, "A", 0.5, block_n=16, seed=4)
    assert counted["source"] == "counted" and predicted["source"] == "predicted"
    for k in ("fwd_words", "bwd_words", "index_bytes", "Z_A", "Z_AXA", "bound_words"):
        assert counted[k] == predicted[k], k
