"""The float64 reference every op's tests compare with (``_attention/reference.py``)."""
import torch

from sparse_io_attn._attention.reference import float64_attention


def test_gradients_stay_finite_when_a_row_lse_underflows_exp():
    """Rows whose allowed scores all lie far below -709 (``exp`` underflows float64): the masked
    elements must not evaluate ``exp(0 - lse)``, which overflows and turns the gradients NaN. The
    reference equals ``softmax`` over ``-inf``-filled scores (another formulation) in every output."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(4))
    q[..., 0] -= 2000.0      # every score about -2000 * k[..., 0] / sqrt(8): far outside exp's range
    k[..., 0] = 1.0 + torch.rand(1, 2, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    out, lse, dq, dk, dv = float64_attention(q, k, v, mask, None, do)
    assert lse.max() < -709
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    s = (q2 @ k2.transpose(-1, -2) * 8 ** -0.5).masked_fill(~mask, float("-inf"))
    out2 = torch.softmax(s, -1) @ v2
    grads = torch.autograd.grad(out2, (q2, k2, v2), do)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (out2.detach(),) + grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
