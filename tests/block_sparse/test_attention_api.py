"""The public entry point `block_sparse_attention`: input checks with actionable messages, backend
choice, autograd wiring (backend "torch" on CPU)."""
import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn.block_sparse.api import prepare, resolve_backend
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err


def qkv(B=1, Hq=2, Hkv=2, Nq=64, Nk=64, D=16, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype),
            torch.randn(B, Hkv, Nk, D, dtype=dtype))


LAYOUT = patterns.sliding_window(64, 16, 16)


@pytest.mark.parametrize("make,exc,match", [
    pytest.param(lambda q, k, v: (q[0], k, v, LAYOUT), ValueError, r"q must have shape \[batch, heads, seqlen, head_dim\]",
                 id="q-3d"),
    pytest.param(lambda q, k, v: (q.double(), k.double(), v.double(), LAYOUT), TypeError, "supported: float32",
                 id="float64"),
    pytest.param(lambda q, k, v: (q, k.half(), v, LAYOUT), TypeError, "must share a dtype", id="mixed-dtypes"),
    pytest.param(lambda q, k, v: (q, k, v[:, :, :32], LAYOUT), ValueError,
                 "k and v must have the same shape but for v's head dim", id="k-v-shapes"),   # Dv of its own is valid
    pytest.param(lambda q, k, v: (q, k[..., :8], v[..., :8], LAYOUT), ValueError, "q has head_dim 16 and k has 8",
                 id="head-dim"),
    pytest.param(lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v]), LAYOUT), ValueError,
                 "q has batch 1 and k has batch 2", id="batch"),
    pytest.param(lambda q, k, v: (q, torch.cat([k] * 3, 1)[:, :3], torch.cat([v] * 3, 1)[:, :3], LAYOUT),
                 ValueError, "q has 2 heads and k has 3; num_heads_q must be a multiple", id="heads"),
    pytest.param(lambda q, k, v: (q, k, v, patterns.sliding_window(128, 16, 16)), ValueError,
                 r"seqlen \(q, k\) = \(128, 128\) but the inputs have \(64, 64\)", id="layout-seqlen"),
    pytest.param(lambda q, k, v: (q, k, v, patterns.random(64, 16, 0.5, num_heads=3)), ValueError,
                 "layout has 3 head masks but q has 2 heads", id="layout-heads"),
    pytest.param(lambda q, k, v: (q, k, v, torch.ones(4, 4, dtype=torch.bool)), TypeError,
                 "layout must be a BlockSparseLayout", id="layout-type"),
    pytest.param(lambda q, k, v: (q.tolist(), k, v, LAYOUT), TypeError, "q must be a torch.Tensor", id="not-tensor"),
])
def test_bad_inputs_raise_actionable_errors(make, exc, match):
    args = make(*qkv())
    with pytest.raises(exc, match=match):
        block_sparse_attention(*args)


def test_bad_backend_and_sm_scale():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton', 'cpu'\), got 'cuda'"):
        block_sparse_attention(q, k, v, LAYOUT, backend="cuda")
    with pytest.raises(TypeError, match="sm_scale must be a real number .* or None, got bool"):
        block_sparse_attention(q, k, v, LAYOUT, sm_scale=True)


def test_default_sm_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(D=16)
    assert prepare(q, k, v, LAYOUT, causal=False, sm_scale=None, backend="torch").sm_scale == pytest.approx(0.25)
    assert prepare(q, k, v, LAYOUT, causal=False, sm_scale=2, backend="torch").sm_scale == 2.0


def test_auto_picks_the_cpu_kernel_on_cpu():
    from sparse_io_attn.block_sparse import cpu
    expected = "cpu" if cpu.is_available() else "torch"
    assert resolve_backend("auto", torch.device("cpu")) == expected
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    q, k, v = qkv()
    a = block_sparse_attention(q, k, v, LAYOUT, causal=True)
    b = block_sparse_attention(q, k, v, LAYOUT, causal=True, backend=expected)
    assert torch.equal(a, b)


def test_return_lse_and_autograd_wiring():
    q, k, v = (t.requires_grad_() for t in qkv(Hq=4, Hkv=2, Nq=80, Nk=96))
    layout = BlockSparseLayout.from_block_mask(torch.rand(5, 6) < 0.6, 16, (80, 96))
    out, lse = block_sparse_attention(q, k, v, layout, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (1, 4, 80) and lse.dtype == torch.float32 and not lse.requires_grad
    do = torch.randn_like(out)
    out.backward(do)
    r_out, r_lse, r_dq, r_dk, r_dv = attention_reference(q, k, v, layout, do=do)
    assert rel_err(out, r_out) <= 1e-5
    for g, r in ((q.grad, r_dq), (k.grad, r_dk), (v.grad, r_dv)):
        assert rel_err(g, r) <= 1e-5


def test_gradient_only_for_some_inputs():
    q, k, v = qkv()
    q.requires_grad_()
    out = block_sparse_attention(q, k, v, LAYOUT)
    out.sum().backward()
    r = attention_reference(q, k, v, LAYOUT, do=torch.ones_like(out))
    assert rel_err(q.grad, r[2]) <= 1e-5 and k.grad is None


def test_inputs_without_grad_give_a_plain_tensor():
    q, k, v = qkv(dtype=torch.bfloat16)
    out = block_sparse_attention(q, k, v, LAYOUT)
    assert out.dtype == torch.bfloat16 and not out.requires_grad and not torch.isnan(out).any()


def test_demo_subcommand_runs_and_passes(capsys):
    from sparse_io_attn.cli import main

    code = main(["demo", "--seq-len", "256", "--block", "32", "--heads", "2", "--head-dim", "16",
                 "--repeats", "1", "--pattern", "bigbird:causal"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "=> PASS" in text and "█" in text and "SDPA, same mask" in text


def test_resolve_backend_for_an_op_without_the_cpu_kernel():
    """Ops with fewer backends (sparse operands: torch and triton) resolve "auto" through the same
    function: triton on CUDA, torch elsewhere; a backend the op lacks is refused by name."""
    ops_backends = ("torch", "triton")
    assert resolve_backend("auto", torch.device("cpu"), supported=ops_backends) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), supported=ops_backends) == "triton"
    assert resolve_backend("auto", torch.device("meta"), supported=ops_backends) == "torch"
    assert resolve_backend("triton", torch.device("cpu"), supported=ops_backends) == "triton"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'cpu'"):
        resolve_backend("cpu", torch.device("cpu"), supported=ops_backends)
