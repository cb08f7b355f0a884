"""Bound calculator (Theorem 1.1, Saha & Ye, Theorem 4.5), units, device table and nnz_stats."""
import math
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import sparse_io_attn.bounds as B
from sparse_io_attn import BlockSparseLayout


# --------------------------------------------------------------------------- hand-computed values
def test_dense_backward_hand_computed_large():
    b = B.dense_backward(4, 2, 9)
    assert b.terms == {"large_cache": (16 * 4 + 4 * 8) / 9, "small_cache": (16 * 2 + 4 * 4) / 3}
    assert (b.binding, b.regime, b.crossover_M, b.value_words) == ("large_cache", "large", 4.0, 96 / 9)
    assert b.compulsory_words == 8 * 4 * 2 + 4
    assert b.floor_words == 68 and b.floor_binding == "compulsory"


def test_dense_backward_hand_computed_small():
    b = B.dense_backward(8, 4, 4)
    assert b.terms == {"large_cache": 384.0, "small_cache": 192.0}
    assert (b.binding, b.regime, b.value_words) == ("small_cache", "small", 192.0)
    paper = B.dense_backward(8, 4, 4, form="paper")
    assert paper.compulsory_words == 4 * 8 * 4 + 3 * 16


def test_dense_backward_reference_case_and_crossover():
    b = B.dense_backward(4096, 128, 116224)                   # REFERENCES.md example
    assert round(b.value_words / 1e4) == 244 and b.compulsory_words == 8 * 4096 * 128 + 4096
    assert b.floor_binding == "compulsory"
    at = B.dense_backward(1000, 30, 900)                       # M = d^2: terms equal n^2 + nd
    assert at.terms["large_cache"] == at.terms["small_cache"] == 1000 ** 2 + 1000 * 30
    assert at.regime == "large" and B.dense_backward(1000, 30, 899).regime == "small"


def test_dense_forward_hand_computed():
    b = B.dense_forward(4, 2, 9)
    assert b.terms == {"large_cache": 64 / 9, "small_cache": 32 / 3}
    assert b.compulsory_words == 4 * 4 * 2 + 4 and "Saha & Ye" in b.theorem
    assert B.dense_forward(4, 2, 1).binding == "small_cache"


def test_sparse_hand_computed():
    b = B.sparse(6, 3, 4, 9, 16)
    assert b.terms["large_cache"] == (36 + 18) / 16
    assert b.terms["small_cache"] == pytest.approx((18 + math.sqrt(72)) / 4, rel=1e-15)
    assert b.crossover_M == pytest.approx((54 / (18 + math.sqrt(72))) ** 2, rel=1e-15)
    assert b.binding == "large_cache" and b.regime == "large"
    assert b.compulsory_words == 2 * 6 + 3
    assert B.sparse(6, 3, 4, 9, 2).regime == "small"


@pytest.mark.parametrize("n,d,M", [(4096, 128, 116224), (8192, 64, 1000), (512, 256, 65536), (100, 7, 3)])
def test_sparse_with_dense_counts_is_dense_bound(n, d, M):
    """Remark 4.6: dense operands reproduce Theorem 1.1; Remark 4.7's dividing point is d^2."""
    s, dn = B.sparse(n * d, d * d, n * d, n * n, M, n=n, d=d), B.dense_backward(n, d, M)
    for k in dn.terms:
        assert s.terms[k] == pytest.approx(dn.terms[k], rel=1e-12)
    assert (s.binding, s.regime) == (dn.binding, dn.regime)
    assert s.crossover_M == pytest.approx(d * d, rel=1e-12)


def test_sparse_from_dense_tensors_via_nnz_stats():
    n, d, M = 48, 8, 40
    A1, X, A2 = torch.randn(n, d), torch.randn(d, d), torch.randn(n, d)
    st = B.nnz_stats(A1, X, A2)
    assert (st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA) == (n * d, d * d, n * d, n * n)
    assert st.bound(M).terms == pytest.approx(B.dense_backward(n, d, M).terms, rel=1e-12)


@pytest.mark.parametrize("fn", [lambda M: B.dense_backward(1024, 64, M), lambda M: B.dense_forward(1024, 64, M),
                                lambda M: B.sparse(5000, 300, 4000, 90000, M)], ids=["bwd", "fwd", "sparse"])
def test_monotonic_in_M(fn):
    vals = [fn(M).value_words for M in [1, 2, 3, 10, 100, 1000, 4095, 4096, 4097, 10 ** 5, 10 ** 7]]
    assert all(a >= b for a, b in zip(vals, vals[1:])) and vals[0] > vals[-1]


def test_bad_input_errors():
    for M in (0, -5, "0", "0KiB"):
        with pytest.raises(ValueError, match="at least one word"):
            B.dense_backward(16, 4, M, dtype="fp32")
    with pytest.raises(ValueError, match="exceeds n\\^2"):
        B.sparse(10, 4, 10, 101, 16, n=10)
    with pytest.raises(ValueError, match="cannot be negative"):
        B.sparse(10, -1, 10, 50, 16)
    with pytest.raises(ValueError, match="d\\^2"):
        B.sparse(10, 17, 10, 50, 16, d=4)
    with pytest.raises(TypeError):
        B.sparse("10", 1, 1, 1, 16)
    with pytest.raises(ValueError, match="positive"):
        B.dense_backward(0, 4, 16)
    assert B.dense_backward(16, 4.0, 16).terms == B.dense_backward(16, 4, 16).terms   # reals accepted
    with pytest.raises(ValueError, match="dtype="):
        B.dense_backward(16, 4, "228KiB")
    with pytest.raises(ValueError, match="unit"):
        B.parse_memory("3 parsecs", "fp32")
    with pytest.raises(TypeError):
        B.parse_memory(True)
    with pytest.raises(ValueError, match="form"):
        B.dense_backward(16, 4, 16, form="xyz")
    with pytest.raises(ValueError, match="dtype"):
        B.dense_backward(16, 4, 16).bytes()


# --------------------------------------------------------------------------- units, printing
def test_parse_memory_and_bytes():
    assert B.parse_memory("228KiB", torch.bfloat16) == 228 * 1024 // 2
    assert B.parse_memory("116224") == 116224 == B.parse_memory(116224)
    assert B.parse_memory("48KB", torch.float32) == 12288
    assert B.parse_memory("1MiB", "fp16") == 2 ** 19 and B.parse_memory("4096B", np.float64) == 512
    b = B.dense_backward(8192, 128, "228KiB", dtype=torch.bfloat16)
    assert b.M == 116736 and b.bytes() == 2 * b.value_words and b.bytes(torch.float32) == 4 * b.value_words
    text = str(b)
    assert "large cache" in text and "binds" in text and "Kwasniewski" not in text
    assert "Kwasniewski" in b.describe(verbose=True)
    d = b.to_dict()
    assert d["value_bytes"] == b.bytes() and d["binding"] == "large_cache" and "unit" in d["constants"]
    assert B.dense_backward(64, 8, 100, heads=6).value_words == 6 * B.dense_backward(64, 8, 100).value_words


def test_explicit_constant_fields():
    b = B.dense_backward(1024, 64, 256)
    words, cite = b.explicit_constant["Kwasniewski 2019 (QK^T product)"]
    assert words == 2 * 1024 * 1024 * 64 / 16 + 1024 * 1024 and "1908.09606" in cite
    assert b.explicit_constant["Smith 2019 (QK^T product)"][0] == 2 * 1024 * 1024 * 64 / 16 - 512
    assert B.sparse(10, 4, 10, 50, 16).explicit_constant == {}
    d = b.to_dict()["explicit_constant"]
    assert d["Kwasniewski 2019 (QK^T product)"]["scope"] == "bound for materialising QK^T, not for attention"


def test_explicit_constants_only_on_request_and_never_a_zero_line():
    """The QK^T-product bounds (1.17e8 words at n = 8192, d = 128, 228 KiB: 12x the attention bound)
    bound materialising QK^T, not attention: printed only with verbose=True, labelled so; the
    Theorem E.10 reduction line is dropped where it is 0 (sqrt(M) >= 2d)."""
    b = B.dense_backward(8192, 128, "228KiB", dtype=torch.bfloat16)
    kw = b.explicit_constant["Kwasniewski 2019 (QK^T product)"][0]
    assert kw == pytest.approx(1.174e8, rel=1e-3) and kw / b.value_words == pytest.approx(12.3, abs=0.1)
    assert "Theorem E.10 reduction (attention)" not in b.explicit_constant        # 0 at M >= 4d^2
    assert "materialising" not in str(b) and "explicit" not in str(b)
    verbose = b.describe(verbose=True)
    assert verbose.count("bound for materialising QK^T, not for attention") == 2 and "reduction" not in verbose
    small = B.dense_backward(8192, 128, 1024)
    assert small.explicit_constant["Theorem E.10 reduction (attention)"][0] == pytest.approx(
        2 * 8192 ** 2 * 128 / 32 - 8192 ** 2)
    assert "reduction of Theorem E.10" in small.describe(verbose=True)


# --------------------------------------------------------------------------- Theorem 1.2 (Table 1)
def test_sparse_informal_hand_computed():
    b = B.sparse_informal(6, 9, 16)
    assert b.terms == {"large_cache": 36 / 16, "small_cache": 6 * 3 / 4}
    assert b.crossover_M == 4.0 == B.sparse_informal_crossover(6, 9)          # Z_input^2 / Z_QK
    assert (b.binding, b.regime) == ("large_cache", "large") and B.sparse_informal(6, 9, 3).regime == "small"
    assert b.compulsory_words == 6 and "Theorem 1.2" in b.theorem
    assert B.sparse_informal(6, 9, 16, n=3, d=2).compulsory_words == 6 + 6
    with pytest.raises(ValueError, match="exceeds n\\^2"):
        B.sparse_informal(6, 10, 16, n=3)


@pytest.mark.parametrize("n,d,M", [(4096, 128, 116224), (8192, 64, 1000), (100, 7, 3)])
def test_sparse_informal_dense_is_theorem_1_1_leading_terms(n, d, M):
    """Dense operands: Z_input = nd, Z_QK = n^2 give n^2 d^2 / M and n^2 d / sqrt(M), dividing point d^2."""
    b = B.sparse_informal(n * d, n * n, M)
    assert b.terms["large_cache"] == pytest.approx(n * n * d * d / M, rel=1e-12)
    assert b.terms["small_cache"] == pytest.approx(n * n * d / M ** 0.5, rel=1e-12)
    assert b.crossover_M == d * d


def test_sparse_informal_is_weaker_than_theorem_4_5():
    """With Z_input = Z_A, Z_QK = Z_AXA every term of Theorem 1.2 is <= Theorem 4.5's; nnz_stats
    gives both."""
    rng = np.random.default_rng(3)
    a1 = (rng.random((64, 16)) < 0.2) * 1.0
    a2 = (rng.random((64, 16)) < 0.3) * 1.0
    x = (rng.random((16, 16)) < 0.5) * 1.0
    st = B.nnz_stats(a1, x, a2)
    for M in (4, 64, 1024, 10 ** 5):
        inf, thm = st.informal_bound(M), st.bound(M)
        assert all(inf.terms[k] <= thm.terms[k] for k in thm.terms) and inf.value_words <= thm.value_words
        assert inf.params["Z_input"] == st.Z_A and inf.params["Z_QK"] == st.Z_AXA


# --------------------------------------------------------------------------- devices
def test_device_table():
    assert set(B.DEVICES) == {"h100", "h200", "a100", "l4", "rtx4090", "v100", "t4", "gtx1060"}
    for spec in B.DEVICES.values():
        assert spec.smem_per_block_bytes <= spec.smem_per_sm_bytes and "Programming Guide" in spec.source
        assert spec.l2_bytes > 0 and spec.hbm_bytes_per_s > 0
    assert B.device_fast_memory_words(torch.bfloat16, "h100") == 116224
    assert B.device_fast_memory_words(torch.float32, "GTX1060") == 12288
    assert B.DEFAULT_CPU_FAST_MEMORY_BYTES == 227 * 1024
    with pytest.raises(ValueError, match="known devices"):
        B.device_fast_memory_words(torch.float32, "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_regime_without_gpu():
    assert B.device_fast_memory_words(torch.bfloat16) is None
    r = B.regime_for(128, torch.bfloat16)
    assert (r.M_words, r.regime) == (116224, "large") and r.ratio == pytest.approx(7.09, abs=0.01)
    assert B.regime_for(256, torch.float32, "a100").regime == "small"
    assert B.regime_for(128, torch.float32, "gtx1060").regime == "small"
    assert B.regime_for(64, torch.float16, "t4").regime == "large"
    assert "small cache" in str(B.regime_for(256, torch.float32, "h100"))


# --------------------------------------------------------------------------- nnz_stats
def _dense_counts(a1, x, a2, keep=None):
    a1, x, a2 = (np.asarray(t) != 0 for t in (a1, x, a2))
    a1x = (a1.astype(int) @ x.astype(int)) > 0
    xa2 = (x.astype(int) @ a2.T.astype(int)) > 0
    s = (a1x.astype(int) @ a2.T.astype(int)) > 0
    z = int((s & keep).sum()) if keep is not None else int(s.sum())
    return min(a1.sum(), a2.sum()), x.sum(), min(a1x.sum(), xa2.sum()), z


def _sparse_rand(r, c, density, rng):
    return (rng.random((r, c)) < density) * rng.standard_normal((r, c))


@pytest.mark.parametrize("n,n_k,d,density,block", [(67, 53, 8, 0.15, (16, 8)), (40, 40, 12, 0.05, (8, 8)),
                                                   (33, 70, 5, 0.4, (32, 16))])
def test_nnz_stats_matches_dense_boolean_products(n, n_k, d, density, block):
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item()))
    a1, x, a2 = _sparse_rand(n, d, density, rng), _sparse_rand(d, d, 0.3, rng), _sparse_rand(n_k, d, density, rng)
    layout = BlockSparseLayout.from_block_mask(
        torch.rand(math.ceil(n / block[0]), math.ceil(n_k / block[1])) < 0.5, block, (n, n_k))
    keep = layout.to_dense_mask()[0, 0].numpy()
    for A1, X, A2 in ((a1, x, a2), (torch.from_numpy(a1), torch.from_numpy(x), torch.from_numpy(a2)),
                      (sp.csr_matrix(a1), sp.coo_matrix(x), sp.csc_matrix(a2))):
        st = B.nnz_stats(A1, X, A2)
        assert (st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA) == _dense_counts(a1, x, a2)
        rs = B.nnz_stats(A1, X, A2, layout)
        assert rs.restricted_to_qk_pattern and not st.restricted_to_qk_pattern
        assert rs.Z_AXA == _dense_counts(a1, x, a2, keep)[3] and rs.Z_AXA_unrestricted == st.Z_AXA


class _FakeBSR:
    """Stands in for BlockSparseMatrix: anything with to_scipy_bsr()."""

    def __init__(self, bsr):
        self._bsr = bsr

    def to_scipy_bsr(self):
        return self._bsr


def test_nnz_stats_bsr_element_and_block_levels():
    rng = np.random.default_rng(0)
    bs = 4
    blocks1 = rng.random((6, 2)) < 0.5
    blocks2 = rng.random((5, 2)) < 0.5
    blocks1[0, 0] = blocks2[0, 1] = True
    mk = lambda blk: np.kron(blk, np.ones((bs, bs))) * rng.standard_normal((blk.shape[0] * bs, blk.shape[1] * bs))  # noqa: E731
    a1, a2, x = mk(blocks1), mk(blocks2), rng.standard_normal((8, 8))
    a1[0, 0] = 0.0                                    # an explicit zero inside a stored block still counts
    A1 = _FakeBSR(sp.bsr_matrix(a1, blocksize=(bs, bs)))
    A1._bsr.data[0, 0, 0] = 0.0
    A2, X = _FakeBSR(sp.bsr_matrix(a2, blocksize=(bs, bs))), _FakeBSR(sp.bsr_matrix(x, blocksize=(bs, bs)))
    el = B.nnz_stats(A1, X, A2)
    assert el.level == "element" and el.nnz_A1 == blocks1.sum() * bs * bs
    a1_struct = np.kron(blocks1, np.ones((bs, bs)))
    assert (el.Z_A, el.Z_X, el.Z_AX, el.Z_AXA) == _dense_counts(a1_struct, x, np.kron(blocks2, np.ones((bs, bs))))
    blk = B.nnz_stats(A1, X, A2, level="block")
    assert (blk.Z_A, blk.Z_X, blk.Z_AX, blk.Z_AXA) == _dense_counts(blocks1, np.ones((2, 2)), blocks2)
    layout = BlockSparseLayout.from_block_mask(torch.from_numpy(rng.random((6, 5)) < 0.5), bs)
    rb = B.nnz_stats(A1, X, A2, layout, level="block")
    keep = layout.to_block_mask()[0, 0].numpy()
    assert rb.Z_AXA == _dense_counts(blocks1, np.ones((2, 2)), blocks2, keep)[3]
    dense_blk = B.nnz_stats(a1_struct, x, np.kron(blocks2, np.ones((bs, bs))), level="block", block_size=bs)
    assert (dense_blk.Z_A, dense_blk.Z_AXA) == (blk.Z_A, blk.Z_AXA)
    with pytest.raises(ValueError, match="block_size"):
        B.nnz_stats(a1_struct, x, a2, level="block")
    with pytest.raises(ValueError, match="element-level"):
        blk.bound(100)


def test_nnz_stats_long_sequence_known_answer():
    """n = 131072: A1 = A2 have one nonzero per selected row at column i mod d, X = I, so
    (A1 X A2^T)[i, j] != 0 iff both rows are selected and i = j mod d: Z_AXA = sum_c s_c^2."""
    n, d, s = 131072, 128, 3000
    rng = np.random.default_rng(1)
    rows = np.sort(rng.choice(n, s, replace=False))
    a = sp.csr_matrix((rng.standard_normal(s), (rows, rows % d)), shape=(n, d))
    t0 = time.perf_counter()
    st = B.nnz_stats(a, sp.identity(d, format="csr"), a)
    elapsed = time.perf_counter() - t0
    counts = np.bincount(rows % d, minlength=d)
    assert (st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA) == (s, d, s, int((counts ** 2).sum()))
    assert elapsed < 5.0
    dense_x = B.nnz_stats(a, torch.randn(d, d), a)              # dense X: every selected pair
    assert dense_x.Z_AXA == s * s and dense_x.Z_AX == s * d


def test_nnz_stats_errors():
    with pytest.raises(ValueError, match="d x d"):
        B.nnz_stats(torch.randn(8, 4), torch.randn(3, 3), torch.randn(8, 4))
    with pytest.raises(ValueError, match="level"):
        B.nnz_stats(torch.randn(8, 4), torch.randn(4, 4), torch.randn(8, 4), level="row")
    with pytest.raises(TypeError):
        B.nnz_stats([[1.0]], torch.randn(1, 1), torch.randn(1, 1))
    lay = BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="seqlen"):
        B.nnz_stats(torch.randn(9, 4), torch.randn(4, 4), torch.randn(9, 4), lay)
    two = BlockSparseLayout.from_block_mask(torch.ones(2, 2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="layout_index"):
        B.nnz_stats(torch.randn(8, 4), torch.randn(4, 4), torch.randn(8, 4), two)
    assert B.nnz_stats(torch.randn(8, 4), torch.randn(4, 4), torch.randn(8, 4), two, layout_index=1).Z_AXA == 64


def test_restricted_count_carries_caveat():
    n, d = 64, 8
    A1, X, A2 = torch.randn(n, d), torch.randn(d, d), torch.randn(n, d)
    lay = BlockSparseLayout.from_block_mask(torch.eye(4, dtype=torch.bool), 16)
    full, restricted = B.nnz_stats(A1, X, A2), B.nnz_stats(A1, X, A2, lay)
    assert restricted.Z_AXA == 4 * 16 * 16 and full.Z_AXA == n * n
    assert full.bound(100).note == "" and "not a proven lower bound" in restricted.bound(100).note
    assert "note:" in str(restricted.bound(100)) and restricted.bound(100).to_dict()["note"]


def test_nnz_stats_ragged_bsr_operand_matches_dense_with_qk_layout():
    """A BSR operand whose length is not a multiple of its block is counted at its own shape."""
    from sparse_io_attn import BlockSparseLayout, BlockSparseMatrix
    A = torch.randn(70, 32)
    A[:16] = 0
    bsr = BlockSparseMatrix.from_dense(A, (16, 16))
    X = torch.randn(32, 32)
    qk = BlockSparseLayout.from_block_mask(torch.rand(5, 5) < 0.5, 16, seqlen=70)
    got = B.nnz_stats(bsr, X, bsr, qk_layout=qk)
    ref = B.nnz_stats(bsr.to_dense(), X, bsr.to_dense(), qk_layout=qk)
    assert (got.Z_A, got.Z_X, got.Z_AX, got.Z_AXA, got.n) == (ref.Z_A, ref.Z_X, ref.Z_AX, ref.Z_AXA, 70)
