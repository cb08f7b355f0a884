"""The paper's float64 reference (Definitions 3.1, 3.2, B.3-B.9) against autograd and the library's
attention reference."""
import numpy as np
import pytest
import torch

from sparse_io_attn.dense.reference import (paper_forward, paper_gradients, paper_gradients_autograd,
                                            paper_intermediates)
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err


def _inputs(n, d, n_k=None):
    n_k = n if n_k is None else n_k
    A1, dO = torch.randn(n, d), torch.randn(n, d)
    A2, A3 = torch.randn(n_k, d), torch.randn(n_k, d)
    X, Y = torch.randn(d, d) / d ** 0.5, torch.randn(d, d)
    return A1, A2, A3, X, Y, dO


@pytest.mark.parametrize("n,d,n_k,scale", [
    pytest.param(17, 4, None, 1.0, id="n17-d4"),
    pytest.param(40, 8, 29, 1.0, id="n40-nk29-d8-cross"),
    pytest.param(33, 16, None, 0.25, id="n33-d16-scale0.25"),
])
def test_gradients_match_autograd(n, d, n_k, scale):
    A1, A2, A3, X, Y, dO = _inputs(n, d, n_k)
    ours = paper_gradients(A1, A2, A3, X, Y, dO, scale=scale)
    auto = paper_gradients_autograd(A1, A2, A3, X, Y, dO, scale=scale)
    assert set(ours) == {"dX", "dY", "dA1", "dA2", "dA3"}
    for k in ours:
        assert ours[k].dtype == torch.float64
        assert rel_err(ours[k], auto[k]) < 1e-12, k


def test_definitions_hold():
    A1, A2, A3, X, Y, dO = _inputs(23, 6)
    r = paper_intermediates(A1, A2, A3, X, Y, dO)
    A1, A2 = A1.double(), A2.double()
    A = torch.exp(A1 @ X.double() @ A2.T)                     # B.3
    assert rel_err(r["A"], A) < 1e-13
    assert rel_err(r["l"], A.sum(1)) < 1e-13                  # B.4
    assert rel_err(r["f"], A / A.sum(1, keepdim=True)) < 1e-13  # B.5 (diag(l)^-1 A)
    assert rel_err(r["O"], r["f"] @ (A3.double() @ Y.double())) < 1e-13   # B.6, B.7
    assert rel_err(r["q"], dO.double() @ r["h"].T) < 1e-13    # B.8
    fq = r["f"] * r["q"]                                      # B.9, both matrix forms
    assert rel_err(r["p"], fq - fq.sum(1, keepdim=True) * r["f"]) < 1e-12
    assert rel_err(r["v"], (r["O"] * dO.double()).sum(1)) < 1e-12
    g = paper_gradients(A1, A2, A3, X, Y, dO)["dX"]
    assert rel_err(g, A1.T @ r["p"] @ A2) < 1e-12             # Definition 3.2


def test_forward_is_qkv_attention():
    """O equals softmax attention of q = A1 W_Q, k = A2 W_K, v = A3 W_V with X = W_Q W_K^T."""
    n, d = 31, 8
    A1, A2, A3 = (torch.randn(n, d, dtype=torch.float64) for _ in range(3))
    WQ, WK, WV = (torch.randn(d, d, dtype=torch.float64) / d ** 0.5 for _ in range(3))
    O, l = paper_forward(A1, A2, A3, WQ @ WK.T, WV)
    q, k, v = (t[None, None] for t in (A1 @ WQ, A2 @ WK, A3 @ WV))
    out, lse = attention_reference(q, k, v, sm_scale=1.0)
    assert rel_err(O, out[0, 0]) < 1e-12
    assert rel_err(torch.log(l), lse[0, 0]) < 1e-12


def test_linear_and_quadratic_loss_conventions():
    """g is dL/dX for L = 0.5 ||O - E||^2 when dO = O - E."""
    A1, A2, A3, X, Y, _ = _inputs(19, 5)
    E = torch.randn(19, 5, dtype=torch.float64)
    Xg = X.double().requires_grad_(True)
    O = torch.softmax(A1.double() @ Xg @ A2.double().T, 1) @ (A3.double() @ Y.double())
    (0.5 * ((O - E) ** 2).sum()).backward()
    g = paper_gradients(A1, A2, A3, X, Y, (O - E).detach())["dX"]
    assert rel_err(g, Xg.grad) < 1e-12


def test_numpy_inputs_and_errors():
    A1, A2, A3, X, Y, dO = (t.numpy() for t in _inputs(9, 3))
    O, l = paper_forward(A1, A2, A3, X, Y)
    assert O.shape == (9, 3) and l.shape == (9,) and bool(torch.isfinite(O).all())
    with pytest.raises(ValueError, match="X"):
        paper_forward(A1, A2, A3, np.ones((4, 4)), Y)
    with pytest.raises(ValueError, match="dO"):
        paper_gradients(A1, A2, A3, X, Y, dO[:5])
    with pytest.raises(TypeError):
        paper_forward([[1.0]], A2, A3, X, Y)
