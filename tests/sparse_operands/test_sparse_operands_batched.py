"""sparse_operands.attention in the batched, multi-head form: ``A [B, n, d]``, per-head ``X``/``Y`` (dense
``[H, ...]``, one shared BlockSparseMatrix, or a per-head list), QK layouts shared or per batch/head.
Outputs and gradients (block-sparse ones on their own pattern) against the float64 reference, which
is itself checked against the single-head reference run per ``(b, h)``; the 2-D call is unchanged."""
import math

import pytest
import torch

from helpers import check_bad_operands
from sparse_io_attn import sparse_operands
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.reference import OPERANDS, attention_reference


def _bsm(shape, block, density, g, keep_one=True):
    R, C = math.ceil(shape[0] / block), math.ceil(shape[1] / block)
    keep = torch.rand(R, C, generator=g) < density
    if keep_one:
        keep.view(-1)[torch.randint(R * C, (1,), generator=g)] = True
    return BlockSparseMatrix.random(keep, block, shape=shape, generator=g)


def make_batched(B, H, nq, nk, d, dv, blk, *, x="list", y="dense", qk="per-head", a="dense", density=0.5,
                 seed=0, empty_rows=0):
    """Operands of one batched call. ``x``/``y``: ``"dense"`` ([H, ...]), ``"shared"`` (one
    BlockSparseMatrix), ``"list"`` (one per head), ``"2d"`` (one dense matrix); ``a``: ``"dense"``
    ([B, n, d]) or ``"sparse"`` (A1, A2 one shared BlockSparseMatrix); ``qk``: None, ``"shared"``,
    ``"per-head"`` ([1, H]), ``"per-batch-head"`` ([B, H])."""
    g = torch.Generator().manual_seed(seed)

    def head_op(kind, shape):
        if kind == "dense":
            return torch.randn(H, *shape, generator=g) / math.sqrt(shape[0])
        if kind == "2d":
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])
        if kind == "shared":
            return _bsm(shape, blk, density, g)
        return [_bsm(shape, blk, density, g, keep_one=h > 0) for h in range(H)]  # head 0 may be all-zero

    if a == "dense":
        A1, A2 = torch.randn(B, nq, d, generator=g), torch.randn(B, nk, d, generator=g)
    else:
        A1, A2 = _bsm((nq, d), blk, 0.6, g), _bsm((nk, d), blk, 0.6, g)
    A3 = torch.randn(B, nk, d, generator=g)
    X, Y = head_op(x, (d, d)), head_op(y, (d, dv))
    layout = None
    if qk is not None:
        lead = {"shared": (), "per-head": (1, H), "per-batch-head": (B, H)}[qk]
        keep = torch.rand(*lead, math.ceil(nq / blk), math.ceil(nk / blk), generator=g) < 0.6
        keep[..., :empty_rows, :] = False
        layout = BlockSparseLayout.from_block_mask(keep, blk, (nq, nk))
    do = torch.randn(B, H, nq, dv, generator=g)
    return (A1, A2, A3, X, Y), layout, do


def leaves(t):
    if isinstance(t, (list, tuple)):
        return [m.values for m in t]
    return [t.values if isinstance(t, BlockSparseMatrix) else t]


def run(ops, qk, scale, do, backend):
    A1, A2, A3, X, Y = ops
    named = dict(zip(OPERANDS, (A1, X, A2, A3, Y)))
    flat = {n: leaves(t) for n, t in named.items()}
    for ls in flat.values():
        for t in ls:
            t.requires_grad_(True)
    o, lse = sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk, scale=scale, backend=backend, return_lse=True)
    order = [t for n in OPERANDS for t in flat[n]]
    gs = iter(torch.autograd.grad(o, order, do))
    grads = {n: [next(gs) for _ in flat[n]] for n in OPERANDS}
    grads = {n: (g if isinstance(named[n], (list, tuple)) else g[0]) for n, g in grads.items()}
    return o.detach(), lse, grads


def assert_grads_close(grads, ref, tol):
    for name in OPERANDS:
        got, want = grads[name], ref[name]
        if isinstance(want, list):
            assert len(got) == len(want), name
            for h, (a, b) in enumerate(zip(got, want)):
                assert a.shape == b.shape, (name, h)
                if b.numel() == 0:  # a head whose pattern stores no block
                    continue
                assert (a.double() - b).abs().max() <= tol * max(b.abs().max().item(), 1e-6), (name, h)
        else:
            assert got.shape == want.shape, name
            assert rel_err(got, want) < tol, name


CASES = [
    # B, H, nq, nk, d, dv, block, kwargs
    pytest.param(2, 3, 40, 40, 32, 24, 8, dict(x="list", y="dense", qk="per-head"), id="X-per-head-qk-per-head"),
    pytest.param(1, 4, 37, 45, 24, 16, 8, dict(x="shared", y="list", qk="shared"), id="ragged-X-shared-Y-list"),
    pytest.param(3, 2, 33, 29, 16, 16, 8, dict(x="dense", y="shared", qk="per-batch-head", empty_rows=1),
                 id="ragged-qk-per-batch-head-empty-rows"),
    pytest.param(2, 2, 24, 24, 16, 8, 8, dict(x="list", y="2d", qk=None, a="sparse"), id="A-sparse-shared"),
    pytest.param(2, 3, 16, 16, 16, 16, 8, dict(x="2d", y="dense", qk=None), id="X-shared-dense"),
    pytest.param(1, 3, 20, 20, 16, 16, 8, dict(x="list", y="list", qk="shared", density=0.0),
                 id="head0-all-zero-X-and-Y"),
]


@pytest.mark.parametrize("B,H,nq,nk,d,dv,blk,kw", CASES)
def test_batched_reference_equals_single_head_reference_per_group(B, H, nq, nk, d, dv, blk, kw):
    """The batched float64 reference is the 2-D reference run for every (b, h)."""
    ops, qk, do = make_batched(B, H, nq, nk, d, dv, blk, seed=B * 10 + H, **kw)
    out, lse = attention_reference(*ops, qk_layout=qk, scale=0.4)
    A1, A2, A3, X, Y = ops
    mask = None if qk is None else qk.to_block_mask()

    def pick(t, i):
        if isinstance(t, (list, tuple)):
            return t[i]
        return t[i] if isinstance(t, torch.Tensor) and t.dim() == 3 else t

    assert out.shape == (B, H, nq, dv) and lse.shape == (B, H, nq)
    for b in range(B):
        for h in range(H):
            lay = None if mask is None else BlockSparseLayout.from_block_mask(
                mask[b % mask.shape[0], h % mask.shape[1]], blk, (nq, nk))
            o1, l1 = attention_reference(pick(A1, b), pick(A2, b), pick(A3, b), pick(X, h), pick(Y, h),
                                         qk_layout=lay, scale=0.4)
            assert torch.allclose(out[b, h], o1, atol=1e-12), (b, h)
            assert torch.equal(torch.isinf(lse[b, h]), torch.isinf(l1))


@pytest.mark.parametrize("B,H,nq,nk,d,dv,blk,kw", CASES)
def test_torch_backend_batched_matches_float64_reference(B, H, nq, nk, d, dv, blk, kw):
    ops, qk, do = make_batched(B, H, nq, nk, d, dv, blk, seed=B * 7 + H, **kw)
    o, lse, grads = run(ops, qk, 0.4, do, "torch")
    ref_o, ref_lse, ref_g = attention_reference(*ops, qk_layout=qk, scale=0.4, do=do)
    assert o.shape == (B, H, nq, dv) and lse.shape == (B, H, nq) and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    assert_grads_close(grads, ref_g, 1e-4)
    if kw.get("empty_rows"):
        assert (o[:, :, :blk] == 0).all() and torch.isneginf(lse[:, :, :blk]).all()


def test_two_d_call_unchanged_and_equal_to_batched_of_one():
    """The single-head call returns [nq, dv]; the same operands with a leading axis of 1 give
    [1, 1, nq, dv] with the same values."""
    g = torch.Generator().manual_seed(5)
    A1, A2, A3 = (torch.randn(30, 16, generator=g) for _ in range(3))
    X, Y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
    o2 = sparse_operands.attention(A1, A2, A3, X, Y, backend="torch")
    o4 = sparse_operands.attention(A1[None], A2[None], A3[None], X[None], Y[None], backend="torch")
    assert o2.shape == (30, 8) and o4.shape == (1, 1, 30, 8)
    assert torch.allclose(o4[0, 0], o2, atol=1e-6)


@pytest.mark.parametrize("over,err,match", [
    pytest.param(dict(A2=torch.randn(3, 20, 16)), ValueError, "inconsistent batch sizes", id="batch-mismatch"),
    pytest.param(dict(Y=torch.randn(3, 16, 8)), ValueError, "inconsistent head sizes", id="head-mismatch"),
    pytest.param(dict(X=[torch.randn(16, 16)]), TypeError, "one BlockSparseMatrix per head", id="list-of-dense"),
    pytest.param(dict(A1=[torch.randn(20, 16)] * 2), TypeError, "one BlockSparseMatrix per batch element",
                 id="A1-list-of-dense"),
    pytest.param(dict(X=[BlockSparseMatrix.random(torch.ones(2, 2, dtype=torch.bool), 8),
                         BlockSparseMatrix.random(torch.ones(1, 1, dtype=torch.bool), 16)]),
                 ValueError, "must share shape, block size", id="list-mixed-blocks"),
    pytest.param(dict(A1=[BlockSparseMatrix.random(torch.ones(3, 2, dtype=torch.bool), 8)] * 3), ValueError,
                 "inconsistent batch sizes: A1=3, A2=2", id="A1-list-length"),
])
def test_batched_errors(over, err, match):
    check_bad_operands(over, err, match, n=20, seed=0)


def test_head_nnz_stats_per_head_and_summed():
    """bounds.heads: per (b, h) the counts of bounds.nnz_stats on that head's operands and mask;
    the totals are their sums."""
    from sparse_io_attn.bounds import nnz_stats
    from sparse_io_attn.bounds.heads import head_nnz_stats

    ops, qk, _ = make_batched(2, 3, 32, 32, 16, 16, 8, x="list", y="dense", qk="per-batch-head", seed=4)
    A1, A2, _, X, _ = ops
    st = head_nnz_stats(A1, X, A2, qk)
    assert (st.B, st.H, len(st.per_head)) == (2, 3, 6)
    mask = qk.to_block_mask()
    for b in range(2):
        for h in range(3):
            lay = BlockSparseLayout.from_block_mask(mask[b, h], 8, (32, 32))
            assert st.stats(b, h) == nnz_stats(A1[b], X[h], A2[b], lay)
    assert st.Z_X == sum(X[h].nnz for h in range(3)) * 2  # every (b, h) counts its head's X
    assert st.Z_AXA == sum(s.Z_AXA for s in st.per_head) > 0
    assert len(st.bounds(4096)) == 6
    with pytest.raises(ValueError, match="inconsistent head sizes"):
        head_nnz_stats(A1, X, A2, BlockSparseLayout.from_block_mask(mask[:, :2], 8, (32, 32)))


# ---------------------------------------------------------------- triton kernels (interpreter), one launch per kernel
TRITON_CASES = [
    # B, H, nq, nk, d, dv, block, kwargs: a few hundred tiles each
    pytest.param(2, 2, 32, 32, 32, 16, 16, dict(x="list", y="dense", qk="per-head"), id="X-per-head-qk-per-head",
                 marks=pytest.mark.slow),
    pytest.param(1, 3, 37, 29, 32, 16, 16, dict(x="shared", y="list", qk="per-batch-head", empty_rows=1),
                 id="ragged-Y-per-head-empty-rows", marks=pytest.mark.slow),
    pytest.param(2, 2, 33, 20, 32, 16, 16, dict(x="dense", y="shared", qk=None, a="sparse"), id="A-sparse-Y-shared",
                 marks=pytest.mark.slow),
    pytest.param(3, 1, 32, 32, 16, 16, 16, dict(x="2d", y="2d", qk="shared"), id="shared-weights-batch-only"),
    pytest.param(1, 2, 20, 20, 32, 16, 16, dict(x="list", y="dense", qk=None, density=0.0),
                 id="head0-all-zero-X"),
]


@pytest.mark.parametrize("B,H,nq,nk,d,dv,blk,kw", TRITON_CASES)
def test_triton_batched_matches_reference_one_launch_per_kernel_and_model(B, H, nq, nk, d, dv, blk, kw):
    """Every (b, h) group runs in one launch per kernel; outputs and gradients match the float64
    reference; counted traffic equals the batched model, which is the sum of the single-head models
    of the groups."""
    from sparse_io_attn.accounting import IOCounter
    from sparse_io_attn.sparse_operands.traffic import predict_traffic, predict_traffic_per_head

    ops, qk, do = make_batched(B, H, nq, nk, d, dv, blk, seed=B * 5 + H, **kw)
    with IOCounter() as io:
        o, lse, grads = run(ops, qk, 0.4, do, "triton")
    ref_o, ref_lse, ref_g = attention_reference(*ops, qk_layout=qk, scale=0.4, do=do)
    assert o.shape == (B, H, nq, dv) and not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    assert_grads_close(grads, ref_g, 1e-4)
    counted = io.report
    assert all(kt.launches == 1 for kt in counted.kernels.values()), counted
    predicted = predict_traffic(*ops, qk_layout=qk)
    assert counted == predicted, f"\n{counted}\n{predicted}"
    per_head = predict_traffic_per_head(*ops, qk_layout=qk)
    assert len(per_head) == B * H
    assert sum(r.total_bytes for r in per_head.values()) == predicted.total_bytes


def test_triton_batched_plans_built_once_per_distinct_pattern(monkeypatch):
    """Heads sharing a pattern share a plan: 4 groups on 2 distinct X patterns (so 2 patterns of
    Q = A1 X) build 2 score plans."""
    from sparse_io_attn.sparse_operands import plan as plan_mod
    from sparse_io_attn.sparse_operands.traffic import predict_traffic

    cache = plan_mod.PlanCache()
    monkeypatch.setattr(plan_mod, "CACHE", cache)
    g = torch.Generator().manual_seed(3)
    p0 = BlockSparseMatrix.random(torch.tensor([[True, False], [True, False]]), 16, generator=g)
    p1 = BlockSparseMatrix.random(torch.ones(2, 2, dtype=torch.bool), 16, generator=g)
    X = [p0, p1, p0, p1]
    A = torch.randn(2, 48, 32, generator=g)
    predict_traffic(A, A, A, X, torch.randn(4, 32, 16, generator=g))
    assert sum(1 for k in cache.entries if k[0] == "attention") == 2


def test_batched_models_are_sums_of_single_head_models():
    """predict_dot_macs and predict_traffic of a batched call equal the sums over its (b, h) groups
    of the single-head models; the per-program fast memory is the single head's."""
    ops, qk, _ = make_batched(2, 3, 45, 38, 32, 16, 16, x="list", y="list", qk="per-batch-head", seed=11)
    A1, A2, A3, X, Y = ops
    macs = sparse_operands.predict_dot_macs(*ops, qk_layout=qk)
    per = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    assert sparse_operands.predict_traffic(*ops, qk_layout=qk).total_bytes == sum(r.total_bytes for r in per.values())
    mask = qk.to_block_mask()
    want: dict = {}
    single = {}
    for b in range(2):
        for h in range(3):
            lay = BlockSparseLayout.from_block_mask(mask[b, h], 16, (45, 38))
            for k, v in sparse_operands.predict_dot_macs(A1[b], A2[b], A3[b], X[h], Y[h], qk_layout=lay).items():
                want[k] = want.get(k, 0) + v
            single[(b, h)] = sparse_operands.predict_traffic(A1[b], A2[b], A3[b], X[h], Y[h], qk_layout=lay)
    assert macs == want
    assert per == single  # every group has a structurally zero score block here: its share is its own call
    assert sparse_operands.kernel_fast_memory_words(*ops, qk_layout=qk) == sparse_operands.kernel_fast_memory_words(
        A1[0], A2[0], A3[0], X[0], Y[0], qk_layout=BlockSparseLayout.from_block_mask(mask[0, 0], 16, (45, 38)))
