"""Layouts chosen from data: ``BlockSparseLayout.from_kv_indices`` and ``patterns.topk`` against
brute-force Python on fresh random inputs, their errors, and that building them (and the kernels'
schedule) never synchronises with the host."""
import math
import re

import pytest
import torch

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.layout.causal import causal_blocks, causal_offset

from helpers import no_host_sync


def _lists_mask(idx, counts, nkb):
    """Brute force: the block mask ``kv_indices`` (and ``kv_counts``) describe."""
    lead = idx.shape[:-2]
    mask = torch.zeros(*lead, idx.shape[-2], nkb, dtype=torch.bool)
    flat_idx, flat_mask = idx.reshape(-1, idx.shape[-1]), mask.view(-1, nkb)
    flat_counts = None if counts is None else counts.reshape(-1)
    for row in range(flat_idx.shape[0]):
        n = idx.shape[-1] if flat_counts is None else int(flat_counts[row])
        for c in flat_idx[row, :n].tolist():
            if 0 <= c < nkb:
                flat_mask[row, c] = True
    return mask


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
@pytest.mark.parametrize("with_counts", [False, True])
def test_from_kv_indices_matches_brute_force(lead, with_counts):
    torch.manual_seed(len(lead) * 2 + with_counts)
    block, seqlen = (16, 32), (150, 200)       # ragged: 10 query blocks, 7 key blocks
    nqb, nkb = math.ceil(150 / 16), math.ceil(200 / 32)
    idx = torch.randint(-3, nkb, (*lead, nqb, 5))          # repeats and empty slots
    idx[..., 0, :] = -1                                     # an empty row
    counts = torch.randint(0, 6, (*lead, nqb)) if with_counts else None
    layout = BlockSparseLayout.from_kv_indices(idx, block, seqlen, kv_counts=counts)
    want = _lists_mask(idx, counts, nkb)
    full_lead = (1,) * (2 - len(lead)) + tuple(lead)
    assert torch.equal(layout.to_block_mask(), want.view(*full_lead, nqb, nkb))
    assert layout.fixed_capacity and layout.col_slots.numel() == idx.numel()
    assert layout.nnz_blocks == int(want.sum()) and layout.num_partial_blocks == 0
    assert layout.equal(BlockSparseLayout.from_block_mask(want.view(*full_lead, nqb, nkb), block, seqlen))
    layout.check()   # valid by construction, and the validation agrees
    ccol, row = layout.ccol_indices, layout.row_indices
    ref = BlockSparseLayout.from_block_mask(want.view(*full_lead, nqb, nkb), block, seqlen)
    assert torch.equal(ccol, ref.ccol_indices)
    assert torch.equal(row[:layout.nnz_blocks], ref.row_indices)


def test_from_kv_indices_int32_and_order_do_not_matter():
    idx = torch.tensor([[2, 0, 2, -1], [1, 1, 1, 1], [-5, -1, -1, -1]])
    a = BlockSparseLayout.from_kv_indices(idx, 8, 24)
    b = BlockSparseLayout.from_kv_indices(idx.flip(-1).to(torch.int32), 8, 24)
    assert a.equal(b)
    assert a.to_block_mask()[0, 0].tolist() == [[True, False, True], [False, True, False], [False, False, False]]


@pytest.mark.parametrize("bad, err, match", [
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(4, 2), 16, 64), TypeError, "int32 or int64"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(4, dtype=torch.long), 16, 64), ValueError, r"\[Mq, K\]"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(3, 2, dtype=torch.long), 16, 64), ValueError,
     "3 query-block rows"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.full((4, 2), 4), 16, 64), ValueError, "key block 4"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(4, 2, dtype=torch.long), 16, 64,
                                               kv_counts=torch.full((4,), 3)), ValueError, r"\[0, 2\]"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(4, 2, dtype=torch.long), 16, 64,
                                               kv_counts=torch.zeros(2, dtype=torch.long)), ValueError, "shape"),
    (lambda: BlockSparseLayout.from_kv_indices(torch.zeros(4, 2, dtype=torch.long), 16, 64,
                                               kv_counts=torch.zeros(4)), TypeError, "kv_counts"),
])
def test_from_kv_indices_errors(bad, err, match):
    with pytest.raises(err, match=match):
        bad()


def test_unchecked_out_of_range_entries_are_empty_slots():
    idx = torch.tensor([[0, 7, 99], [1, 4, -2], [2, 2, 100], [3, 5, 6]])
    layout = BlockSparseLayout.from_kv_indices(idx, 16, 64, check=False)
    assert layout.to_block_mask()[0, 0].sum(1).tolist() == [1, 1, 1, 1]


def _topk_brute(scores, k, block, seqlen, causal, include_diagonal, keep):
    """Python over every row: classes diagonal > keep > eligible, then score, then lower index."""
    (bq, bk), (sq, sk) = block, seqlen
    nqb, nkb = scores.shape[-2:]
    delta = causal_offset(causal, sq, sk)
    shift = 0 if delta is None else delta
    out = torch.zeros(scores.shape, dtype=torch.bool)
    keep_b = None if keep is None else keep.expand(scores.shape)
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in scores.shape[:-1]]).view(-1, scores.dim() - 1).tolist():
        r = pos[-1]
        q_lo, q_hi = r * bq, min((r + 1) * bq, sq) - 1
        ranked = []
        for c in range(nkb):
            alive = bool(causal_blocks(torch.tensor(r), torch.tensor(c), block, seqlen, delta).alive)
            if not alive:
                continue
            diag = include_diagonal and max(q_lo + shift, 0) // bk <= c <= (q_hi + shift) // bk
            kept = keep_b is not None and bool(keep_b[tuple(pos)][c])
            s = float(scores[tuple(pos)][c])
            s = -math.inf if math.isnan(s) else s
            ranked.append((-(3 if diag else 2 if kept else 1), -s, c))
        for _, _, c in sorted(ranked)[:k]:
            out[tuple(pos)][c] = True
    return out


@pytest.mark.parametrize("lead", [(), (2,), (2, 2)])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("seqlen, block", [((128, 128), 16), ((100, 170), (16, 32)), ((170, 100), 32)])
def test_topk_matches_brute_force(lead, causal, seqlen, block):
    torch.manual_seed(hash((lead, str(causal), seqlen)) % 1000)
    bq, bk = (block, block) if isinstance(block, int) else block
    nqb, nkb = math.ceil(seqlen[0] / bq), math.ceil(seqlen[1] / bk)
    scores = torch.randn(*lead, nqb, nkb)
    scores[..., 1, :] = 0.0                               # ties: the lower index wins
    scores[..., 2, 0] = float("nan")
    keep = torch.zeros(nkb, dtype=torch.bool)
    keep[-1] = True
    for k, inc, kp in ((1, True, None), (3, True, keep), (3, False, None), (nkb + 2, True, None), (2, True, keep)):
        layout = patterns.topk(scores, k, block, seqlen, causal=causal, include_diagonal=inc, keep=kp)
        want = _topk_brute(scores, k, (bq, bk), seqlen, causal, inc, kp)
        got = layout.to_block_mask().reshape(want.shape)
        assert torch.equal(got, want), (k, inc, kp is not None)


def test_topk_orders_every_float_class():
    """Signed zeros tie (the lower index wins), subnormals, the largest finite values, both
    infinities and NaNs of either sign (ranked lowest, with -inf) sort as floats do."""
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    nan = torch.tensor(float("nan"))
    values = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 4, big, -big, float("inf"), float("-inf"),
                           1.0, -1.0, 0.0, -0.0, tiny, -tiny, 1e-40, 3.0]).float()
    values = torch.cat([values, nan.view(1), (-nan).view(1)])        # a NaN with the sign bit set
    torch.manual_seed(0)
    scores = torch.stack([values, values.flip(0), values[torch.randperm(values.numel())]])
    n = values.numel()
    for k in (1, 4, 9, n):
        got = patterns.topk(scores, k, 8, (24, 8 * n), include_diagonal=False).to_block_mask()[0, 0]
        want = _topk_brute(scores, k, (8, 8), (24, 8 * n), False, False, None)
        assert torch.equal(got, want), k


def test_topk_per_row_keep_and_errors():
    scores = torch.randn(4, 4)
    keep = torch.eye(4, dtype=torch.bool).flip(0)          # row r always keeps block 3 - r
    got = patterns.topk(scores, 2, 8, 32, keep=keep, include_diagonal=False).to_block_mask()[0, 0]
    assert got[torch.arange(4), 3 - torch.arange(4)].all() and got.sum().item() == 8
    with pytest.raises(ValueError, match="positive int"):
        patterns.topk(scores, 0, 8, 32)
    with pytest.raises(TypeError, match="floating-point"):
        patterns.topk(scores.long(), 1, 8, 32)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 4\]"):
        patterns.topk(torch.randn(4, 3), 1, 8, 32)
    with pytest.raises(TypeError, match="keep"):
        patterns.topk(scores, 1, 8, 32, keep=torch.ones(4))
    with pytest.raises(ValueError, match="keep"):
        patterns.topk(scores, 1, 8, 32, keep=torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("keep_shape", [(5, 1), (2, 1, 6), (1, 1), (1,), (2, 5, 6), ()])
def test_topk_keep_broadcasts_as_documented(keep_shape):
    """Every shape broadcastable to the scores is a keep mask: the same layout as the keep expanded
    to the scores' shape, checked against brute force ([Mq, 1]: whole rows)."""
    torch.manual_seed(len(keep_shape))
    scores = torch.randn(2, 5, 6)
    keep = torch.rand(keep_shape) < 0.4
    got = patterns.topk(scores, 3, 8, (40, 48), keep=keep).to_block_mask()[0]
    expanded = patterns.topk(scores, 3, 8, (40, 48), keep=keep.expand(scores.shape).clone()).to_block_mask()[0]
    assert torch.equal(got, expanded)
    assert torch.equal(got, _topk_brute(scores, 3, (8, 8), (40, 48), False, True, keep))
    with pytest.raises(ValueError, match=r"\[5, 1\]: whole rows.*got \(2, 6\)"):
        patterns.topk(scores, 3, 8, (40, 48), keep=torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("build", [
    lambda t: BlockSparseLayout.from_kv_indices(t.long(), 8, 32),
    lambda t: BlockSparseLayout.from_kv_indices(t.long(), 8, 32, check=False),
    lambda t: patterns.topk(t.float(), 2, 8, 32),
], ids=["from_kv_indices", "from_kv_indices-unchecked", "topk"])
def test_selections_refuse_empty_batches_and_meta_alike(build):
    """A batch or head dimension of 0 leaves no mask (a layout holds one or more): a ValueError naming
    the shape, never a ZeroDivisionError; on 'meta' both refuse as ``layout.to("meta")`` does."""
    for shape in ((0, 2, 4, 4), (2, 0, 4, 4), (0, 4, 4)):             # [..., Mq, K] / [..., Mq, Mk]
        with pytest.raises(ValueError, match=rf"has shape {re.escape(str(shape))}: its batch and head dimensions"):
            build(torch.zeros(shape))
    with pytest.raises(ValueError, match="cannot live on the 'meta' device"):
        build(torch.zeros(4, 4, device="meta"))
    with pytest.raises(ValueError, match="cannot live on the 'meta' device"):
        BlockSparseLayout.from_kv_indices(torch.zeros(4, 2, dtype=torch.long), 8, 32).to("meta")


def test_selection_and_schedule_never_synchronise():
    scores = torch.randn(2, 3, 8, 8)
    idx = torch.randint(-1, 8, (2, 3, 8, 4))
    with no_host_sync():
        for layout in (patterns.topk(scores, 3, 16, 128, causal=True),
                       BlockSparseLayout.from_kv_indices(idx, 16, 128, check=False)):
            for causal in (False, True):
                plan(layout, causal=causal).for_heads(6, 3)
            layout.ccol_indices
            layout.for_query_heads(6, 3)
    with pytest.raises(AssertionError, match="host synchronisation"), no_host_sync():
        BlockSparseLayout.from_kv_indices(idx, 16, 128)._used_slots()     # the guard can fail


@pytest.mark.parametrize("causal,seqlen", [(False, 100), (True, 100), ("bottom_right", (70, 100))])
def test_device_plan_equals_the_layout(causal, seqlen):
    """The fixed-capacity layout's plan lists the same blocks as the exact layout's plan."""
    nqb = -(-(seqlen if isinstance(seqlen, int) else seqlen[0]) // 16)
    idx = torch.randint(-2, 7, (2, 2, nqb, 3))
    dyn = BlockSparseLayout.from_kv_indices(idx, 16, seqlen)
    exact = BlockSparseLayout.from_block_mask(dyn.to_block_mask(), 16, seqlen)
    a, b = plan(dyn, causal=causal), plan(exact, causal=causal)
    for order in ("rows", "cols"):
        la, lb = getattr(a, order), getattr(b, order)
        assert torch.equal(la.full_ptr, lb.full_ptr) and torch.equal(la.part_ptr, lb.part_ptr)
        nf, np_ = int(la.full_ptr[-1, -1]), int(la.part_ptr[-1, -1])
        assert torch.equal(la.full_idx[:nf], lb.full_idx[:nf])
        assert torch.equal(la.part_idx[:np_], lb.part_idx[:np_])
        assert torch.equal(la.part_mask[:np_], lb.part_mask[:np_])


def test_user_built_fixed_capacity_layout_is_validated():
    layout = BlockSparseLayout.from_kv_indices(torch.tensor([[0, -1], [1, 0]]), 8, 16)
    again = BlockSparseLayout(layout.crow_indices, layout.col_slots, block_size=8, seqlen=16, fixed_capacity=True)
    assert again.equal(layout) and again.checked
    bad = layout.col_slots.clone()
    bad[0] = 5
    with pytest.raises(ValueError, match=r"col_indices must lie in \[0, 2\)"):
        BlockSparseLayout(layout.crow_indices, bad, block_size=8, seqlen=16, fixed_capacity=True)
    unchecked = BlockSparseLayout(layout.crow_indices, bad, block_size=8, seqlen=16, fixed_capacity=True,
                                  validate=False)
    assert not unchecked.checked
    with pytest.raises(ValueError, match="col_indices"):
        unchecked.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("ties", ["lower", "higher"])
def test_ranked_topk_against_a_stable_sort(dtype, ties):
    """``patterns.ranked_topk``: the best first, equal scores ordered by index (lower or higher first),
    NaN as -inf, -0.0 as 0.0, ineligible entries never chosen (-1 slots trail); brute force: a
    stable sort of (eligible, score, tie-break index) per row, in float64."""
    scores = torch.randint(-3, 4, (5, 7, 11)).to(dtype)                    # many exact ties
    scores[0, 0, :3] = torch.tensor([float("nan"), -0.0, 0.0], dtype=dtype)
    eligible = torch.rand(5, 7, 11) < 0.7
    got = patterns.ranked_topk(scores, 4, eligible=eligible, ties=ties)
    assert got.shape == (5, 7, 4) and got.dtype == torch.int64
    for row, s, e in zip(got.view(-1, 4), scores.view(-1, 11), eligible.view(-1, 11)):
        key = [(-float("inf") if math.isnan(x) else x + 0.0, c if ties == "higher" else -c)
               for c, x in enumerate(s.double().tolist())]
        want = sorted((c for c in range(11) if e[c]), key=lambda c: key[c], reverse=True)[:4]
        assert row.tolist() == want + [-1] * (4 - len(want))
    x = torch.randn(6, 40)
    assert torch.equal(patterns.ranked_topk(x, 7), torch.topk(x, 7).indices)     # no tie: torch.topk's set
    with no_host_sync():
        patterns.ranked_topk(x, 3, eligible=x > 0, ties="higher")
    with pytest.raises(ValueError, match="ties must be"):
        patterns.ranked_topk(x, 3, ties="first")
