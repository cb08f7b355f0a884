"""sparse_operands.attention with ``A1``, ``A2``, ``A3`` given as lists of ``B`` BlockSparseMatrix (a block pattern
per batch element), mixed with per-head X/Y lists, shared and 3-D dense operands and per-batch/per-head
QK layouts: outputs and every list element's ``values.grad`` against the float64 reference on both
backends, counted traffic == the model, the per-group models equal the single-group calls, plans once
per distinct pattern, Theorem 4.5's counts per (b, h), and the errors for malformed lists."""
import math

import pytest
import torch

from helpers import check_bad_operands
from sparse_io_attn import sparse_operands
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.bounds import nnz_stats
from sparse_io_attn.bounds.heads import head_nnz_stats
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands import plan as plan_mod
from sparse_io_attn.sparse_operands.reference import OPERANDS, attention_reference

LEAD = {"A1": "batch", "A2": "batch", "A3": "batch", "X": "head", "Y": "head"}


def _bsm(shape, block, density, g, *, empty_row=False, zero_block=False, empty=False):
    """A random BlockSparseMatrix of block density ``density`` (at least one stored block unless
    ``empty``: none); ``empty_row``: block row 0 stores nothing; ``zero_block``: one stored block
    holds zeros."""
    R, C = math.ceil(shape[0] / block), math.ceil(shape[1] / block)
    keep = torch.rand(R, C, generator=g) < density
    keep[-1, torch.randint(C, (1,), generator=g)] = True
    if empty_row:
        keep[0] = False
    if empty:
        keep[:] = False
    m = BlockSparseMatrix.random(keep, block, shape=shape, generator=g)
    if zero_block:
        m.values[-1] = 0.0
    return m


def make(B, H, nq, nk, d, dv, blk, kinds, *, qk=None, seed=0, empty_row=(), zero_block=(), empty=(),
         qk_empty_row=False):
    """Operands ``(A1, A2, A3, X, Y)``, the QK layout and ``do``. ``kinds[name]``: ``"list"`` (one
    BlockSparseMatrix per batch element for A, per head for X/Y), ``"dense3"`` (``[B|H, r, c]``),
    ``"dense2"`` (shared 2-D), ``"bsm"`` (one shared matrix). ``empty_row``/``zero_block``/``empty``:
    the ``(name, index)`` list elements with an empty block row 0 / an all-zero stored block / no
    stored block. ``qk``:
    None, ``"per-batch"`` (``[B, 1]``), ``"per-batch-head"`` (``[B, H]``)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"A1": (nq, d), "A2": (nk, d), "A3": (nk, d), "X": (d, d), "Y": (d, dv)}
    ops = {}
    for name, shape in shapes.items():
        L = B if LEAD[name] == "batch" else H
        kind = kinds.get(name, "dense3")
        scale = 1 / math.sqrt(shape[0]) if name in ("X", "Y") else 1.0
        if kind == "list":
            ops[name] = [_bsm(shape, blk, 0.6, g, empty_row=(name, i) in empty_row,
                              zero_block=(name, i) in zero_block, empty=(name, i) in empty) for i in range(L)]
        elif kind == "bsm":
            ops[name] = _bsm(shape, blk, 0.6, g)
        elif kind == "dense3":
            ops[name] = torch.randn(L, *shape, generator=g) * scale
        else:
            ops[name] = torch.randn(*shape, generator=g) * scale
    layout = None
    if qk is not None:
        lead = {"per-batch": (B, 1), "per-batch-head": (B, H)}[qk]
        keep = torch.rand(*lead, math.ceil(nq / blk), math.ceil(nk / blk), generator=g) < 0.7
        keep[..., :, 0] = True
        if qk_empty_row:
            keep[0, ..., 0, :] = False  # batch element 0: query block 0 attends to no key
        layout = BlockSparseLayout.from_block_mask(keep, blk, (nq, nk))
    do = torch.randn(B, H, nq, dv, generator=g)
    return tuple(ops[n] for n in ("A1", "A2", "A3", "X", "Y")), layout, do


def _leaves(t) -> list:
    """The tensors whose ``.grad`` a backward fills: each list element's ``values``, a matrix's
    ``values``, or the dense tensor."""
    if isinstance(t, (list, tuple)):
        return [m.values for m in t]
    return [t.values if isinstance(t, BlockSparseMatrix) else t]


def run_and_check(ops, qk, do, backend, tol):
    """Forward + backward through ``sparse_operands.attention``; output, lse and every leaf's ``.grad``
    against the float64 reference. Returns the counted traffic."""
    A1, A2, A3, X, Y = ops
    named = dict(zip(OPERANDS, (A1, X, A2, A3, Y)))
    for t in named.values():
        for leaf in _leaves(t):
            leaf.requires_grad_(True)
            leaf.grad = None
    with IOCounter() as io:
        o, lse = sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk, scale=0.5, backend=backend, return_lse=True)
        o.backward(do)
    ref_o, ref_lse, ref_g = attention_reference(A1, A2, A3, X, Y, qk_layout=qk, scale=0.5, do=do)
    assert o.shape == ref_o.shape and not torch.isnan(o).any()
    assert rel_err(o.detach(), ref_o) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < tol
    for name, t in named.items():
        want = ref_g[name] if isinstance(t, (list, tuple)) else [ref_g[name]]
        got = [leaf.grad for leaf in _leaves(t)]
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            assert a is not None and a.shape == b.shape and not torch.isnan(a).any(), (name, i)
            if b.numel():  # a matrix that stores no block has an empty gradient
                assert (a.double() - b).abs().max() <= tol * max(b.abs().max().item(), 1e-6), (name, i)
    return io.report


CASES = [
    # B, H, nq, nk, d, dv, block, kinds, keyword arguments of make
    pytest.param(2, 2, 40, 40, 32, 16, 16, dict(A1="list"), {}, id="A1-list"),
    pytest.param(3, 1, 37, 29, 32, 16, 16, dict(A2="list", A1="dense2", X="bsm"), dict(qk="per-batch"),
                 id="A2-list-ragged-qk-per-batch"),
    pytest.param(2, 2, 32, 45, 32, 16, 16, dict(A3="list", Y="list", A1="bsm"), dict(zero_block={("A3", 1)}),
                 id="A3-list-Y-list-zero-block"),
    pytest.param(2, 2, 45, 38, 32, 16, 16, dict(A1="list", A2="list", A3="list", X="list"),
                 dict(qk="per-batch-head", empty_row={("A1", 0)}, zero_block={("A2", 1)}, qk_empty_row=True),
                 id="all-lists-X-list-empty-row-ragged"),
    pytest.param(2, 1, 32, 32, 16, 16, 16, dict(A1="list", A3="list", X="dense2"), dict(empty={("A1", 1)}),
                 id="A1-element-stores-nothing"),
]


@pytest.mark.parametrize("B,H,nq,nk,d,dv,blk,kinds,kw", CASES)
def test_torch_backend_lists_match_float64_reference(B, H, nq, nk, d, dv, blk, kinds, kw):
    ops, qk, do = make(B, H, nq, nk, d, dv, blk, kinds, seed=B * 11 + H, **kw)
    run_and_check(ops, qk, do, "torch", 1e-5)


@pytest.mark.parametrize("B,H,nq,nk,d,dv,blk,kinds,kw", CASES)
def test_triton_lists_match_reference_and_traffic_model(B, H, nq, nk, d, dv, blk, kinds, kw):
    """The Triton kernels (interpreter, fp32): one launch per kernel, outputs and every list
    element's gradient against the reference, counted traffic == predict_traffic, and the per-group
    shares sum to it."""
    ops, qk, do = make(B, H, nq, nk, d, dv, blk, kinds, seed=B * 13 + H, **kw)
    counted = run_and_check(ops, qk, do, "triton", 1e-4)
    assert all(kt.launches == 1 for kt in counted.kernels.values()), counted
    predicted = sparse_operands.predict_traffic(*ops, qk_layout=qk)
    assert counted == predicted, f"\n{counted}\n{predicted}"
    shares = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    assert set(shares) == {(b, h) for b in range(B) for h in range(H)}
    assert sum(r.total_bytes for r in shares.values()) == predicted.total_bytes


def test_empty_block_row_gives_structurally_zero_scores():
    """Batch element 0's A1 stores nothing in block row 0: those queries' scores are exactly 0, so
    (no QK layout) their output is the mean of ``h = A3 Y`` over all keys; element 1 is unaffected."""
    ops, _, _ = make(2, 1, 32, 24, 16, 16, 16, dict(A1="list", X="dense2", Y="dense2"), empty_row={("A1", 0)})
    A1, A2, A3, X, Y = ops
    for backend in ("torch", "triton"):
        o = sparse_operands.attention(A1, A2, A3, X, Y, backend=backend)
        mean_h = (A3[0].double() @ Y.double()).mean(dim=0)
        assert torch.allclose(o[0, 0, :16].double(), mean_h.expand(16, -1), atol=1e-5), backend
        ref = attention_reference(A1, A2, A3, X, Y)[0]
        assert rel_err(o, ref) < 1e-5, backend


def test_lists_equal_the_same_matrices_as_dense_batches():
    """A list of matrices gives the output of the 3-D dense stack of the same matrices (torch path,
    where both are exact products of the same numbers up to fp32 rounding)."""
    ops, qk, _ = make(3, 2, 24, 24, 16, 8, 8, dict(A1="list", A2="list", A3="list", X="list"), qk="per-batch")
    stacked = [torch.stack([m.to_dense() for m in t]) for t in ops[:4]] + [ops[4]]
    a = sparse_operands.attention(*ops, qk_layout=qk, backend="torch")
    b = sparse_operands.attention(*stacked, qk_layout=qk, backend="torch")
    assert torch.allclose(a, b, atol=1e-6)


def test_group_shares_equal_single_group_calls():
    """Every (b, h) share of the model is the model of the single call on batch element b's and head
    h's matrices (every group has a structurally zero score block, so the kernels' HAS_ZERO agrees),
    and the multiply-add model is the sum of the single calls' models."""
    B, H, nq, nk, d, dv, blk = 3, 2, 45, 38, 32, 16, 16
    kinds = dict(A1="list", A2="list", A3="list", X="list", Y="list")
    ops, qk, _ = make(B, H, nq, nk, d, dv, blk, kinds, qk="per-batch-head", seed=7,
                      empty_row={("A1", b) for b in range(B)})
    A1, A2, A3, X, Y = ops
    shares = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    macs = sparse_operands.predict_dot_macs(*ops, qk_layout=qk)
    mask = qk.to_block_mask()
    want_macs: dict = {}
    for b in range(B):
        for h in range(H):
            lay = BlockSparseLayout.from_block_mask(mask[b, h], blk, (nq, nk))
            single = (A1[b], A2[b], A3[b], X[h], Y[h])
            assert shares[(b, h)] == sparse_operands.predict_traffic(*single, qk_layout=lay), (b, h)
            for k, v in sparse_operands.predict_dot_macs(*single, qk_layout=lay).items():
                want_macs[k] = want_macs.get(k, 0) + v
    assert macs == want_macs


def test_list_gradient_buffers_are_shared_along_the_list_axis():
    """The per-group gradient buffer of a per-batch list is ``[1, H, values...]`` (the batch
    elements write disjoint tiles of the concatenated values), of a per-head list ``[B, 1, ...]``,
    of a 3-D dense operand ``[B, H, ...]``."""
    from sparse_io_attn.sparse_operands.operands import check_batch, check_operands, grouped_buffer
    from sparse_io_attn.sparse_operands.problem import build_problem

    ops, qk, _ = make(3, 2, 32, 32, 16, 16, 16, dict(A1="list", X="list"))
    blocks, _, _ = check_operands(*ops, qk, 1.0, "triton")
    batch = check_batch(*ops, qk)
    p = build_problem(*ops, qk, blocks, batch)
    nnz = sum(m.nnz_blocks for m in ops[0])
    assert grouped_buffer(p.A1, batch, zero=True).data.shape == (1, 2, nnz, 16, 16)
    assert grouped_buffer(p.X, batch, zero=True).data.shape[:2] == (3, 1)
    assert grouped_buffer(p.A2, batch, zero=False).data.shape == (3, 2, 32, 16)


def test_plans_built_once_per_distinct_pattern(monkeypatch):
    """Four batch elements on two distinct A1 patterns (X shared): two patterns of Q = A1 X, two
    score plans built, and the kernels' concatenated plan holds each once (groups 0, 2 and 1, 3
    share a part); the kernels on it match the reference and the model."""
    from sparse_io_attn.sparse_operands.operands import check_batch, check_operands
    from sparse_io_attn.sparse_operands.problem import build_problem

    cache = plan_mod.PlanCache()
    monkeypatch.setattr(plan_mod, "CACHE", cache)
    g = torch.Generator().manual_seed(3)
    p0 = torch.tensor([[True, False], [False, False], [True, True]])
    p1 = torch.ones(3, 2, dtype=torch.bool)
    A1 = [BlockSparseMatrix.random(p, 16, shape=(40, 32), generator=g) for p in (p0, p1, p0, p1)]
    ops = (A1, torch.randn(4, 48, 32, generator=g), torch.randn(48, 32, generator=g),
           torch.randn(32, 32, generator=g) / 6, torch.randn(32, 16, generator=g))
    predicted = sparse_operands.predict_traffic(*ops)
    assert sum(1 for k in cache.entries if k[0] == "attention") == 2
    blocks, _, _ = check_operands(*ops, None, 1.0, "triton")
    p = build_problem(*ops, None, blocks, check_batch(*ops, None))
    assert len(p.plans.parts) == 2 and p.plans.ids.tolist() == [0, 1, 0, 1] and p.plans.counts == (2, 2)
    counted = run_and_check(ops, None, torch.randn(4, 1, 40, 16, generator=g), "triton", 1e-4)
    assert counted == predicted


def test_head_nnz_stats_with_batch_lists():
    """bounds.heads.head_nnz_stats on per-batch A1/A2 lists and a per-head X list: per (b, h) the
    counts of nnz_stats on that element's and head's matrices; the totals are their sums."""
    B, H = 2, 3
    ops, qk, _ = make(B, H, 32, 40, 16, 16, 8, dict(A1="list", A2="list", X="list"), qk="per-batch-head", seed=4)
    A1, A2, _, X, _ = ops
    st = head_nnz_stats(A1, X, A2, qk)
    assert (st.B, st.H, len(st.per_head)) == (B, H, B * H)
    mask = qk.to_block_mask()
    for b in range(B):
        for h in range(H):
            lay = BlockSparseLayout.from_block_mask(mask[b, h], 8, (32, 40))
            assert st.stats(b, h) == nnz_stats(A1[b], X[h], A2[b], lay), (b, h)
    for count in ("Z_A", "Z_X", "Z_AX", "Z_AXA"):
        assert getattr(st, count) == sum(getattr(s, count) for s in st.per_head), count
    assert st.Z_AXA > 0
    with pytest.raises(ValueError, match="inconsistent batch sizes"):
        head_nnz_stats(A1[:1] * 3, X, A2, None)


def _bad_cases():
    g = torch.Generator().manual_seed(0)
    m = lambda R, C, blk, **kw: BlockSparseMatrix.random(torch.ones(R, C, dtype=torch.bool), blk,  # noqa: E731
                                                          generator=g, **kw)
    return [
        pytest.param(dict(A1=[m(3, 2, 8)] * 3), {}, ValueError, "inconsistent batch sizes: A1=3, A2=2",
                     id="A-list-length-vs-3d"),
        pytest.param(dict(A1=[m(3, 2, 8)] * 2, A3=[m(3, 2, 8)] * 3), {}, ValueError,
                     "inconsistent batch sizes: A1=2, A2=2, A3=3", id="A-lists-disagree"),
        pytest.param(dict(A2=[m(3, 2, 8)] * 3),
                     dict(qk_layout=BlockSparseLayout.from_block_mask(torch.ones(2, 1, 3, 3, dtype=torch.bool),
                                                                      8, (24, 24))),
                     ValueError, r"inconsistent batch sizes: A1=2, A2=3, A3=2, qk_layout.layout_batch=2",
                     id="A-list-length-vs-layout"),
        pytest.param(dict(X=[m(2, 2, 8)] * 3), {}, ValueError, "inconsistent head sizes: X=3, Y=4",
                     id="X-list-length-vs-H"),
        pytest.param(dict(A1=[m(3, 2, 8), m(2, 2, 8)]), {}, ValueError,
                     r"the matrices in A1 \(one per batch element\) must share shape.*A1\[1\] has shape \(16, 16\)",
                     id="list-mixed-shapes"),
        pytest.param(dict(A3=[m(3, 2, 8), m(3, 1, (8, 16))]), {}, ValueError,
                     r"A3\[1\] has shape \(24, 16\), block size \(8, 16\)", id="list-mixed-blocks"),
        pytest.param(dict(A2=[m(3, 2, 8), m(3, 2, 8, dtype=torch.float16)]), {}, ValueError,
                     "must share shape, block size, dtype", id="list-mixed-dtype"),
        pytest.param(dict(A1=[m(3, 2, 8), torch.randn(24, 16)]), {}, TypeError,
                     "A1 as a list must hold one BlockSparseMatrix per batch element", id="list-with-dense"),
        pytest.param(dict(A3=[]), {}, TypeError, r"one BlockSparseMatrix per batch element \(at least one\)",
                     id="empty-list"),
        pytest.param(dict(A2=[m(3, 2, 8)] * 2), dict(backend="triton"),
                     ValueError, "powers of two >= 16", id="triton-small-block"),
        pytest.param(dict(A2=[m(3, 2, 8)] * 2, A3=[m(2, 2, (12, 8))] * 2), {}, ValueError,
                     r"inconsistent block sizes along the key \(A2, A3 rows\) axis: A2=8, A3=12", id="A2-A3-key-block"),
    ]


@pytest.mark.parametrize("over,kw,err,match", _bad_cases())
def test_bad_lists_raise(over, kw, err, match):
    check_bad_operands(over, err, match, n=24, seed=1, **kw)
