"""Block liveness under the causal mask (layout.causal), and the three users that share it: the
kernels' schedule, the torch path's plan and the FlexAttention conversion."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.block_sparse.torch_path.plan import _row_lists
from sparse_io_attn.layout.causal import causal_blocks
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn import block_sparse_attention
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err

CASES = [
    pytest.param((100, 8), (81, 81), id="bq100-bk8-N81"),
    pytest.param((100, 8), (81, 200), id="bq100-bk8-Nq81-Nk200"),
    pytest.param((16, 16), (64, 64), id="b16-N64-even"),
    pytest.param((16, 32), (70, 45), id="b16x32-Nq70-Nk45"),
    pytest.param((8, 24), (37, 100), id="b8x24-Nq37-Nk100"),
    pytest.param((32, 8), (100, 13), id="b32x8-Nq100-Nk13"),
    pytest.param((5, 7), (23, 23), id="b5x7-N23"),
]
MODES = ["top_left", "bottom_right"]


def _brute(block_size, seqlen, delta):
    """``(alive, whole)`` per block from the element mask ``j <= i + delta`` inside both lengths."""
    (bq, bk), (sq, sk) = block_size, seqlen
    R, C = math.ceil(sq / bq), math.ceil(sk / bk)
    i = torch.arange(R * bq)[:, None]
    j = torch.arange(C * bk)[None, :]
    allowed = (i < sq) & (j < sk) & (j <= i + delta)
    blocks = allowed.view(R, bq, C, bk)
    return blocks.any(3).any(1), blocks.all(3).all(1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size,seqlen", CASES)
def test_causal_blocks_matches_element_check(block_size, seqlen, mode):
    delta = causal_offset(mode, *seqlen)
    alive, whole = _brute(block_size, seqlen, delta)
    R, C = alive.shape
    live = causal_blocks(torch.arange(R)[:, None], torch.arange(C)[None, :], block_size, seqlen, delta)
    assert torch.equal(live.alive, alive)
    assert torch.equal(live.whole, whole)


@pytest.mark.parametrize("block_size,seqlen", CASES)
def test_no_causal_mask_keeps_every_block(block_size, seqlen):
    (bq, bk), (sq, sk) = block_size, seqlen
    R, C = math.ceil(sq / bq), math.ceil(sk / bk)
    live = causal_blocks(torch.arange(R)[:, None], torch.arange(C)[None, :], block_size, seqlen, None)
    assert bool(live.alive.all())
    inside = torch.zeros(R, C, dtype=torch.bool)
    inside[: sq // bq, : sk // bk] = True
    assert torch.equal(live.whole, inside)


def _random_layout(block_size, seqlen, seed):
    (bq, bk), (sq, sk) = block_size, seqlen
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(math.ceil(sq / bq), math.ceil(sk / bk), generator=gen) < 0.7
    return BlockSparseLayout.from_block_mask(keep, block_size, seqlen)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size,seqlen", CASES)
def test_schedule_and_plan_drop_exactly_the_dead_blocks(block_size, seqlen, mode):
    layout = _random_layout(block_size, seqlen, seed=hash((block_size, seqlen, mode)) % 1000)
    delta = causal_offset(mode, *seqlen)
    alive, whole = _brute(block_size, seqlen, delta)
    kept = layout.to_block_mask()[0, 0]
    want_full = kept & alive & whole
    want_part = kept & alive & ~whole
    sched = plan(layout, causal=mode)
    got_full = torch.zeros_like(kept)
    got_part = torch.zeros_like(kept)
    for r in range(layout.num_q_blocks):
        rows = sched.rows
        got_full[r, rows.full_idx[rows.full_ptr[0, r]:rows.full_ptr[0, r + 1]].long()] = True
        got_part[r, rows.part_idx[rows.part_ptr[0, r]:rows.part_ptr[0, r + 1]].long()] = True
    assert torch.equal(got_full, want_full)
    assert torch.equal(got_part, want_part)
    planned = torch.zeros_like(kept)
    for r, pairs in enumerate(_row_lists(sched, 0, delta)):
        for c, _ in pairs:
            planned[r, c] = True
    assert torch.equal(planned, kept & alive)


@pytest.mark.parametrize("block_size,seqlen", CASES)
def test_flex_block_mask_lists_only_live_blocks(block_size, seqlen):
    layout = _random_layout(block_size, seqlen, seed=7)
    alive, whole = _brute(block_size, seqlen, 0)
    kept = layout.to_block_mask()[0, 0]
    bm = layout.to_flex_block_mask(causal=True)
    listed = torch.zeros_like(kept)
    full = torch.zeros_like(kept)
    for r in range(layout.num_q_blocks):
        listed[r, bm.kv_indices[0, 0, r, :int(bm.kv_num_blocks[0, 0, r])].long()] = True
        full[r, bm.full_kv_indices[0, 0, r, :int(bm.full_kv_num_blocks[0, 0, r])].long()] = True
    assert torch.equal(listed | full, kept & alive)
    assert torch.equal(full, kept & alive & whole)


def test_flex_causal_last_query_block_cut_short():
    """Block (100, 8) with 81 queries: the single query block ends at query 80, so key blocks
    starting past key 80 hold no allowed element and must not be listed."""
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 13, dtype=torch.bool), (100, 8), (81, 104))
    bm = layout.to_flex_block_mask(causal=True)
    listed = bm.kv_indices[0, 0, 0, :int(bm.kv_num_blocks[0, 0, 0])].tolist()
    listed += bm.full_kv_indices[0, 0, 0, :int(bm.full_kv_num_blocks[0, 0, 0])].tolist()
    assert sorted(listed) == list(range(11))   # key blocks 11 and 12 start at keys 88 and 96


def _dead_partial_layout(block_size, seqlen, heads, seed):
    """Per-head element masks where some kept partial blocks straddling the diagonal hold only
    elements above it (every such block dies under causality)."""
    gen = torch.Generator().manual_seed(seed)
    (sq, sk) = seqlen
    mask = torch.rand(heads, sq, sk, generator=gen) < 0.3
    above = torch.arange(sk)[None, :] > torch.arange(sq)[:, None]
    mask[0] &= above                            # head 0: only elements above the diagonal
    return BlockSparseLayout.from_dense_mask(mask, block_size)


def _live_blocks(layout, causal):
    """Brute force: kept blocks holding an allowed element under ``causal``."""
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    dense = layout.to_dense_mask()[0]
    delta = causal_offset(causal, sq, sk)
    dense = dense & (torch.arange(sk)[None, None, :] <= torch.arange(sq)[None, :, None] + delta)
    R, C = layout.num_q_blocks, layout.num_kv_blocks
    padded = torch.zeros(dense.shape[0], R * bq, C * bk, dtype=torch.bool)
    padded[:, :sq, :sk] = dense
    return int(padded.view(-1, R, bq, C, bk).any(4).any(2).sum())


@pytest.mark.parametrize("block_size,seqlen,causal", [
    pytest.param((100, 8), (81, 274), True, id="block100x8-81x274-top-left"),     # the outside audit's case
    pytest.param((16, 16), (40, 70), "bottom_right", id="block16-bottom-right"),
])
def test_partial_blocks_wholly_above_the_diagonal_are_dropped(block_size, seqlen, causal):
    """A kept partial block whose element mask lies wholly above the causal diagonal computes
    nothing: the plan, the FlexAttention export and every backend drop it."""
    layout = _dead_partial_layout(block_size, seqlen, 3, seed=5)
    want = _live_blocks(layout, causal)
    p = plan(layout, causal=causal)
    got = int(p.rows.full_ptr[-1, -1]) + int(p.rows.part_ptr[-1, -1])
    assert got == int(p.cols.full_ptr[-1, -1]) + int(p.cols.part_ptr[-1, -1]) == want < layout.nnz_blocks
    if causal is True:
        bm = layout.to_flex_block_mask(causal=True)
        assert int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()) == want
    q = torch.randn(1, 3, seqlen[0], 16)
    k, v = torch.randn(1, 3, seqlen[1], 16), torch.randn(1, 3, seqlen[1], 16)
    backends = ["torch", "cpu"] + (["triton"] if block_size[0] % 16 == 0 and block_size[1] % 16 == 0 else [])
    ref = attention_reference(q, k, v, layout, causal=causal)[0]
    for backend in backends:
        assert rel_err(block_sparse_attention(q, k, v, layout, causal=causal, backend=backend), ref) < 1e-5
    if "triton" in backends:
        with IOCounter() as io:
            block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")
        assert io.report == traffic.block_sparse_forward(layout, 1, 3, 3, 16, torch.float32, causal=causal)
