"""The attention kit's ``@triton.jit`` softmax helpers on their own (under the interpreter on CPU):
the backward's recomputed probabilities never exceed 1, keep masked elements at 0 and NaN as NaN."""
from __future__ import annotations

import pytest
import torch

from sparse_io_attn._attention.triton.softmax import probabilities
from sparse_io_attn._triton.runtime import INTERPRET

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


@triton.jit
def _probabilities_kernel(s_ptr, m_ptr, l_ptr, p_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    p = probabilities(tl.load(s_ptr + offs), tl.load(m_ptr + offs), tl.load(l_ptr + offs))
    tl.store(p_ptr + offs, p)


def _probabilities(s, m, log2_sum):
    p = torch.empty_like(s)
    _probabilities_kernel[(1,)](s, m, log2_sum, p, N=s.numel())
    return p


def test_recomputed_probabilities_are_capped_at_one():
    inf, nan = float("inf"), float("nan")
    # a score an ulp or a hundred above the forward's row maximum (another tile's rounding at huge
    # logits), at the maximum, below it, masked (-inf), on an empty row (m = +inf), NaN
    s = torch.tensor([1e9 + 128, 1e9 + 2 ** 20, 1e9, -3.0, -inf, 5.0, nan, 0.0], device=DEVICE)
    m = torch.tensor([1e9, 1e9, 1e9, 0.0, 1e9, inf, 0.0, 0.0], device=DEVICE)
    log2_sum = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0], device=DEVICE)
    p = _probabilities(s, m, log2_sum).cpu()
    assert p[0] == 1.0 and p[1] == 1.0, "a score above the row maximum must give p = 1, not 2^(excess)"
    assert p[2] == 0.5 and p[3] == 0.125
    assert p[4] == 0.0 and p[5] == 0.0, "masked elements and empty rows give p = 0"
    assert torch.isnan(p[6]), "NaN scores stay NaN"
    assert p[7] == 0.25


@pytest.mark.parametrize("excess", [1.0, 1e3, 1e6])
def test_cap_holds_for_any_excess(excess):
    s = torch.full((16,), 1e12 + excess, device=DEVICE)
    m = torch.full((16,), 1e12, device=DEVICE)
    p = _probabilities(s, m, torch.zeros(16, device=DEVICE))
    assert torch.isfinite(p).all() and (p <= 1.0).all()
