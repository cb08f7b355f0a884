"""compare() per (batch element, head) and accounting.compare_heads: per-head rows are single
compare() calls on each head's report and bound, the total row sums them (floor: the sum of the
heads' floors), a counted IOCounter report of the batched Triton call equals the model's total and
the table says so; bad inputs name what was expected."""
import json
import math

import pytest
import torch

import sparse_io_attn.bounds as B
from sparse_io_attn import sparse_operands
from sparse_io_attn.accounting import (HeadComparison, HeadTotal, IOCounter, TrafficReport, compare,
                                       compare_heads)
from sparse_io_attn.accounting.compare import Comparison, per_head_comparison
from sparse_io_attn.bounds.heads import head_nnz_stats
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix


def _x_list(H, d, block):
    """One BlockSparseMatrix per head; head ``h`` keeps ``h + 1`` of the first blocks (distinct patterns)."""
    nb = math.ceil(d / block)
    out = []
    for h in range(H):
        keep = torch.zeros(nb * nb, dtype=torch.bool)
        keep[: h % (nb * nb) + 1] = True
        out.append(BlockSparseMatrix.random(keep.view(nb, nb), block, shape=(d, d)))
    return out


def _case(B_, H, n, d, dv, blocks, *, x="list", qk="per-batch-head"):
    """Operands of one batched call (fresh random values): ``A [B, n, d]``, ``X`` a per-head list
    (``x="list"``) or dense ``[H, d, d]`` (``x="dense"``), ``Y [H, d, dv]``, a QK layout with one
    mask per (b, h) (``qk="per-batch-head"``), per head (``"per-head"``) or none."""
    bm, bn = blocks
    A1, A2, A3 = (torch.randn(B_, n, d) for _ in range(3))
    X = _x_list(H, d, 16) if x == "list" else torch.randn(H, d, d) / math.sqrt(d)
    Y = torch.randn(H, d, dv) / math.sqrt(d)
    layout = None
    if qk is not None:
        lead = (B_, H) if qk == "per-batch-head" else (1, H)
        keep = torch.rand(*lead, math.ceil(n / bm), math.ceil(n / bn)) < 0.7
        keep[..., 0, 0] = True
        layout = BlockSparseLayout.from_block_mask(keep, (bm, bn), (n, n))
    return (A1, A2, A3, X, Y), layout


def _group(ops, layout, b, h):
    """The single-head operands and mask of group ``(b, h)``."""
    A1, A2, A3, X, Y = ops

    def pick(t, i):
        return t[i] if isinstance(t, list) or (isinstance(t, torch.Tensor) and t.dim() == 3) else t

    lay = None
    if layout is not None:
        mask = layout.to_block_mask()
        lay = BlockSparseLayout.from_block_mask(mask[b % mask.shape[0], h % mask.shape[1]], layout.block_size,
                                                layout.seqlen)
    return (pick(A1, b), pick(A2, b), pick(A3, b), pick(X, h), pick(Y, h)), lay


# ---------------------------------------------------------------- compare() per head
def test_per_head_rows_are_single_compares_and_total_sums():
    ops, qk = _case(2, 3, 48, 32, 16, (16, 16))
    shares = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    bounds = head_nnz_stats(ops[0], ops[3], ops[1], qk).bounds(3000, dtype=torch.float32)
    hc = compare(shares, bounds)
    assert isinstance(hc, HeadComparison) and isinstance(hc.total, HeadTotal)
    keys = [(b, h) for b in range(2) for h in range(3)]
    assert list(hc) == keys and len(hc) == 6 and (1, 2) in hc and (2, 0) not in hc
    for i, k in enumerate(keys):
        assert hc[k] == compare(shares[k], bounds[i]) and isinstance(hc[k], Comparison)
    assert hc[1, 2] is hc[(1, 2)]
    assert len({hc[0, h].bound_bytes for h in range(3)}) == 3      # each head its own X pattern, its own bound
    # the same with the bounds as a mapping, in any order
    assert compare(shares, dict(reversed(list(zip(keys, bounds))))) == hc
    t = hc.total
    assert (t.source, t.dtype) == ("predicted", "float32")
    assert t.measured_bytes == sum(r.total_bytes for r in shares.values()) == sparse_operands.predict_traffic(
        *ops, qk_layout=qk).total_bytes
    assert (t.bytes_read, t.bytes_written) == (sum(r.bytes_read for r in shares.values()),
                                               sum(r.bytes_written for r in shares.values()))
    assert t.compulsory_bytes == 4 * sum(b.compulsory_words for b in bounds)
    assert t.bound_bytes == pytest.approx(4 * math.fsum(b.value_words for b in bounds), rel=1e-12)
    assert t.floor_bytes == pytest.approx(4 * math.fsum(max(b.compulsory_words, b.value_words) for b in bounds),
                                          rel=1e-12)
    assert t.ratio_to_floor == t.measured_bytes / t.floor_bytes


def test_total_floor_is_the_sum_of_the_heads_floors_when_they_bind_differently():
    """Independent problems each need their own max(compulsory, bound): with one head bound-bound and
    one compulsory-bound, the total floor exceeds max(sum compulsory, sum bound)."""
    big = B.sparse(4096, 4096, 4096, 4096 * 64, 64, dtype="fp32")        # small M: the bound binds
    small = B.sparse(64, 16, 64, 256, 10 ** 6, dtype="fp32")             # large M: compulsory binds
    hc = compare({(0, 0): 10 ** 7, (0, 1): 10 ** 5}, [big, small])
    assert [hc[k].binds for k in hc] == ["bound", "compulsory"] and hc.total.binds == "mixed"
    assert hc.total.source == "given" and hc.total.bytes_read is None
    want = 4 * big.value_words + 4 * small.compulsory_words
    assert hc.total.floor_bytes == pytest.approx(want, rel=1e-12)
    assert hc.total.floor_bytes > max(hc.total.compulsory_bytes, hc.total.bound_bytes)
    assert "mixed: bound 1, compulsory 1" in hc.table()
    same = compare({(0, 0): 10 ** 7, (1, 0): 10 ** 7}, [big, B.sparse(4096, 4096, 4096, 4096 * 64, 64,
                                                                      dtype=torch.float32)])
    assert same.total.binds == "bound" and same.total.floor_bytes == pytest.approx(2 * 4 * big.value_words)


def test_table_and_dict():
    ops, qk = _case(1, 2, 32, 32, 16, (16, 16), qk="per-head")
    shares = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    hc = compare(shares, head_nnz_stats(ops[0], ops[3], ops[1], qk).bounds(2048), dtype=torch.float32)
    text = str(hc)
    lines = text.splitlines()
    assert text == hc.table() and "Theorem 4.5" in lines[0] and "M = 2,048 words (float32, 4 B/word)" in text
    assert "not a proven lower bound" in text                  # the QK-restricted Z_AXA caveat, once
    rows = [ln for ln in lines if ln.startswith("(0, ")]
    assert len(rows) == 2 and lines[-1].startswith("total (predicted)")
    assert f"{hc.total.measured_bytes:,}" in lines[-1] and f"{hc[0, 1].measured_bytes:,}" in rows[1]
    d = hc.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert [(e["b"], e["h"]) for e in d["heads"]] == [(0, 0), (0, 1)]
    assert d["heads"][1]["measured_bytes"] == shares[0, 1].total_bytes
    assert d["total"]["floor_bytes"] == hc.total.floor_bytes and d["total"]["binds"] == hc.total.binds


# ---------------------------------------------------------------- compare_heads: the one-call form
@pytest.mark.parametrize("backward", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fwd", "fwd-bwd"])
def test_compare_heads_counted_report_equals_model_total(backward):
    """The IOCounter report of sparse_operands.attention(..., backend="triton") (and its backward) with B=2,
    H=2, n=64, blocks 16/32, fp32 through the interpreter equals the model's total; the total row
    shows the counted bytes and the table says the heads are the model's shares. The report is
    refused against the model of another call (with/without the backward)."""
    ops, qk = _case(2, 2, 64, 32, 16, (16, 32), qk="per-head")
    A1, A2, A3, X, Y = ops
    leaves = [A1, A2, A3, Y] + [m.values for m in X]
    for t in leaves:
        t.requires_grad_(backward)
    with IOCounter() as io:
        o = sparse_operands.attention(*ops, qk_layout=qk, backend="triton")
        if backward:
            torch.autograd.grad(o, leaves, torch.randn_like(o))
    counted = io.report
    assert counted.source == "counted" and counted.total_bytes > 0
    hc = compare_heads(*ops, qk_layout=qk, report=counted, backward=backward)
    predicted = compare_heads(*ops, qk_layout=qk, backward=backward)
    assert hc.total.measured_bytes == counted.total_bytes == predicted.total.measured_bytes
    assert (hc.total.bytes_read, hc.total.bytes_written) == (counted.bytes_read, counted.bytes_written)
    assert hc.total.source == "counted" and predicted.total.source == "predicted"
    assert dict(hc.items()) == dict(predicted.items())                  # heads: the model's shares
    assert hc.total.floor_bytes == predicted.total.floor_bytes
    lines = hc.table().splitlines()
    assert lines[-1].startswith("total (counted)") and f"{counted.total_bytes:,}" in lines[-1]
    assert any("per-head rows: the traffic model's share" in ln for ln in lines)
    assert "per-head rows" not in predicted.table()
    M = sparse_operands.kernel_fast_memory_words(*ops, qk_layout=qk)
    assert all(c.bound.M == M for c in hc.values())
    with pytest.raises(ValueError, match="differs from the model of this call"):
        compare_heads(*ops, qk_layout=qk, report=counted, backward=not backward)


@pytest.mark.parametrize("x", ["dense", "list"])
def test_compare_heads_rows_are_each_groups_own_problem(x):
    """Dense [H, d, d] and per-head list X: each (b, h) row is compare() of that group's model share
    with Theorem 4.5 on that group's own operands and mask at the kernels' M."""
    ops, qk = _case(2, 2, 40, 32, 16, (16, 16), x=x)
    hc = compare_heads(*ops, qk_layout=qk)
    shares = sparse_operands.predict_traffic_per_head(*ops, qk_layout=qk)
    M = sparse_operands.kernel_fast_memory_words(*ops, qk_layout=qk)
    assert list(hc) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (b, h), c in hc.items():
        (a1, a2, _, xh, _), lay = _group(ops, qk, b, h)
        want = B.nnz_stats(a1, xh, a2, lay).bound(M, dtype=torch.float32)
        assert c == compare(shares[b, h], want)
        assert c.bound.params["Z_X"] == (xh.nnz if x == "list" else int((xh != 0).sum()))
    if x == "list":      # head 1 keeps two of X's blocks, head 0 one: its bound is larger
        assert hc[0, 1].bound_bytes > hc[0, 0].bound_bytes


def test_compare_heads_single_head_and_operands_shared_along_an_axis():
    """The 2-D call is one row (0, 0) equal to compare() of the whole call; Y varying along the heads
    with X, A1, A2 shared gives H rows on the shared counts (head_nnz_stats(grid=...))."""
    n, d = 32, 16
    A1, A2, A3 = (torch.randn(n, d) for _ in range(3))
    X, Y = torch.randn(d, d), torch.randn(d, 8)
    one = compare_heads(A1, A2, A3, X, Y, M="16KiB")
    st = B.nnz_stats(A1, X, A2)
    assert list(one) == [(0, 0)]
    assert one[0, 0] == compare(sparse_operands.predict_traffic(A1, A2, A3, X, Y), st.bound(4096, dtype=torch.float32))
    Yh = torch.randn(3, d, 8)
    hc = compare_heads(A1, A2, A3, X, Yh)
    M = sparse_operands.kernel_fast_memory_words(A1, A2, A3, X, Yh)
    assert list(hc) == [(0, h) for h in range(3)]
    assert all(hc[k].bound == st.bound(M, dtype=torch.float32) for k in hc)
    grid = head_nnz_stats(A1, X, A2, grid=(2, 3))
    assert (grid.B, grid.H, len(grid.per_head)) == (2, 3, 6) and grid.Z_AXA == 6 * st.Z_AXA


# ---------------------------------------------------------------- bad inputs
def _bounds(k=2):
    return [B.sparse(64, 16, 64, 256, 1000, dtype="fp32") for _ in range(k)]


@pytest.mark.parametrize("report,bound,err,match", [
    pytest.param({(0, 0): 100}, _bounds(1)[0], TypeError, "one Bound per head", id="mapping-one-bound"),
    pytest.param(100, _bounds(2), TypeError, "one report per head", id="one-report-bound-list"),
    pytest.param({(0, 0): 1, (0, 1): 2}, _bounds(3), ValueError, "got 3 bounds for a report of 2 heads",
                 id="length-mismatch"),
    pytest.param({(0, 0): 1, (0, 1): 2}, dict(zip([(0, 0), (1, 0)], _bounds(2))), ValueError,
                 r"missing \[\(0, 1\)\], not in the report \[\(1, 0\)\]", id="keys-mismatch"),
    pytest.param({0: 1}, _bounds(1), TypeError, r"\(b, h\) pairs of ints", id="key-not-pair"),
    pytest.param({(0, 1.0): 1}, _bounds(1), TypeError, r"\(b, h\) pairs of ints", id="key-float"),
    pytest.param({(0, -1): 1}, _bounds(1), ValueError, "non-negative", id="key-negative"),
    pytest.param({}, _bounds(1), ValueError, "holds no heads", id="empty"),
    pytest.param({(0, 0): 1.5}, _bounds(1), TypeError, r"head \(0, 0\): report must be a TrafficReport",
                 id="value-float"),
    pytest.param({(0, 0): 1, (0, 1): 2}, [_bounds(1)[0], B.sparse(64, 16, 64, 256, 1000, dtype="bf16")],
                 ValueError, "dtypes of different sizes", id="mixed-dtypes"),
    pytest.param({(0, 0): 1}, [B.sparse(64, 16, 64, 256, 1000)], ValueError, r"head \(0, 0\): .*pass dtype=",
                 id="no-dtype"),
    pytest.param({(0, 0): 1}, ["bound"], TypeError, r"head \(0, 0\): bound must be", id="not-a-bound"),
])
def test_compare_per_head_errors(report, bound, err, match):
    with pytest.raises(err, match=match):
        compare(report, bound)


def test_other_errors():
    hc = compare({(0, 0): 1}, _bounds(1))
    with pytest.raises(KeyError, match=r"no head \(0, 1\)"):
        hc[0, 1]
    rep = TrafficReport("counted")
    rep.add("k", {"a": 10}, {})
    with pytest.raises(ValueError, match="heads sum to 3"):
        per_head_comparison({(0, 0): 1, (0, 1): 2}, _bounds(2), total=rep)
    n, d = 32, 16
    A = torch.randn(n, d)
    with pytest.raises(TypeError, match="TrafficReport an IOCounter counted"):
        compare_heads(A, A, A, torch.randn(d, d), torch.randn(d, 8), report=123)
    with pytest.raises(ValueError, match="grid"):
        head_nnz_stats(torch.randn(2, n, d), torch.randn(d, d), torch.randn(2, n, d), grid=(3, 1))
    with pytest.raises(TypeError, match="grid"):
        head_nnz_stats(A, torch.randn(d, d), A, grid=(1, 0))
