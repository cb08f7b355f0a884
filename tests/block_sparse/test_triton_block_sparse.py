"""backend="triton" specifics (the shared correctness matrix is in test_correctness.py): clear
errors for unsupported shapes, the sm_90 compile, agreement with the torch backend."""
import pytest
import torch

from sparse_io_attn import block_sparse_attention, patterns
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse.reference import rel_err

import helpers
from helpers import make_inputs, run

DEVICE = "cpu" if INTERPRET else "cuda"  # the same tests run compiled where CUDA is in use


def make_layout(*args, density=0.6, empty_row=False, **kw):
    """Random layouts with the diagonal kept in every row (and the middle row emptied)."""
    nqb = -(-args[2] // (args[4] if isinstance(args[4], int) else args[4][0]))
    return helpers.make_layout(*args, density=density, diagonal=True,
                               empty_rows=(nqb // 2,) if empty_row else (), **kw)


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32):
    return make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device=DEVICE)


def run_triton(q, k, v, do, layout, causal):
    return run(q, k, v, do, layout, causal, backend="triton")


def test_unsupported_shapes_raise_clear_errors():
    q, k, v, _ = inputs(1, 1, 1, 64, 64, 32)
    layout8 = make_layout(1, 1, 64, 64, 8)
    with pytest.raises(NotImplementedError, match="power-of-two divisor"):
        block_sparse_attention(q, k, v, layout8, backend="triton")
    q, k, v, _ = inputs(1, 1, 1, 32, 32, 288)
    with pytest.raises(NotImplementedError, match="head_dim"):
        block_sparse_attention(q, k, v, make_layout(1, 1, 32, 32, 32), backend="triton")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_agrees_with_torch_backend(causal):
    B, Hq, Hkv, N, D = 2, 4, 2, 140, 48
    layout = make_layout(B, Hq, N, N, 32, per_head=True, empty_row=True)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D)
    tri = run_triton(q, k, v, do, layout, causal)
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(qt, kt, vt, layout, causal=causal, return_lse=True, backend="torch")
    out.backward(do)
    tor = (out.detach(), lse, qt.grad, kt.grad, vt.grad)
    assert torch.equal(torch.isneginf(tri[1]), torch.isneginf(tor[1]))
    fin = torch.isfinite(tor[1])
    tri, tor = (tri[0], tri[1][fin]) + tri[2:], (tor[0], tor[1][fin]) + tor[2:]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tri, tor):
        assert rel_err(a, b) <= 2e-5, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits_stay_finite(causal):
    """Scores past the fp32 range (|q.k| * sm_scale ~ 1e40) saturate instead of becoming inf, so the
    row maximum's subtraction never gives inf - inf = NaN: outputs, lse and gradients are finite and
    each output row is a convex combination of v rows (full and partial tiles, forward and backward)."""
    q, k, v, do = make_inputs(1, 1, 1, 40, 40, 16, device=DEVICE)
    q, k = q * 1e5, k * 1e5
    out, lse, dq, dk, dv = run(q, k, v, do, patterns.dense(40, 16), causal, backend="triton", sm_scale=1e30)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"non-finite {name}"
    assert out.abs().max() <= v.abs().max()
