"""sparse_operands.attention with block-sparse A1, X, A2: outputs and (masked) gradients against a float64 dense
reference, for the torch backend and the Triton kernels (interpreter); counted traffic == model;
counted traffic >= compulsory and >= Theorem 4.5 at the kernels' fast-memory size; the multiply-adds
the interpreter executes in the attention kernels == the model (absent head-dim tiles are skipped)."""
import collections
import contextlib
import functools
import math
import sys

import pytest
import torch

from sparse_io_attn import bounds, sparse_operands
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.accounting.compare import compare
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.sparse_operands.flops import ATTENTION_KERNELS, PRODUCT_KERNELS, predict_dot_macs
from sparse_io_attn.sparse_operands.operands import dense_tensor
from sparse_io_attn.sparse_operands.reference import OPERANDS, attention_reference, stored_blocks
from sparse_io_attn.dense.reference import paper_gradients
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.matrix import BlockSparseMatrix


def _operand(shape, block, density, g, dtype=torch.float32):
    """Dense tensor (density None) or a BlockSparseMatrix with a random block pattern."""
    if density is None:
        return torch.randn(shape, generator=g, dtype=dtype)
    br, bc = block
    R, C = math.ceil(shape[0] / br), math.ceil(shape[1] / bc)
    keep = torch.rand(R, C, generator=g) < density
    keep.view(-1)[torch.randint(R * C, (1,), generator=g)] = True  # never an all-zero operand
    return BlockSparseMatrix.random(keep, block, shape=shape, dtype=dtype, generator=g)


def make_case(nq, nk, d1, d2, d3, dv, bm, bn, bd, dens, qk_density, seed, dtype=torch.float32, empty_rows=0):
    """Operands ``(A1, A2, A3, X, Y)`` with block densities ``dens = (A1, X, A2)`` (None = dense) and a
    QK layout of density ``qk_density`` (None = no layout); ``empty_rows`` query blocks with no key."""
    g = torch.Generator().manual_seed(seed)
    A1 = _operand((nq, d1), (bm, bd), dens[0], g, dtype)
    X = _operand((d1, d2), (bd, bd), dens[1], g, dtype)
    A2 = _operand((nk, d2), (bn, bd), dens[2], g, dtype)
    A3 = torch.randn(nk, d3, generator=g, dtype=dtype)
    Y = torch.randn(d3, dv, generator=g, dtype=dtype) / math.sqrt(d3)
    qk = None
    if qk_density is not None:
        keep = torch.rand(math.ceil(nq / bm), math.ceil(nk / bn), generator=g) < qk_density
        keep[:empty_rows] = False
        qk = BlockSparseLayout.from_block_mask(keep, (bm, bn), (nq, nk))
    do = torch.randn(nq, dv, generator=g, dtype=dtype)
    return (A1, A2, A3, X, Y), qk, do


def reference(ops, qk, scale, do):
    """Float64 ``(O, lse, {name: grad})`` of the operands in the order ``make_case`` returns them."""
    A1, A2, A3, X, Y = ops
    return attention_reference(A1, A2, A3, X, Y, qk_layout=qk, scale=scale, do=do)


def leaves_of(ops):
    A1, A2, A3, X, Y = ops
    return [t.values if isinstance(t, BlockSparseMatrix) else t for t in (A1, X, A2, A3, Y)]


def run(ops, qk, scale, do, backend):
    for t in leaves_of(ops):
        t.requires_grad_(True)
        t.grad = None
    A1, A2, A3, X, Y = ops
    with IOCounter() as io:
        o, lse = sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk, scale=scale, backend=backend, return_lse=True)
        grads = torch.autograd.grad(o, leaves_of(ops), do)
    return o.detach(), lse, dict(zip(OPERANDS, grads)), io.report


# ---------------------------------------------------------------- torch backend (fast, broad)
TORCH_CASES = [
    # nq, nk, d1, d2, d3, dv, bm, bn, bd, densities (A1, X, A2), qk density
    pytest.param((64, 64, 32, 32, 32, 32, 16, 16, 16, (None, None, None), None), id="all-dense"),
    pytest.param((100, 100, 48, 48, 48, 48, 16, 16, 16, (0.5, 0.5, 0.5), None), id="half-N100"),
    pytest.param((100, 100, 48, 48, 48, 48, 16, 16, 16, (0.5, 0.5, 0.5), 0.5), id="half-qk50-N100"),
    pytest.param((150, 150, 64, 64, 64, 64, 16, 16, 16, (0.05, 1.0, 0.05), None), id="A5pct"),
    pytest.param((150, 150, 64, 64, 64, 64, 16, 16, 16, (1.0, 0.05, 1.0), 0.3), id="X5pct-qk30"),
    pytest.param((90, 120, 40, 24, 20, 36, 8, 16, 8, (0.25, 0.25, 0.75), 0.25), id="rect-shapes"),
    pytest.param((64, 64, 32, 32, 32, 32, 16, 16, 16, (1.0, 1.0, 1.0), 1.0), id="all-100pct"),
]


@pytest.mark.parametrize("dims", TORCH_CASES)
def test_torch_backend_matches_float64_reference(dims):
    *shape, dens, qk_d = dims
    ops, qk, do = make_case(*shape, dens, qk_d, seed=hash(str(dims)) % 2**31)
    o, lse, grads, _ = run(ops, qk, 0.35, do, "torch")
    ref_o, ref_lse, ref_g = reference(ops, qk, 0.35, do)
    assert rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    for name in OPERANDS:
        assert grads[name].shape == ref_g[name].shape, name
        assert rel_err(grads[name], ref_g[name]) < 1e-4, name


def test_float64_reference_agrees_with_paper_definitions():
    """The masked reference used here equals the paper's Definitions B.3-B.9 / 3.2 (no QK layout)."""
    ops, _, do = make_case(48, 48, 32, 32, 32, 32, 16, 16, 16, (0.5, 0.6, 0.7), None, seed=3)
    out, _, g = reference(ops, None, 0.5, do)
    A1, A2, A3, X, Y = (dense_tensor(t).double() for t in ops)
    pg = paper_gradients(A1, A2, A3, X, Y, do.double(), scale=0.5)
    assert rel_err(g["A3"], pg["dA3"]) < 1e-12 and rel_err(g["Y"], pg["dY"]) < 1e-12
    for name, key, m in (("A1", "dA1", ops[0]), ("X", "dX", ops[3]), ("A2", "dA2", ops[1])):
        assert rel_err(g[name], stored_blocks(pg[key], m)) < 1e-12, name


# ---------------------------------------------------------------- triton kernels (interpreter)
TRITON_CASES = {
    # id: (nq, nk, d1, d2, d3, dv, bm, bn, bd, densities (A1, X, A2), qk density, empty qk rows)
    "dense-N40": (40, 40, 32, 32, 32, 32, 16, 16, 16, (None, None, None), None, 0),
    "sparse50-qk60-N70-d48": (70, 70, 48, 48, 48, 40, 16, 16, 16, (0.5, 0.5, 0.5), 0.6, 0),
    "X30-dense-A-N50": (50, 50, 48, 48, 32, 32, 16, 16, 16, (None, 0.3, None), None, 0),
    "A5pct-N96-d64": (96, 96, 64, 64, 32, 32, 16, 16, 16, (0.05, None, 0.05), None, 0),
    "A100-X100-qk100": (48, 48, 32, 32, 32, 32, 16, 16, 16, (1.0, 1.0, 1.0), 1.0, 0),
    "empty-qk-rows-N64": (64, 64, 32, 32, 32, 32, 16, 16, 16, (0.6, 0.6, 0.6), 0.5, 1),
    "rect-nq40-nk72-bn32": (40, 72, 32, 48, 24, 20, 16, 32, 16, (0.7, 0.5, 0.4), 0.7, 0),
}


_KERNEL_FRAMES = {f"_{k}_kernel": k for k in ATTENTION_KERNELS} | {"_bsr_matmul_kernel": "products"}
DOT_MACS: dict = {}  # case id -> {attention kernel or "products": multiply-adds executed by tl.dot}


@contextlib.contextmanager
def count_dot_macs():
    """Tally ``M * N * K`` of every ``tl.dot`` the interpreter executes, per attention kernel and for
    all products together (found by the kernel function's frame on the Python stack), independently
    of the kernels' own code."""
    tally = collections.Counter()
    if not INTERPRET:
        yield tally
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    orig = builder.create_dot

    def create_dot(a, b, d, *args):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name not in _KERNEL_FRAMES:
            f = f.f_back
        if f is not None:
            (m, k), n = a.data.shape, b.data.shape[1]
            tally[_KERNEL_FRAMES[f.f_code.co_name]] += m * n * k
        return orig(a, b, d, *args)

    builder.create_dot = create_dot
    try:
        yield tally
    finally:
        del builder.create_dot


@functools.lru_cache(maxsize=None)
def triton_run(case_id: str):
    *shape, dens, qk_d, empty = TRITON_CASES[case_id]
    ops, qk, do = make_case(*shape, dens, qk_d, seed=sum(map(ord, case_id)), empty_rows=empty)
    with count_dot_macs() as macs:
        res = run(ops, qk, 0.4, do, "triton")
    DOT_MACS[case_id] = dict(macs)
    return ops, qk, do, res


@pytest.mark.parametrize("case_id", list(TRITON_CASES))
def test_triton_matches_float64_reference(case_id):
    ops, qk, do, (o, lse, grads, _) = triton_run(case_id)
    ref_o, ref_lse, ref_g = reference(ops, qk, 0.4, do)
    assert not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    for name in OPERANDS:
        assert grads[name].shape == ref_g[name].shape, name
        assert not torch.isnan(grads[name]).any(), name
        assert rel_err(grads[name], ref_g[name]) < 1e-5, (name, rel_err(grads[name], ref_g[name]))
    if qk is not None and TRITON_CASES[case_id][-1]:
        rows = TRITON_CASES[case_id][-1] * TRITON_CASES[case_id][6]
        assert (o[:rows] == 0).all() and torch.isinf(lse[:rows]).all()


@pytest.mark.parametrize("case_id", list(TRITON_CASES))
def test_counted_traffic_equals_model(case_id):
    ops, qk, _, (*_, counted) = triton_run(case_id)
    A1, A2, A3, X, Y = ops
    predicted = sparse_operands.predict_traffic(A1, A2, A3, X, Y, qk_layout=qk)
    assert predicted.source == "predicted" and counted.source == "counted"
    assert counted == predicted, f"\n{counted}\n{predicted}"
    assert counted.total_bytes == predicted.total_bytes > 0


@pytest.mark.parametrize("case_id", list(TRITON_CASES))
def test_executed_dot_macs_equal_model(case_id):
    """Tiles absent from either operand cost no FLOPs: the multiply-adds executed per attention
    kernel (and by all products together) equal the model, which counts only the head-dim tiles
    stored in both Q = A1 X and A2 (column tiles stored in both B and C for products)."""
    if not INTERPRET:
        pytest.skip("tl.dot work is counted through Triton's interpreter")
    ops, qk, _, _ = triton_run(case_id)
    A1, A2, A3, X, Y = ops
    executed = DOT_MACS[case_id]
    model = predict_dot_macs(A1, A2, A3, X, Y, qk_layout=qk)
    assert set(executed) <= set(ATTENTION_KERNELS) | {"products"}
    for k in ATTENTION_KERNELS:
        assert executed.get(k, 0) == model[k], (k, executed, model)
    assert executed["products"] == sum(model[k] for k in PRODUCT_KERNELS) > 0, (executed, model)


# cases whose shapes nnz_stats takes (square X, whole blocks: scipy's BSR rounds shapes up to blocks)
BOUND_CASES = ["dense-N40", "X30-dense-A-N50", "A5pct-N96-d64", "A100-X100-qk100", "empty-qk-rows-N64"]


@pytest.mark.parametrize("case_id", list(TRITON_CASES))
def test_counted_traffic_is_above_compulsory(case_id):
    """Data bytes moved >= every stored input element read once (dO too) and O plus the five
    gradients written once."""
    ops, qk, _, (*_, counted) = triton_run(case_id)
    A1, A2, A3, X, Y = ops
    stored = sum((t.nnz if isinstance(t, BlockSparseMatrix) else t.numel()) for t in (A1, X, A2, A3, Y))
    out = A1.shape[0] * Y.shape[1]
    assert _data_bytes(counted) >= 4 * (2 * stored + 2 * out)


@pytest.mark.parametrize("case_id", BOUND_CASES)
def test_counted_traffic_is_above_theorem_4_5(case_id):
    """Counted data words >= max(compulsory, Theorem 4.5 with unit constants) at M = the kernels'
    per-program fast memory. (At these interpreter sizes M is close to the whole problem, so the
    bound is small; test_sparse_operands_traffic.py checks the model, equal to the count, at n = 2048.)"""
    ops, qk, _, (*_, counted) = triton_run(case_id)
    A1, A2, A3, X, Y = ops
    M = sparse_operands.kernel_fast_memory_words(A1, A2, A3, X, Y, qk_layout=qk)
    st = bounds.nnz_stats(A1, X, A2, qk, level="element")
    assert st.Z_A == min(_nnz(A1), _nnz(A2)) and st.Z_X == _nnz(X)
    b = bounds.sparse(st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA, M, n=A1.shape[0], d=X.shape[0], dtype=torch.float32)
    c = compare(_data_bytes(counted), b)
    assert c.measured_bytes >= c.floor_bytes > 0, c.table()


def _nnz(t) -> int:
    return t.nnz if isinstance(t, BlockSparseMatrix) else int((t != 0).sum())


def _data_bytes(report) -> int:
    """Bytes of matrix data (index lists and block maps excluded)."""
    index = sum(sum(report.per_tensor().get(t, (0, 0))) for t in ("plan", "layout", "q_map", "a2_map"))
    return report.total_bytes - index


def test_triton_backward_is_deterministic():
    ops, qk, do = make_case(48, 48, 32, 32, 32, 32, 16, 16, 16, (0.6, 0.6, 0.6), 0.7, seed=11)
    g1 = run(ops, qk, 0.4, do, "triton")[2]
    g2 = run(ops, qk, 0.4, do, "triton")[2]
    for name in OPERANDS:
        assert torch.equal(g1[name], g2[name]), name


def test_structurally_zero_rows_give_uniform_attention():
    """A query block whose A1 row block is empty has Q = 0: all its scores are 0, not masked, so
    its output is the mean of h over its QK keys (here all keys)."""
    g = torch.Generator().manual_seed(5)
    keep = torch.ones(3, 2, dtype=torch.bool)
    keep[1] = False
    A1 = BlockSparseMatrix.random(keep, 16, shape=(48, 32), generator=g)
    A2, A3 = torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)
    X, Y = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
    o = sparse_operands.attention(A1, A2, A3, X, Y, backend="triton")
    h_mean = (A3 @ Y).mean(dim=0)
    assert rel_err(o[16:32], h_mean.expand(16, -1)) < 1e-5
    assert rel_err(o, sparse_operands.attention(A1, A2, A3, X, Y, backend="torch")) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_matches_same_precision_baseline(dtype):
    """bf16/fp16 through the kernels (fp32 tl.dot under the interpreter) vs the torch backend in the
    same dtype: the kernel's error to float64 is at most 2x the baseline's (outputs), 3x (gradients)."""
    ops, qk, do = make_case(48, 48, 32, 32, 32, 32, 16, 16, 16, (0.6, 0.6, 0.6), 0.8, seed=21, dtype=dtype)
    o, _, gk, _ = run(ops, qk, 0.4, do, "triton")
    ob, _, gb, _ = run(ops, qk, 0.4, do, "torch")
    ref_o, _, ref_g = reference(ops, qk, 0.4, do)
    assert rel_err(o, ref_o) <= 2 * rel_err(ob, ref_o) + 1e-3
    for name in OPERANDS:
        assert rel_err(gk[name], ref_g[name]) <= 3 * rel_err(gb[name], ref_g[name]) + 1e-3, name


# ---------------------------------------------------------------- errors
def _ops(**over):
    g = torch.Generator().manual_seed(0)
    d = dict(A1=torch.randn(32, 16, generator=g), A2=torch.randn(32, 16, generator=g),
             A3=torch.randn(32, 16, generator=g), X=torch.randn(16, 16, generator=g),
             Y=torch.randn(16, 16, generator=g))
    d.update(over)
    return d


@pytest.mark.parametrize("over,kw,err,match", [
    pytest.param(dict(X=torch.randn(16, 8)), {}, ValueError, r"X must have shape", id="X-shape"),
    pytest.param(dict(A3=torch.randn(30, 16)), {}, ValueError, "A3 must have as many rows", id="A3-rows"),
    pytest.param(dict(Y=torch.randn(8, 16)), {}, ValueError, "Y must have 16 rows", id="Y-rows"),
    pytest.param(dict(A1=torch.randn(1, 2, 32, 16)), {}, ValueError, "must be 2-D", id="4d"),
    pytest.param(dict(A1=[[1.0]]), {}, TypeError, "A1 as a list must hold one BlockSparseMatrix per batch element",
                 id="list"),
    pytest.param(dict(A1="A1"), {}, TypeError, "A1 must be a torch.Tensor, a BlockSparseMatrix or a list", id="str"),
    pytest.param(dict(A1=torch.randn(32, 16).double()), {}, TypeError, "dtype", id="float64"),
    pytest.param(dict(A2=torch.randn(32, 16).half()), {}, TypeError, "share a dtype", id="mixed-dtype"),
    pytest.param({}, dict(backend="cuda"), ValueError, "backend must be one of", id="backend"),
    pytest.param({}, dict(qk_layout=BlockSparseLayout.from_block_mask(torch.ones(2, 3, dtype=torch.bool), 16)),
                 ValueError, "qk_layout was built for seqlen", id="qk-seqlen"),
    pytest.param(dict(A1=BlockSparseMatrix.random(torch.ones(4, 2, dtype=torch.bool), 8)),
                 dict(qk_layout=BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 16)),
                 ValueError, "inconsistent block sizes along the query", id="block-mismatch"),
    pytest.param(dict(A1=BlockSparseMatrix.random(torch.ones(4, 2, dtype=torch.bool), 8)), dict(backend="triton"),
                 ValueError, "powers of two >= 16", id="triton-small-block"),
    pytest.param(dict(A3=BlockSparseMatrix.random(torch.ones(4, 2, dtype=torch.bool), 8)),
                 dict(qk_layout=BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 16)),
                 ValueError, r"inconsistent block sizes along the key \(A2, A3 rows\) axis: A3=8", id="A3-block-key"),
    pytest.param(dict(A3=BlockSparseMatrix.random(torch.ones(2, 1, dtype=torch.bool), 16),
                      Y=BlockSparseMatrix.random(torch.ones(2, 2, dtype=torch.bool), 8)), {}, ValueError,
                 "inconsistent block sizes along the A3 column / Y row axis", id="A3-Y-block-mismatch"),
])
def test_errors(over, kw, err, match):
    ops = _ops(**over)
    with pytest.raises(err, match=match):
        sparse_operands.attention(ops["A1"], ops["A2"], ops["A3"], ops["X"], ops["Y"], **kw)


def test_auto_backend_is_torch_on_cpu_and_block_sparse_weights_train():
    """backend="auto" on a CPU runs the torch path; a pruned X (nn.Parameter values) trains on its
    pattern: SGD steps lower the loss and leave the pattern unchanged."""
    ops, qk, _ = make_case(64, 64, 32, 32, 32, 32, 16, 16, 16, (None, 0.5, None), 0.7, seed=9)
    A1, A2, A3, X, Y = ops
    assert torch.equal(sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk),
                       sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk, backend="torch"))
    X.values = torch.nn.Parameter(X.values.detach().clone())
    target = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([X.values], lr=0.5)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=qk, scale=0.2) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert X.values.grad.shape == X.values.shape and X.nnz_blocks == X.to_block_mask().sum()


def _edge_case(kind: str, g: torch.Generator):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    none = lambda rows, cols, shape: BlockSparseMatrix.random(  # noqa: E731
        torch.zeros(rows, cols, dtype=torch.bool), 16, shape=shape, generator=g)
    if kind == "A1-no-blocks":
        return (none(3, 2, (40, 32)), r(40, 32), r(40, 32), r(32, 32), r(32, 32)), None
    if kind == "X-no-blocks":
        return (r(40, 32), r(40, 32), r(40, 32), none(2, 2, (32, 32)), r(32, 32)), None
    if kind == "qk-empty":
        qk = BlockSparseLayout.from_block_mask(torch.zeros(3, 3, dtype=torch.bool), 16, (40, 40))
        return (r(40, 32), r(40, 32), r(40, 32), r(32, 32), r(32, 32)), qk
    return (r(1, 32), r(1, 32), r(1, 32), r(32, 32), r(32, 32)), None  # "n1"


@pytest.mark.parametrize("kind", ["A1-no-blocks", "X-no-blocks", "qk-empty", "n1"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_edge_cases_match_reference_without_nan(kind, backend):
    ops, qk = _edge_case(kind, torch.Generator().manual_seed(len(kind)))
    do = torch.randn(ops[0].shape[0], 32)
    o, lse, grads, _ = run(ops, qk, 0.5, do, backend)
    ref_o, _, ref_g = reference(ops, qk, 0.5, do)
    assert not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    for name in OPERANDS:
        assert not torch.isnan(grads[name]).any(), name
        if kind == "n1":  # one key: softmax = 1 and dS = dp - delta is 0 up to fp32 rounding, so the
            # A1/X/A2 gradients are exactly 0 in float64: compare against the problem's gradient scale
            scale = max(g.abs().max().item() for g in ref_g.values())
            err = (grads[name].double() - ref_g[name]).abs().max().item() / scale
        else:
            err = rel_err(grads[name], ref_g[name])
        assert err < 1e-5, (name, err)
    if kind == "qk-empty":
        assert (o == 0).all() and torch.isneginf(lse).all()


def _empty_case(kind: str, g: torch.Generator):
    """Operands with no query rows, no keys, a batch of 0 or 0 heads (dense; the output gradient too)."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nq, nk, lead_b, lead_h = {"nq0": (0, 40, (), ()), "nk0": (24, 0, (), ()), "B0": (24, 40, (0,), ()),
                              "H0": (24, 40, (), (0,)), "B0-H2": (24, 40, (0,), (2,))}[kind]
    ops = (r(*lead_b, nq, 32), r(*lead_b, nk, 32), r(*lead_b, nk, 16), r(*lead_h, 32, 32), r(*lead_h, 16, 24))
    batched = lead_b or lead_h
    B, H = (lead_b or (1,))[0], (lead_h or (1,))[0]
    return ops, r(B, H, nq, 24) if batched else r(nq, 24)


@pytest.mark.parametrize("kind", ["nq0", "nk0", "B0", "B0-H2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_problems_give_the_reference_result(kind, backend):
    """No query rows, no keys, an empty batch or no heads: the float64 reference's result (empty, or
    zero rows with lse -inf without keys) and its gradients (zeros), on every backend; never a
    ZeroDivisionError."""
    ops, do = _empty_case(kind, torch.Generator().manual_seed(len(kind)))
    o, lse, grads, report = run(ops, None, 0.5, do, backend)
    ref_o, ref_lse, ref_g = reference(ops, None, 0.5, do)
    assert o.shape == ref_o.shape == do.shape and lse.shape == ref_lse.shape
    assert torch.equal(o.double(), ref_o) and torch.equal(lse.double(), ref_lse)
    if kind == "nk0":
        assert (o == 0).all() and torch.isneginf(lse).all()
    for name in OPERANDS:
        assert grads[name].shape == ref_g[name].shape and torch.equal(grads[name].double(), ref_g[name]), name
        assert not grads[name].any(), name
    assert report.total_bytes == 0                                     # no kernel ran
    ops, _ = _empty_case("H0", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"X and Y hold 0 heads \(X of shape \(0, 32, 32\)"):
        sparse_operands.attention(*ops, backend=backend)


def test_scale_follows_block_sparse_attention_rules():
    """``scale`` takes what ``block_sparse_attention``'s ``sm_scale`` takes (NumPy scalars of any
    float width, 0-d tensors) and refuses what it refuses (NaN, inf: every output would be NaN)."""
    import numpy as np

    ops, qk, do = make_case(40, 40, 32, 32, 32, 32, 16, 16, 16, (None, None, None), 0.6, seed=3)
    ref_o = reference(ops, qk, float(np.float32(0.3)), do)[0]
    for scale in (np.float32(0.3), torch.tensor(0.3, dtype=torch.float32)):
        o = sparse_operands.attention(*ops[:3], *ops[3:], qk_layout=qk, scale=scale, backend="torch")
        assert rel_err(o, ref_o) < 1e-5, type(scale)
    assert rel_err(sparse_operands.attention(*ops, qk_layout=qk, scale=np.float64(0.3), backend="torch"),
                   reference(ops, qk, 0.3, do)[0]) < 1e-5
    for bad in (float("nan"), float("inf"), -np.inf, np.float32("nan")):
        with pytest.raises(ValueError, match=r"scale must be a finite number, got (nan|-?inf)"):
            sparse_operands.attention(*ops, qk_layout=qk, scale=bad)
    for bad in (None, "1", True, torch.ones(2), 1j):
        with pytest.raises(TypeError, match="scale must be a finite real number"):
            sparse_operands.attention(*ops, qk_layout=qk, scale=bad)
