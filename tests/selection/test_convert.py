"""Exact conversions between block layouts and per-token selections, on the device without host
synchronisation: ``selection_from_layout`` (a layout's rows shared by their tokens) and
``layout_from_selection`` (a selection re-blocked with per-row element masks). Each result computes
what its source does (the ``torch`` backends of both ops, against the float64 reference) and
``layout_from_selection`` gives exactly the reference's element mask."""
import contextlib
import math

import pytest
import torch

from helpers import check_close, make_inputs, make_layout, no_host_sync
from sparse_io_attn import BlockSparseLayout, Selection, block_sparse_attention, patterns
from sparse_io_attn.layout import layout_from_selection, selection_from_layout
from sparse_io_attn.block_sparse.reference import attention_reference
from sparse_io_attn.selection.reference import selection_mask, selection_reference

from .test_correctness import random_indices, run_selection


def run_layout(q, k, v, do, layout, causal):
    """``block_sparse_attention`` (torch backend), forward + backward: ``(out, lse, dq, dk, dv)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend="torch")
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------ layout -> selection
def _topk_kv_heads():
    """A fixed-capacity top-k layout with one selection per KV head (layout_heads = Hkv = 2)."""
    return patterns.topk(torch.randn(2, 5, 7), 3, (16, 8), (70, 50), causal=True)


LAYOUTS = [  # (make, B, Hq, Hkv, causal)
    pytest.param(lambda: make_layout(2, 4, 70, 90, (16, 8), per_head=True, per_batch=True), 2, 4, 2, False,
                 id="per-batch-head-ragged"),
    pytest.param(lambda: make_layout(1, 2, 64, 64, 16, density=0.4, empty_rows=(1,)), 1, 2, 1, True,
                 id="shared-causal-empty-row"),
    pytest.param(lambda: make_layout(1, 2, 40, 100, (8, 32)), 1, 2, 2, "bottom_right", id="bottom-right-Nq<Nk"),
    pytest.param(lambda: make_layout(1, 2, 50, 30, (8, 4)), 1, 2, 1, "bottom_right", id="bottom-right-Nq>Nk"),
    pytest.param(_topk_kv_heads, 1, 4, 2, True, id="topk-fixed-capacity-per-kv-head"),
    pytest.param(lambda: make_layout(2, 2, 30, 40, 8, fill=False), 2, 2, 1, False, id="all-empty"),
    pytest.param(lambda: patterns.document([0, 48, 96], (32, 16)), 1, 2, 2, False,
                 id="document-rows-all-or-none"),
    pytest.param(lambda: patterns.document([0, 48, 96], (32, 16)), 1, 2, 1, True, id="document-causal-call"),
]


@pytest.mark.parametrize("make,B,Hq,Hkv,causal", LAYOUTS)
def test_selection_from_layout_computes_the_layout(make, B, Hq, Hkv, causal):
    layout = make()
    Nq, Nk = layout.seqlen
    whole_blocks = layout.partial_masks.shape[0] == 0
    with no_host_sync() if whole_blocks else contextlib.nullcontext():  # partial blocks: one read
        sel = selection_from_layout(layout)
    assert sel.block_size == layout.BLOCK_SIZE_KV and sel.num_selections == layout.layout_heads
    assert sel.batch == (layout.layout_batch if layout.layout_batch > 1 else None)
    assert sel.max_blocks == max(1, min(layout.num_kv_blocks, layout.col_slots.numel()))
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, 16)
    got = run_selection(q, k, v, do, sel, backend="torch", causal=causal)
    check_close(got, attention_reference(q, k, v, layout, causal=causal, do=do))
    check_close(got, run_layout(q, k, v, do, layout, causal))


def test_selection_from_layout_with_max_blocks():
    """``max_blocks``: a tighter K (a top-k layout's k); checked unless ``check=False`` (then no read)."""
    layout = patterns.topk(torch.randn(3, 4, 9), 2, 8, (30, 70))
    with no_host_sync():
        sel = selection_from_layout(layout, max_blocks=2, check=False)
    assert sel.indices.shape == (3, 30, 2)
    want = layout.to_block_mask()[0].repeat_interleave(8, dim=1)[:, :30]             # [H, Nq, nkb]
    got = torch.zeros_like(want).scatter_(-1, sel.indices.long(), True)
    assert torch.equal(got, want)
    assert torch.equal(selection_from_layout(layout, max_blocks=2).indices, sel.indices)
    with pytest.raises(ValueError, match=r"keeps 2 key blocks but max_blocks is 1; pass max_blocks >= 2"):
        selection_from_layout(layout, max_blocks=1)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: patterns.sliding_window(64, 16, 20), id="sliding-window"),
    pytest.param(lambda: patterns.document([0, 40, 96], (32, 16)), id="document-boundary-inside-a-key-block"),
    pytest.param(lambda: patterns.prefix_lm(48, 16, 20), id="prefix-lm"),
    pytest.param(lambda: patterns.document([0, 48, 96], (32, 16), causal=True), id="causality-inside-the-layout"),
])
def test_selection_from_layout_refuses_masks_without_a_token_form(make):
    with pytest.raises(ValueError, match=r"partial block .* lets query \d+ attend some but not all of the "
                                         r"block's keys"):
        selection_from_layout(make())


# ------------------------------------------------------------------------------ selection -> layout
SELECTIONS = [  # (B, Hq, Hkv, G, batched, Nq, Nk, bs, K, block_size_q, causal, counts)
    pytest.param(2, 4, 2, 4, True, 37, 53, 4, 5, 8, False, False, id="per-batch-Ghq-bq8-ragged"),
    pytest.param(1, 4, 2, 2, False, 40, 90, 16, 3, 16, True, True, id="Ghkv-bs16-causal-counts"),
    pytest.param(1, 2, 1, 1, False, 30, 45, 1, 9, 4, "bottom_right", False, id="G1-bs1-bottom-right"),
    pytest.param(1, 2, 2, 2, False, 50, 30, 4, 4, 7, "bottom_right", False, id="Nq>Nk-bq7-empty-rows"),
    pytest.param(2, 2, 2, 1, True, 20, 100, 64, 2, 32, True, True, id="bs64-bq32-ragged-counts"),
    pytest.param(1, 2, 2, 2, False, 9, 40, 8, 3, 1, False, False, id="bq1"),
]


@pytest.mark.parametrize("B,Hq,Hkv,G,batched,Nq,Nk,bs,K,bq,causal,with_counts", SELECTIONS)
def test_layout_from_selection_computes_the_selection(B, Hq, Hkv, G, batched, Nq, Nk, bs, K, bq, causal,
                                                      with_counts):
    nkb = math.ceil(Nk / bs)
    idx = random_indices((B, G) if batched else (G,), Nq, Nk, K, bs, causal=causal)
    idx[..., -1] = torch.where(torch.rand(idx.shape[:-1]) < 0.2, nkb + 3, idx[..., -1])   # out of range: empty
    counts = torch.randint(0, K + 1, idx.shape[:-1]) if with_counts else None
    sel = Selection(idx, bs, counts)
    with no_host_sync():
        layout = layout_from_selection(sel, Nk, block_size_q=bq, causal=causal)
    assert layout.fixed_capacity and layout.block_size == (bq, bs) and layout.seqlen == (Nq, Nk)
    assert (layout.layout_batch, layout.layout_heads) == ((B if batched else 1), G)
    slots = layout.num_layouts * layout.num_q_blocks * min(bq * K, nkb)
    assert layout.col_slots.numel() == slots == layout.partial_masks.shape[0]
    clean = Selection(torch.where(idx >= nkb, -1, idx), bs, counts)
    want = selection_mask(clean, B if batched else 1, G, Nk, causal=causal)
    assert torch.equal(layout.to_dense_mask(), want)
    # the invariants of a valid layout: CSR ranges, sorted unique columns, mask ids; kept masks not empty
    rebuilt = BlockSparseLayout(layout.crow_indices, layout.col_slots, block_size=layout.block_size,
                                seqlen=layout.seqlen, layout_batch=layout.layout_batch,
                                layout_heads=layout.layout_heads, partial_ids=layout.partial_id_slots,
                                partial_masks=layout.partial_masks, fixed_capacity=True)
    assert rebuilt.checked
    assert (layout.entry_words() != 0).flatten(1).any(1).all()
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, 16)
    got = run_layout(q, k, v, do, layout, causal)
    check_close(got, selection_reference(q, k, v, clean, causal=causal, do=do))
    check_close(got, run_selection(q, k, v, do, sel, backend="torch", causal=causal, check=False))


def test_blocks_every_token_of_a_query_block_chose_are_full():
    """Tokens of a query block choosing the same blocks (no causality, whole blocks): every kept block
    is full, none stores a mask id."""
    rows = torch.randint(-1, 6, (2, 4, 3))                                 # [G, query blocks, K]
    sel = Selection(rows.repeat_interleave(8, dim=1), 4)                   # 32 tokens, blocks of 8 rows
    layout = layout_from_selection(sel, 24, block_size_q=8)
    assert layout.num_partial_blocks == 0 and layout.nnz_blocks > 0
    assert torch.equal(layout.to_dense_mask(), selection_mask(sel, 1, 2, 24))


def test_round_trip_selection_layout_selection():
    """Without causality a selection's layout has all-or-none mask rows: it converts back, exactly."""
    idx = random_indices((2,), 24, 40, 3, 4)
    sel = Selection(idx, 4)
    back = selection_from_layout(layout_from_selection(sel, 40, block_size_q=8))
    assert torch.equal(selection_mask(back, 1, 2, 40), selection_mask(sel, 1, 2, 40))
    with pytest.raises(ValueError, match="some but not all"):     # causal diagonal blocks mix inside a row
        selection_from_layout(layout_from_selection(sel, 40, block_size_q=8, causal=True))


@pytest.mark.parametrize("call,exc,match", [
    pytest.param(lambda: selection_from_layout(torch.zeros(2, 2)), TypeError,
                 r"expected a BlockSparseLayout, got Tensor", id="not-a-layout"),
    pytest.param(lambda: selection_from_layout(patterns.dense(32, 8), max_blocks=0), ValueError,
                 r"max_blocks \(key blocks per query row\) must be a positive int, got 0", id="max-blocks-0"),
    pytest.param(lambda: layout_from_selection(torch.zeros(1, 4, 2, dtype=torch.int64), 8, block_size_q=2),
                 TypeError, r"expected a Selection, got Tensor", id="not-a-selection"),
    pytest.param(lambda: layout_from_selection(Selection(torch.zeros(1, 4, 2, dtype=torch.int64), 4), 0,
                                               block_size_q=2), ValueError,
                 r"seqlen_k must be a positive int .* got 0", id="seqlen-k-0"),
    pytest.param(lambda: layout_from_selection(Selection(torch.zeros(1, 4, 2, dtype=torch.int64), 4), 8,
                                               block_size_q=2.0), ValueError,
                 r"block_size_q \(query rows per block\) must be a positive int, got 2.0", id="block-size-q-float"),
    pytest.param(lambda: layout_from_selection(Selection(torch.zeros(1, 4, 2, dtype=torch.int64), 4), 8,
                                               block_size_q=2, causal="yes"), ValueError,
                 r"causal must be one of", id="causal-value"),
])
def test_converters_refuse_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
