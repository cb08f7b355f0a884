"""The custom ops under `torch.library.opcheck`, and `block_sparse_attention` (the one path of every
call) under `torch.compile(fullgraph=True)` on CPU, for every backend (triton through the interpreter)."""
import functools

import pytest
import torch
from torch import nn

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns, plan
from sparse_io_attn.block_sparse import op
from sparse_io_attn.nn import SparseSelfAttention
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err

from helpers import BACKENDS

# opcheck runs the op a dozen times: through Triton's interpreter that is a slow test
OPCHECK_BACKENDS = [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b for b in BACKENDS]

OP_CASES = [
    pytest.param(dict(B=2, Hq=4, Hkv=2, N=45, D=16, bs=16, causal=True, per_head=False),
                 id="B2-H4-KV2-N45-D16-causal"),
    pytest.param(dict(B=1, Hq=2, Hkv=2, N=40, D=8, bs=(32, 16), causal=False, per_head=True),
                 id="B1-H2-N40-D8-bs32x16-perhead"),
]


def _op_inputs(c):
    bq, bk = (c["bs"], c["bs"]) if isinstance(c["bs"], int) else c["bs"]
    nqb, nkb = -(-c["N"] // bq), -(-c["N"] // bk)
    keep = torch.rand(c["Hq"] if c["per_head"] else 1, nqb, nkb) < 0.6
    keep[..., 0] = True
    elem = keep.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :c["N"], :c["N"]]
    elem &= torch.rand(elem.shape) < 0.8      # element-exact: partial blocks cross the op boundary too
    layout = BlockSparseLayout.from_dense_mask(elem, (bq, bk))
    q = torch.randn(c["B"], c["Hq"], c["N"], c["D"], requires_grad=True)
    k = torch.randn(c["B"], c["Hkv"], c["N"], c["D"], requires_grad=True)
    v = torch.randn(c["B"], c["Hkv"], c["N"], c["D"], requires_grad=True)
    return q, k, v, layout


@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
@pytest.mark.parametrize("case", OP_CASES)
def test_opcheck(case, backend):
    q, k, v, layout = _op_inputs(case)
    p = plan(layout, causal=case["causal"]).for_heads(case["Hq"], case["Hkv"])
    args = (q, k, v, p.index, list(p.meta), p.causal_offset, case["D"] ** -0.5, backend)
    torch.library.opcheck(op.block_sparse_attn_fwd, args)
    out, lse, stats, _ = op.block_sparse_attn_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    do = torch.randn_like(out)
    torch.library.opcheck(op.block_sparse_attn_bwd,
                          (do, q.detach(), k.detach(), v.detach(), out, stats, *args[3:]))
    if backend != "triton":    # the arguments the Triton kernels do not take yet: sinks, residual, delta
        low = [a.detach().to(torch.bfloat16).requires_grad_() for a in (q, k, v)]
        sinks = torch.randn(case["Hq"], requires_grad=True)
        ext = (*low, *args[3:], sinks, True)
        torch.library.opcheck(op.block_sparse_attn_fwd, ext)
        out, _, stats, res = op.block_sparse_attn_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in ext])
        delta = (out.float() + res.float()).mul(torch.randn_like(out).float()).sum(-1)
        torch.library.opcheck(op.block_sparse_attn_bwd, (torch.randn_like(out), *(t.detach() for t in low), out,
                                                         stats, *args[3:], delta))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", OP_CASES)
def test_compiled_call_matches_eager_and_reference(case, backend):
    """``torch.compile(lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=...),
    fullgraph=True)`` forward and backward equal eager (bitwise: the same op runs the same backend)
    and the float64 reference; with the layout or with its plan."""
    q, k, v, layout = _op_inputs(case)
    causal = case["causal"]
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend=backend)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = attention_reference(q, k, v, layout, causal=causal, do=do)
    assert rel_err(out.detach(), ref[0]) < 1e-5
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite)
    assert rel_err(lse[finite], ref[1][finite]) < 1e-5
    for got, want in zip(grads, ref[2:]):
        assert rel_err(got, want) < 1e-5
    for target in (layout, plan(layout, causal=causal)):
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: block_sparse_attention(q, k, v, target, causal=causal, backend=backend),
                           backend="aot_eager", fullgraph=True)
        out_c = fn(q, k, v)
        assert torch.equal(out_c, out)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out_c, (q, k, v), do), grads))


class TinyBlock(nn.Module):
    def __init__(self, pattern, backend, E=32, H=4, kv=2):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.attn = SparseSelfAttention(E, H, pattern, num_kv_heads=kv, causal=True, backend=backend)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _grads(fn, model, x, w):
    model.zero_grad()
    x = x.detach().requires_grad_()
    y = fn(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_matches_eager(backend):
    pattern = functools.partial(patterns.strided, block_size=16, stride=32, causal=True)
    model = TinyBlock(pattern, backend)
    N = 72
    model.attn.layout_for(N)  # a new length is built eagerly (data-dependent), then traced
    x = torch.randn(2, N, 32)
    w = torch.randn(2, N, 32)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    y_c, gx_c, gp_c = _grads(compiled, model, x, w)
    y_e, gx_e, gp_e = _grads(model, model, x, w)
    assert rel_err(y_c, y_e) < 1e-6
    assert rel_err(gx_c, gx_e) < 1e-5
    for name in gp_e:
        if name == "attn.k_proj.bias":  # gradient is 0 up to rounding (softmax shift invariance)
            continue
        assert rel_err(gp_c[name], gp_e[name]) < 1e-5, name

    seen = []
    torch._dynamo.reset()
    torch.compile(model, backend=_recording(seen), fullgraph=True)(x)
    assert "sparse_io_attn.block_sparse_attn_fwd.default" in seen


def _recording(seen):
    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    return backend


def test_compile_new_length_needs_eager_layout():
    """A length whose layout is not cached cannot be built inside a fullgraph trace: the error says
    what to do; without fullgraph the build runs eagerly (one graph break) and the result is right."""
    pattern = functools.partial(patterns.sliding_window, block_size=8, window=8, causal=True)
    model = SparseSelfAttention(16, 2, pattern, causal=True, backend="torch")
    x = torch.randn(1, 40, 16)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="layout_for"):
        torch.compile(model, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    y = torch.compile(model, backend="eager")(x)
    assert torch.equal(y, model(x))
