"""backend="triton" compiled on CUDA: low precision at realistic sizes, agreement with backend="torch",
exact counted traffic, determinism. Skipped without CUDA."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from sparse_io_attn._triton.runtime import INTERPRET

    if INTERPRET:  # Triton was imported in interpreter mode by an earlier test module
        pytestmark.append(pytest.mark.skip(reason="run tests/gpu in its own process (make test-gpu): "
                                                  "Triton was imported with TRITON_INTERPRET=1"))

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns  # noqa: E402
from sparse_io_attn.accounting import IOCounter, traffic  # noqa: E402
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask, masked_attention, rel_err  # noqa: E402

DEV = "cuda"


def run(q, k, v, do, layout, causal, backend):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend=backend)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype):
    mk = lambda h, n: torch.randn(B, h, n, D, device=DEV, dtype=dtype)  # noqa: E731
    return mk(Hq, Nq), mk(Hkv, Nk), mk(Hkv, Nk), mk(Hq, Nq)


REALISTIC = [
    pytest.param(2, 8, 2, 2000, 64, 128, "bigbird", False, id="N2000-D64-b128-bigbird-gqa"),
    pytest.param(1, 8, 8, 4096, 128, 128, "random", True, id="N4096-D128-b128-random-causal"),
    pytest.param(2, 4, 1, 1500, 96, 64, "sliding_window", True, id="N1500-D96-b64-window-mqa-causal"),
    pytest.param(1, 4, 4, 1024, 256, 128, "random", False, id="N1024-D256-b128-random"),
]


def make(family, n, block, heads):
    if family == "bigbird":
        return patterns.bigbird(n, block, num_heads=heads)
    if family == "random":
        return patterns.random(n, block, 0.3, num_heads=heads)
    return patterns.sliding_window(n, block, n // 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,N,D,block,family,causal", REALISTIC)
def test_low_precision_realistic_sizes(B, Hq, Hkv, N, D, block, family, causal, dtype):
    layout = make(family, N, block, Hq)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D, dtype)
    got = run(q, k, v, do, layout, causal, "triton")
    ref = attention_reference(q, k, v, layout, causal=causal, do=do)
    mask = element_mask(layout, B, Hq, N, N, causal=causal, device=DEV)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base_out, _ = masked_attention(ql, kl, vl, mask, D ** -0.5)
    base = (base_out, None) + torch.autograd.grad(base_out, (ql, kl, vl), do)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name == "lse":
            continue
        assert torch.isfinite(got[i]).all(), name
        factor = 2 if name == "out" else 3
        err, base_err = rel_err(got[i], ref[i]), rel_err(base[i], ref[i])
        assert err <= factor * base_err + 1e-5, f"{name}: {err:.2e} vs same-precision baseline {base_err:.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_agrees_with_torch_path(dtype, tol, causal):
    B, Hq, Hkv, N, D = 2, 4, 2, 1000, 64
    layout = patterns.bigbird(N, 64, num_heads=Hq)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D, dtype)
    tri = run(q, k, v, do, layout, causal, "triton")
    tor = run(q, k, v, do, layout, causal, "torch")
    fin = torch.isfinite(tor[1])
    assert torch.equal(fin, torch.isfinite(tri[1]))
    assert (tri[1][fin] - tor[1][fin]).abs().max().item() < 1e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), tri[:1] + tri[2:], tor[:1] + tor[2:]):
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.2e}"
    if dtype == torch.float32:
        ref = attention_reference(q, k, v, layout, causal=causal, do=do)
        for a, r in zip(tri[:1] + tri[2:], ref[:1] + ref[2:]):
            assert rel_err(a, r) <= 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_counted_equals_predicted_compiled(causal):
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 777, 1100, 80
    mask = torch.rand(Hq, -(-Nq // 128), -(-Nk // 128)) < 0.4
    layout = BlockSparseLayout.from_block_mask(mask, 128, (Nq, Nk))
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D, torch.bfloat16)
    with IOCounter() as io:
        run(q, k, v, do, layout, causal, "triton")
    assert io.report == traffic.block_sparse(layout, B, Hq, Hkv, D, torch.bfloat16, causal=causal)


def test_backward_deterministic_compiled():
    B, Hq, Hkv, N, D = 1, 8, 2, 2048, 128
    layout = patterns.random(N, 128, 0.4, num_heads=Hq)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D, torch.bfloat16)
    first, second = run(q, k, v, do, layout, True, "triton"), run(q, k, v, do, layout, True, "triton")
    for a, b in zip(first, second):
        assert torch.equal(a, b)
