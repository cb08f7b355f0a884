"""nnz_stats at a million tokens (against brute-forced smaller instances) and unchanged from the
implementation that expanded partial blocks to elements."""
import numpy as np
import pytest
import torch

from sparse_io_attn.block_sparse import traffic
from sparse_io_attn.bounds import nnz, nnz_stats
from sparse_io_attn.layout.patterns import from_spec


def _periodic(n: int):
    """Operands whose row patterns repeat with period 10 (A1) and 3 (A2): several distinct row
    patterns, none of them dense, at any ``n``."""
    a1 = np.zeros((n, 4))
    a1[0::2, 0] = 1.5
    a1[1::2, 1] = -2.0
    a1[::5, 2] = 1.0
    a2 = np.zeros((n, 4))
    a2[0::3, 0] = 1.0
    a2[1::3, 2] = 3.0
    a2[2::3, 3] = 1.0
    x = np.eye(4)
    x[3, 1] = 1.0
    return a1, x, a2


def _brute_z_axa(a1, x, a2, layout):
    """Z_AXA restricted to the layout from the dense boolean product and the element mask."""
    s = ((a1 != 0).astype(np.int64) @ (x != 0).astype(np.int64) @ (a2 != 0).T.astype(np.int64)) > 0
    return int((s & layout.to_dense_mask()[0, 0].numpy()).sum()), int(s.sum())


@pytest.mark.parametrize("spec,small,N", [
    pytest.param("sliding_window:512", (1440, 2880), 240 << 12, id="sliding_window512"),
    pytest.param("bigbird:100,1,2", (1440, 2880), 240 << 12, id="bigbird"),
])
def test_restricted_count_at_a_million_tokens_on_the_brute_force_line(spec, small, N):
    """Z_AXA under the layout is affine in N past the edges (periodic operands, a pattern of fixed
    width), so two brute-forced small instances fix it at ~1M tokens; the unrestricted count is
    exact from the periods. Lengths are multiples of the operands' period (30) and of the block."""
    (n1, n2), block = small, 48
    z1, z2 = (_brute_z_axa(*_periodic(n), from_spec(spec, n, block))[0] for n in small)
    a1, x, a2 = _periodic(N)
    st = nnz_stats(a1, x, a2, from_spec(spec, N, block))
    assert st.Z_AXA == z1 + (z2 - z1) * (N - n1) // (n2 - n1)
    assert (z2 - z1) * (N - n1) % (n2 - n1) == 0
    _, full_small = _brute_z_axa(*_periodic(30), from_spec(spec, 30, block))
    assert st.Z_AXA_unrestricted == full_small * (N // 30) ** 2


def test_dense_operands_count_the_layouts_kept_elements_at_a_million_tokens():
    """Dense operands: every product entry is nonzero, so Z_AXA is the layout's kept elements."""
    N, d = 1 << 20, 2
    layout = from_spec("sliding_window:512", N, 64)
    a = torch.randn(N, d)
    st = nnz_stats(a, torch.randn(d, d), a, layout)
    w = 512
    assert st.Z_AXA == traffic.kept_elements(layout, 1, 1) == N * (2 * w + 1) - w * (w + 1)
    assert (st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA_unrestricted) == (N * d, d * d, N * d, N * N)


def test_row_hash_collisions_fall_back_to_exact_grouping(monkeypatch):
    """With every row (and every block of row patterns) hashing alike, rows are still grouped
    exactly: the verification catches the collision."""
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item()))
    a1, x, a2 = ((rng.random(s) < 0.3) * 1.0 for s in ((90, 6), (6, 6), (70, 6)))
    layout = from_spec("sliding_window:20", (90, 70), 16)
    honest = nnz_stats(a1, x, a2, layout)
    monkeypatch.setattr(nnz, "_row_hashes", lambda m: np.zeros(m.shape[0], dtype=np.int64))
    monkeypatch.setattr(nnz, "_block_hashes", lambda b: np.zeros(b.shape[0], dtype=np.int64))
    assert nnz_stats(a1, x, a2, layout) == honest
    keep = np.zeros((90, 70), dtype=bool)
    keep[:] = layout.to_dense_mask()[0, 0].numpy()
    s = ((a1 @ x != 0).astype(int) @ (a2 != 0).T.astype(int)) > 0
    assert honest.Z_AXA == int((s & keep).sum())


# (spec, n, block, (Z_A, Z_X, Z_AX, Z_AXA, Z_AXA_unrestricted)) from the previous implementation,
# for the operands of _before_operands and the layout's last mask
BEFORE = [
    ("sliding_window:100", 1000, 16, (2393, 19, 4291, 163050, 853569)),
    ("sliding_window:37,causal", 517, (16, 48), (1233, 17, 2304, 16300, 230214)),
    ("bigbird:64,num_heads=2", 1000, 32, (2393, 19, 4291, 279619, 853569)),
    ("document:5", 777, 32, (1851, 23, 3904, 107555, 537643)),
    ("longformer:40", 600, 16, (1437, 14, 2151, 38507, 287147)),
    ("strided:48", 500, 16, (1196, 19, 2285, 43394, 217035)),
    ("fixed:64,8,causal", 640, 32, (1536, 19, 2920, 38216, 355204)),
    ("prefix_lm:77", 300, (32, 16), (696, 17, 1259, 40342, 75642)),
    ("random:0.3,heads=2", 400, 16, (972, 20, 1908, 42368, 140738)),
]


def _before_operands(n):
    rng = np.random.default_rng(7)
    a1 = (rng.random((n, 6)) < 0.4) * 1.0
    x = (rng.random((6, 6)) < 0.5) * 1.0
    a2 = (rng.random((n, 6)) < 0.4) * 1.0
    return a1, x, a2


@pytest.mark.parametrize("spec,n,block,expect", BEFORE, ids=[b[0] for b in BEFORE])
def test_nnz_stats_unchanged(spec, n, block, expect):
    layout = from_spec(spec, n, block)
    st = nnz_stats(*_before_operands(n), layout, layout_index=layout.num_layouts - 1)
    assert (st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA, st.Z_AXA_unrestricted) == expect


def test_sparse_pattern_table_and_small_chunks_count_the_same(monkeypatch):
    """The pattern table looked up through SciPy (past the dense-table size) and evaluated a few
    blocks at a time gives the same counts as the dense lookup and the brute force."""
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item()))
    a1, x, a2 = ((rng.random(s) < 0.3) * 1.0 for s in ((150, 7), (7, 7), (130, 7)))
    layout = from_spec("bigbird:30,1,2", (150, 130), (16, 8))
    dense_lookup = nnz_stats(a1, x, a2, layout)
    monkeypatch.setattr(nnz, "_DENSE_TABLE", 0)
    monkeypatch.setattr(nnz, "_CHUNK_ENTRIES", 300)
    assert nnz_stats(a1, x, a2, layout) == dense_lookup
    s = ((a1 @ x != 0).astype(int) @ (a2 != 0).T.astype(int)) > 0
    assert dense_lookup.Z_AXA == int((s & layout.to_dense_mask()[0, 0].numpy()).sum())
    assert dense_lookup.Z_AXA_unrestricted == int(s.sum())
