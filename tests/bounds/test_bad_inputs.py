"""The bounds API's input handling: every accepted kind of number (ints, finite floats such as an
expected nnz, NumPy scalars) and every bad input, each a ``pytest.param(call, expected_exception,
id=...)`` regression case with a clear error (never a bare OverflowError or ZeroDivisionError)."""
import math

import numpy as np
import pytest

import sparse_io_attn.bounds as B

BIG = 10 ** 160


# --------------------------------------------------------------------------- accepted inputs
def test_expected_counts_are_accepted():
    """An expected nnz (density * n * n) is a legitimate count: floats work like the rounded ints."""
    n, d, density = 4096, 128, 0.0625
    b = B.sparse(1e5, 16384.0, 3.5e5, density * n * n, 61568, n=n, d=d)
    ref = B.sparse(100000, 16384, 350000, round(density * n * n), 61568, n=n, d=d)
    for k in b.terms:
        assert b.terms[k] == pytest.approx(ref.terms[k], rel=1e-12)
    assert b.params["Z_A"] == 100000 and isinstance(b.params["Z_A"], int)   # integral floats become ints
    half = B.sparse(10.5, 1, 1, 1, 16)
    assert half.terms["large_cache"] == (10.5 ** 2 + 10.5) / 16 and half.compulsory_words == 22.0
    assert B.sparse_informal(2.5e5, 1e6, 1000).terms["large_cache"] == pytest.approx(2.5e5 ** 2 / 1000)


@pytest.mark.parametrize("conv", [np.int64, np.int32, np.float64, np.float32, float, int],
                         ids=["int64", "int32", "float64", "float32", "float", "int"])
def test_numpy_scalars_everywhere(conv):
    """n, d, M and the Z counts take NumPy scalars (NumPy ints become Python ints: no wrap-around)."""
    ref = B.dense_backward(8192, 128, 116224)
    got = B.dense_backward(conv(8192), conv(128), conv(116224))
    assert got.terms == ref.terms and got.M == 116224 and got.compulsory_words == ref.compulsory_words
    big = B.dense_backward(np.int64(2 ** 31), np.int64(2 ** 20), 10 ** 6)   # n^2 d^2 overflows int64
    assert big.terms["large_cache"] == pytest.approx((2 ** 62 * 2 ** 40 + 2 ** 31 * 2 ** 60) / 10 ** 6, rel=1e-12)
    s = B.sparse(conv(5000), conv(300), conv(4000), conv(90000), conv(1000))
    assert s.terms == B.sparse(5000, 300, 4000, 90000, 1000).terms
    assert B.parse_memory(conv(2048)) == 2048
    assert B.sparse_informal(conv(1000), conv(4000), conv(100)).value_words == \
        B.sparse_informal(1000, 4000, 100).value_words


def test_huge_inputs_in_log_space_when_the_result_is_representable():
    """Intermediates past the float range (1e160^2) are evaluated in log space when the bound itself
    is representable."""
    b = B.sparse(BIG, BIG, BIG, BIG, 10 ** 300)
    assert b.terms["large_cache"] == pytest.approx(2e20, rel=1e-9)
    assert b.terms["small_cache"] == pytest.approx((BIG * 1e80 + 1e240) / 1e150, rel=1e-9)
    d = B.dense_backward(10 ** 100, 10, 10 ** 200)
    assert d.terms["large_cache"] == pytest.approx((1e200 * 100 + 1e100 * 1000) / 1e200, rel=1e-12)
    assert B.sparse_crossover(BIG, BIG, BIG, BIG) == pytest.approx(1e160 * 4 / (1 + 1) ** 2, rel=1e-9)
    assert math.isinf(B.sparse_crossover(0, 5, 5, 5)) and math.isinf(B.sparse_informal_crossover(5, 0))


def test_nnz_stats_block_size_pair_accepted():
    a = np.ones((8, 8))
    st = B.nnz_stats(a, np.ones((8, 8)), a, level="block", block_size=(4, 4))
    assert (st.Z_A, st.Z_AXA) == (4, 4)
    assert B.nnz_stats(a, np.ones((8, 8)), a, level="block", block_size=np.int64(4)).Z_A == 4


# --------------------------------------------------------------------------- bad inputs
def _ones(n=8, d=4):
    return np.ones((n, d)), np.ones((d, d)), np.ones((n, d))


BAD = [
    # Z counts
    pytest.param(lambda: B.sparse(-1, 1, 1, 1, 16), ValueError, id="Z_A-negative"),
    pytest.param(lambda: B.sparse(-0.5, 1, 1, 1, 16), ValueError, id="Z_A-negative-float"),
    pytest.param(lambda: B.sparse(float("nan"), 1, 1, 1, 16), ValueError, id="Z_A-nan"),
    pytest.param(lambda: B.sparse(1, float("inf"), 1, 1, 16), ValueError, id="Z_X-inf"),
    pytest.param(lambda: B.sparse(1, 1, np.float64("nan"), 1, 16), ValueError, id="Z_AX-numpy-nan"),
    pytest.param(lambda: B.sparse("5", 1, 1, 1, 16), TypeError, id="Z_A-string"),
    pytest.param(lambda: B.sparse(True, 1, 1, 1, 16), TypeError, id="Z_A-bool"),
    pytest.param(lambda: B.sparse(1 + 2j, 1, 1, 1, 16), TypeError, id="Z_A-complex"),
    pytest.param(lambda: B.sparse(1, 1, 1, None, 16), TypeError, id="Z_AXA-None"),
    pytest.param(lambda: B.sparse(10, 4, 10, 101.5, 16, n=10), ValueError, id="Z_AXA-float-above-n2"),
    # overflow: clear ValueError, never a bare OverflowError
    pytest.param(lambda: B.sparse(BIG, BIG, BIG, BIG, 100), ValueError, id="sparse-1e160-result-too-large"),
    pytest.param(lambda: B.sparse(10 ** 400, 1, 1, 1, 16), ValueError, id="sparse-1e400"),
    pytest.param(lambda: B.dense_backward(BIG, BIG, 100), ValueError, id="dense_backward-1e160"),
    pytest.param(lambda: B.dense_forward(BIG, 128, 100), ValueError, id="dense_forward-1e160"),
    pytest.param(lambda: B.dense_backward(10 ** 310, 1, 10 ** 700), ValueError, id="dense_backward-compulsory-1e310"),
    pytest.param(lambda: B.sparse_informal(BIG, BIG, 1), ValueError, id="informal-1e160"),
    pytest.param(lambda: B.dense_backward(1e200, 1e200, 16), ValueError, id="float-1e200-squares-overflow"),
    pytest.param(lambda: B.sparse(1, 1, 1, 1, 16, heads=10 ** 400), ValueError, id="heads-huge"),
    # sizes
    pytest.param(lambda: B.dense_backward(0, 4, 16), ValueError, id="n-zero"),
    pytest.param(lambda: B.dense_backward(16, -4.0, 16), ValueError, id="d-negative-float"),
    pytest.param(lambda: B.dense_backward(float("nan"), 4, 16), ValueError, id="n-nan"),
    pytest.param(lambda: B.dense_backward("16", 4, 16), TypeError, id="n-string"),
    pytest.param(lambda: B.dense_forward(16, np.float64("inf"), 16), ValueError, id="d-numpy-inf"),
    pytest.param(lambda: B.sparse(1, 1, 1, 1, 16, n=0), ValueError, id="sparse-n-zero"),
    pytest.param(lambda: B.dense_backward(16, 4, 16, heads=2.5), TypeError, id="heads-float"),
    pytest.param(lambda: B.dense_backward(16, 4, 16, heads=0), ValueError, id="heads-zero"),
    # M
    pytest.param(lambda: B.dense_backward(16, 4, 0), ValueError, id="M-zero"),
    pytest.param(lambda: B.dense_backward(16, 4, 0.5), ValueError, id="M-below-one-word"),
    pytest.param(lambda: B.dense_backward(16, 4, float("nan")), ValueError, id="M-nan"),
    pytest.param(lambda: B.dense_backward(16, 4, float("inf")), ValueError, id="M-inf"),
    pytest.param(lambda: B.dense_backward(16, 4, np.float32("inf")), ValueError, id="M-numpy-inf"),
    pytest.param(lambda: B.dense_backward(16, 4, [16]), TypeError, id="M-list"),
    pytest.param(lambda: B.dense_backward(16, 4, True), TypeError, id="M-bool"),
    pytest.param(lambda: B.parse_memory("3 parsecs", "fp32"), ValueError, id="M-unit"),
    pytest.param(lambda: B.parse_memory("228KiB"), ValueError, id="M-bytes-without-dtype"),
    # nnz_stats
    pytest.param(lambda: B.nnz_stats(*_ones(), level="block", block_size=0), ValueError, id="block_size-zero"),
    pytest.param(lambda: B.nnz_stats(*_ones(), level="block", block_size=(4, 0)), ValueError, id="block_size-pair-zero"),
    pytest.param(lambda: B.nnz_stats(*_ones(), level="block", block_size=-4), ValueError, id="block_size-negative"),
    pytest.param(lambda: B.nnz_stats(*_ones(), level="block", block_size=2.5), TypeError, id="block_size-float"),
    pytest.param(lambda: B.nnz_stats(*_ones(), level="block", block_size=(4, 4, 4)), TypeError, id="block_size-triple"),
    pytest.param(lambda: B.nnz_stats(*_ones(), level="element", block_size=0), ValueError, id="block_size-zero-element-level"),
]


@pytest.mark.parametrize("call, expected", BAD)
def test_bad_input(call, expected):
    with pytest.raises(expected) as info:
        call()
    assert type(info.value) is expected          # not a subclass such as OverflowError/ZeroDivisionError
    assert str(info.value)                       # a message a user can act on
