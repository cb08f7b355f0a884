"""selection_attention under torch.compile(fullgraph=True): one graph whose plan is built from the
indices inside it, so a new selection of the same shapes neither breaks the graph nor recompiles;
and the custom ops under torch.library.opcheck."""
import pytest
import torch

from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.selection import op
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.reference import selection_reference
from sparse_io_attn.block_sparse.reference import rel_err


def _case(B=1, Hq=4, Hkv=2, N=40, D=16, bs=8, K=3, G=2):
    q = torch.randn(B, Hq, N, D, requires_grad=True)
    k = torch.randn(B, Hkv, N, D, requires_grad=True)
    v = torch.randn(B, Hkv, N, D, requires_grad=True)
    nkb = -(-N // bs)
    return q, k, v, (lambda: torch.randint(-1, nkb, (B, G, N, K))), bs


def test_fullgraph_no_recompile_on_new_indices():
    q, k, v, fresh, bs = _case()
    frames = []

    def count(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, idx: selection_attention(q, k, v, idx, block_size=bs, causal=True,
                                                                backend="torch", check=False),
                       backend=count, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            idx = fresh()
            out = fn(q, k, v, idx)
            do = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), do)
            ref = selection_reference(q, k, v, Selection(idx, bs), causal=True, do=do)
            assert rel_err(out.detach(), ref[0]) < 1e-5
            assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, ref[2:]))
    assert len(frames) == 1


@pytest.mark.parametrize("backend", ["torch"])
def test_opcheck(backend):
    q, k, v, fresh, bs = _case()
    plan = SelectionPlan(Selection(fresh(), bs), k.shape[2], 0)
    args = (q, k, v, plan.rows, plan.row_counts, None, list(plan.meta), plan.causal_offset, 0.25, backend)
    torch.library.opcheck(op.selection_attn_fwd, args)
    out, _, stats, _ = op.selection_attn_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    torch.library.opcheck(op.selection_attn_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                                                  stats, *args[3:]))
    low = [a.detach().to(torch.bfloat16).requires_grad_() for a in (q, k, v)]
    ext = (*low, *args[3:], torch.randn(q.shape[1], requires_grad=True), True)       # sinks, residual
    torch.library.opcheck(op.selection_attn_fwd, ext)
    out, _, stats, res = op.selection_attn_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in ext])
    delta = (out.float() + res.float()).mul(torch.randn_like(out).float()).sum(-1)
    torch.library.opcheck(op.selection_attn_bwd, (torch.randn_like(out), *(t.detach() for t in low), out, stats,
                                                  *args[3:], delta))


def test_direct_op_call_with_bad_rows_is_refused():
    q, k, v, fresh, bs = _case()
    plan = SelectionPlan(Selection(fresh(), bs), k.shape[2], None)
    rows = plan.rows.clone()
    rows[0, 0, 0] = 99                                     # key block 99 of 5
    meta = list(plan.meta)
    meta[-1] = 0                                           # not built by the library
    with pytest.raises(ValueError, match=r"ascending key blocks in \[0, 5\)"):
        op.selection_attn_fwd(q.detach(), k.detach(), v.detach(), rows, plan.row_counts, None, meta, None, 0.25,
                              "torch")
