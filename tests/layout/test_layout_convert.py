"""Conversions of BlockSparseLayout to and from SciPy BSR, torch BSR, FlexAttention BlockMask and
dense masks: exact round trips, the meaning of the produced objects, and errors on bad input."""
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask

CASES = [  # (mask shape [.., nqb, nkb], block_size, seqlen)
    pytest.param((4, 4), 16, None, id="2d-square"),
    pytest.param((3, 5), (16, 8), (40, 37), id="2d-rect-ragged"),
    pytest.param((3, 4, 2), (8, 32), (25, 40), id="heads-ragged"),
    pytest.param((2, 3, 3, 4), 8, (17, 30), id="batch-heads-ragged"),
    pytest.param((1, 1), 4, (1, 3), id="one-block"),
]


def random_layout(shape, block, seqlen, p=0.5):
    m = torch.rand(shape) < p
    return BlockSparseLayout.from_block_mask(m, block, seqlen), m


def elem_blocks(layout):
    """Per stored mask, the element mask padded with False to whole blocks (what BSR values hold)."""
    bq, bk = layout.block_size
    pad = torch.zeros(layout.num_layouts, layout.num_q_blocks * bq, layout.num_kv_blocks * bk, dtype=torch.bool)
    pad[:, :layout.seqlen_q, :layout.seqlen_k] = layout.to_dense_mask().reshape(-1, *layout.seqlen)
    return pad


def random_exact_layout(shape, block, seqlen, p=0.5):
    """Element-exact layout of a random element mask with structure: some blocks full, some partial,
    some empty."""
    bq, bk = (block, block) if isinstance(block, int) else block
    lead, (nqb, nkb) = shape[:-2], shape[-2:]
    sq, sk = seqlen if seqlen is not None else (nqb * bq, nkb * bk)
    sq, sk = (sq, sq) if isinstance(sq, int) and seqlen is not None and not isinstance(seqlen, tuple) else (sq, sk)
    blocks = torch.rand(*lead, nqb, nkb) < p
    elem = blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :sq, :sk]
    elem = elem & (torch.rand(elem.shape) < 0.7) | (elem & (torch.rand(*lead, nqb, nkb) < 0.5)
                                                      .repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :sq, :sk])
    return BlockSparseLayout.from_dense_mask(elem, block), elem


@pytest.mark.parametrize("shape,block,seqlen", CASES)
def test_scipy_roundtrip(shape, block, seqlen):
    lo, m = random_layout(shape, block, seqlen)
    out = lo.to_scipy_bsr()
    mats = out if isinstance(out, list) else [out]
    assert isinstance(out, list) == (lo.num_layouts > 1) and len(mats) == lo.num_layouts
    bq, bk = lo.block_size
    for mat, blocks in zip(mats, elem_blocks(lo)):
        assert mat.format == "bsr" and mat.blocksize == (bq, bk) and mat.dtype == np.int8
        assert mat.shape == (lo.num_q_blocks * bq, lo.num_kv_blocks * bk)
        # the matrix is the element mask (past the sequence ends: 0)
        dense = torch.from_numpy(mat.toarray()).bool()
        assert torch.equal(dense, blocks)
    back = BlockSparseLayout.from_scipy_bsr(out, seqlen=lo.seqlen, layout_batch=lo.layout_batch)
    assert back.equal(lo)


def test_scipy_from_foreign_matrix():
    """SciPy's own tobsr of an element mask: stored blocks are those with a nonzero."""
    elem = torch.rand(48, 40) < 0.02
    mat = sp.csr_matrix(elem.numpy()).tobsr(blocksize=(16, 8))
    got = BlockSparseLayout.from_scipy_bsr(mat)
    assert got.equal(BlockSparseLayout.from_dense_mask(elem, (16, 8)))
    # non-canonical input: unsorted indices with a duplicate block
    data = np.ones((3, 2, 2))
    mat = sp.bsr_matrix((data, np.array([2, 0, 2]), np.array([0, 3, 3])), shape=(4, 6))
    expect = torch.tensor([[True, False, True], [False, False, False]])
    assert torch.equal(BlockSparseLayout.from_scipy_bsr(mat).to_block_mask()[0, 0], expect)
    arr = sp.bsr_array(mat)
    assert BlockSparseLayout.from_scipy_bsr(arr).equal(BlockSparseLayout.from_scipy_bsr(mat))


@pytest.mark.parametrize("shape,block,seqlen", CASES)
def test_torch_bsr_roundtrip(shape, block, seqlen):
    lo, m = random_layout(shape, block, seqlen)
    bq, bk = lo.block_size
    parts = lo.to_torch_bsr(as_list=True)
    assert len(parts) == lo.num_layouts
    for t, blocks in zip(parts, elem_blocks(lo)):
        assert t.layout == torch.sparse_bsr and t.values().shape[-2:] == (bq, bk)
        assert torch.equal(t.to_dense(), blocks)
    assert BlockSparseLayout.from_torch_bsr(parts, lo.seqlen, layout_batch=lo.layout_batch).equal(lo)
    nnz = lo.crow_indices[:, -1] - lo.crow_indices[:, 0]
    if lo.num_layouts == 1 or bool((nnz == nnz[0]).all()):
        t = lo.to_torch_bsr(dtype=torch.float32)
        assert t.dtype == torch.float32
        assert BlockSparseLayout.from_torch_bsr(t, lo.seqlen).equal(lo)
    else:
        with pytest.raises(ValueError, match="as_list=True"):
            lo.to_torch_bsr()


@pytest.mark.parametrize("lead", [(3,), (2, 3)], ids=["heads", "batch-heads"])
def test_torch_batched_bsr_equal_nnz(lead):
    m = torch.zeros(*lead, 5, 6, dtype=torch.bool)
    for idx in np.ndindex(*lead):  # 7 blocks in every mask, at different places
        m[idx].view(-1)[torch.randperm(30)[:7]] = True
    lo = BlockSparseLayout.from_block_mask(m, (4, 8), (18, 45))
    t = lo.to_torch_bsr()
    assert t.shape == (*lead, 20, 48) and t.crow_indices().shape == (*lead, 6)
    assert torch.equal(t.to_dense(), elem_blocks(lo).view(*lead, 20, 48))
    assert BlockSparseLayout.from_torch_bsr(t, lo.seqlen).equal(lo)
    # torch's own conversion of the element mask gives the same layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = lo.to_dense_mask().reshape(-1, 18, 45)[0].float()
        theirs = torch.nn.functional.pad(theirs, (0, 3, 0, 2)).to_sparse_bsr((4, 8))
    single = BlockSparseLayout.from_torch_bsr(theirs, (18, 45))
    assert torch.equal(single.to_block_mask()[0, 0], m.reshape(-1, 5, 6)[0])


@pytest.mark.parametrize("shape,block,seqlen", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_block_mask(shape, block, seqlen, causal):
    lo, m = random_layout(shape, block, seqlen, p=0.6)
    bm = lo.to_flex_block_mask(causal=causal)
    assert isinstance(bm, BlockMask)
    assert bm.BLOCK_SIZE == lo.block_size and tuple(bm.seq_lengths) == lo.seqlen
    assert tuple(bm.kv_num_blocks.shape) == (lo.layout_batch, lo.layout_heads, lo.num_q_blocks)
    B, H = lo.layout_batch, lo.layout_heads
    sq, sk = lo.seqlen
    # mask_mod is exactly the element mask attention uses (block mask, lengths, causal)
    want = element_mask(lo, B, H, sq, sk, causal=causal)
    assert torch.equal(create_mask(bm.mask_mod, B, H, sq, sk, device="cpu"), want)
    # partial + full blocks are the blocks holding a kept element; full blocks are entirely kept
    pad = torch.zeros(B, H, lo.num_q_blocks * lo.BLOCK_SIZE_Q, lo.num_kv_blocks * lo.BLOCK_SIZE_KV,
                      dtype=torch.bool)
    pad[..., :sq, :sk] = want
    tiles = pad.view(B, H, lo.num_q_blocks, lo.BLOCK_SIZE_Q, lo.num_kv_blocks, lo.BLOCK_SIZE_KV)
    any_kept = tiles.any(dim=(3, 5))
    all_kept = tiles.all(dim=(3, 5))
    assert torch.equal(bm.to_dense().bool(), any_kept)
    full_blocks = torch.zeros_like(any_kept)
    for b in range(B):
        for h in range(H):
            for r in range(lo.num_q_blocks):
                n = int(bm.full_kv_num_blocks[b, h, r])
                full_blocks[b, h, r, bm.full_kv_indices[b, h, r, :n].long()] = True
    assert torch.equal(full_blocks, all_kept)
    # round trip: exact without causal; with causal, the blocks above the diagonal are gone
    back = BlockSparseLayout.from_flex_block_mask(bm)
    expect = lo & patterns.causal(lo.seqlen, lo.block_size) if causal else lo
    assert back.equal(expect)
    # without the full/partial split every kept block is partial
    plain = lo.to_flex_block_mask(causal=causal, separate_full_blocks=False)
    assert plain.full_kv_num_blocks is None and BlockSparseLayout.from_flex_block_mask(plain).equal(expect)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_attention_matches_reference(causal):
    """Eager flex_attention with our BlockMask equals the float64 block-sparse reference (ragged
    lengths, per-head layout, a fully masked query block)."""
    B, H, sq, sk, D = 1, 2, 45, 37, 16
    m = torch.rand(H, 3, 5) < 0.6
    m[:, 1] = False  # an empty block row: zero output, no NaN
    m[:, 0, 0] = True
    lo = BlockSparseLayout.from_block_mask(m, (16, 8), (sq, sk))
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (sq, sk, sk))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=lo.to_flex_block_mask(causal=causal))
    ref, _ = attention_reference(q, k, v, lo, causal=causal)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_from_torch_create_block_mask():
    """BlockMasks built by torch's own create_block_mask read back as the matching pattern."""
    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 20

    bm = create_block_mask(causal_mod, None, None, 100, 70, device="cpu", BLOCK_SIZE=(16, 8))
    assert BlockSparseLayout.from_flex_block_mask(bm).equal(patterns.causal((100, 70), (16, 8)))
    bm = create_block_mask(window_mod, 1, 2, 96, 96, device="cpu", BLOCK_SIZE=32)
    got = BlockSparseLayout.from_flex_block_mask(bm)
    assert got.layout_heads == 2
    assert torch.equal(got.to_block_mask()[0, 1], patterns.sliding_window(96, 32, 20).to_block_mask()[0, 0])


@pytest.mark.parametrize("shape,block,seqlen", CASES)
def test_dense_mask_roundtrip(shape, block, seqlen):
    lo, m = random_layout(shape, block, seqlen)
    dense = lo.to_dense_mask()
    assert dense.shape == (lo.layout_batch, lo.layout_heads, *lo.seqlen)
    back = BlockSparseLayout.from_dense_mask(dense, lo.block_size)
    assert back.equal(lo)


def test_conversion_errors():
    lo = BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 4)
    csr = sp.csr_matrix(np.ones((8, 8)))
    with pytest.raises(TypeError, match=r"scipy.sparse BSR .* got a scipy.sparse csr matrix.*tobsr"):
        BlockSparseLayout.from_scipy_bsr(csr)
    with pytest.raises(TypeError, match="got ndarray"):
        BlockSparseLayout.from_scipy_bsr(np.ones((8, 8)))
    with pytest.raises(ValueError, match="empty list"):
        BlockSparseLayout.from_scipy_bsr([])
    with pytest.raises(ValueError, match="share shape and blocksize"):
        BlockSparseLayout.from_scipy_bsr([csr.tobsr((4, 4)), csr.tobsr((2, 2))])
    with pytest.raises(ValueError, match="positive divisor"):
        BlockSparseLayout.from_scipy_bsr([csr.tobsr((4, 4))] * 3, layout_batch=2)
    with pytest.raises(ValueError, match="the BSR input has 2 x 2"):
        BlockSparseLayout.from_scipy_bsr(csr.tobsr((4, 4)), seqlen=20)
    with pytest.raises(TypeError, match="torch.sparse_bsr tensor, got a tensor with layout torch.strided"):
        BlockSparseLayout.from_torch_bsr(torch.ones(8, 8))
    with pytest.raises(TypeError, match="sparse_bsr tensor, got a tensor with layout torch.sparse_csr"):
        BlockSparseLayout.from_torch_bsr(torch.ones(8, 8).to_sparse_csr())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = torch.sparse_bsr_tensor(torch.tensor([0, 2, 2]), torch.tensor([1, 0]),
                                      torch.ones(2, 4, 4), size=(8, 8), check_invariants=False)
    with pytest.raises(ValueError, match="sorted and unique"):
        BlockSparseLayout.from_torch_bsr(bad)
    with pytest.raises(ValueError, match="2-D BSR tensors"):
        BlockSparseLayout.from_torch_bsr([lo.to_torch_bsr(), torch.ones(4, 8, 8).to_sparse_bsr((4, 4))])
    with pytest.raises(TypeError, match="expected a torch.nn.attention.flex_attention.BlockMask"):
        BlockSparseLayout.from_flex_block_mask(lo)
    forged = BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]], dtype=torch.int32),
                                      torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32),
                                      BLOCK_SIZE=16, seq_lengths=(32, 10))  # 2 x 1 blocks, keeps (0, 1)
    with pytest.raises(ValueError, match=r"kv_indices\[0, 0, 0, 0\] = 1 .* outside \[0, 1\)"):
        BlockSparseLayout.from_flex_block_mask(forged)


@pytest.mark.parametrize("shape,block,seqlen", CASES)
def test_partial_blocks_round_trip_every_format(shape, block, seqlen):
    """Element-exact layouts (full, partial and empty blocks) survive dense mask, SciPy BSR, torch
    BSR and FlexAttention round trips exactly; the BlockMask's mask_mod is the element mask."""
    lo, elem = random_exact_layout(shape, block, seqlen)
    assert lo.num_partial_blocks > 0 or lo.nnz_blocks == 0
    sq, sk = lo.seqlen
    dense = lo.to_dense_mask()
    assert torch.equal(dense.reshape(-1, sq, sk), elem.reshape(-1, sq, sk))
    assert BlockSparseLayout.from_dense_mask(dense, lo.block_size).equal(lo)
    mats = lo.to_scipy_bsr()
    assert BlockSparseLayout.from_scipy_bsr(mats, seqlen=lo.seqlen, layout_batch=lo.layout_batch).equal(lo)
    parts = lo.to_torch_bsr(as_list=True)
    assert BlockSparseLayout.from_torch_bsr(parts, lo.seqlen, layout_batch=lo.layout_batch).equal(lo)
    for causal in (False, True):
        bm = lo.to_flex_block_mask(causal=causal)
        want = element_mask(lo, lo.layout_batch, lo.layout_heads, sq, sk, causal=causal)
        assert torch.equal(create_mask(bm.mask_mod, lo.layout_batch, lo.layout_heads, sq, sk, device="cpu"), want)
        back = BlockSparseLayout.from_flex_block_mask(bm)
        expect = lo & patterns.causal(lo.seqlen, lo.block_size) if causal else lo
        assert back.equal(expect)
        # Flex -> ours -> Flex: the same element mask again
        assert torch.equal(create_mask(back.to_flex_block_mask().mask_mod, lo.layout_batch, lo.layout_heads,
                                       sq, sk, device="cpu"), want)


def test_block_level_bsr_reading_keeps_stored_blocks_whole():
    """exact=False: every stored block is kept whole, values ignored (a block of zeros too)."""
    data = np.zeros((2, 2, 2))
    data[0, 0, 0] = 1
    mat = sp.bsr_matrix((data, np.array([0, 2]), np.array([0, 1, 2])), shape=(4, 6))
    exact = BlockSparseLayout.from_scipy_bsr(mat)
    whole = BlockSparseLayout.from_scipy_bsr(mat, exact=False)
    assert exact.nnz_blocks == 1 and exact.num_partial_blocks == 1
    assert whole.nnz_blocks == 2 and whole.num_partial_blocks == 0
    assert int(whole.to_dense_mask().sum()) == 8


def test_flex_padding_index_and_out_of_range_index():
    """FlexAttention pads kv_indices after the counted entries; a counted -1 or an index past the last
    block is an error naming the entry, not a silently dropped block or a bare IndexError."""
    ok = BlockMask.from_kv_blocks(torch.tensor([[[1, 2]]], dtype=torch.int32),
                                  torch.tensor([[[[0, -1], [1, 0]]]], dtype=torch.int32),
                                  BLOCK_SIZE=16, seq_lengths=(32, 32))
    assert torch.equal(BlockSparseLayout.from_flex_block_mask(ok).to_block_mask()[0, 0],
                       torch.tensor([[True, False], [True, True]]))
    for bad in (-1, 7):
        forged = BlockMask.from_kv_blocks(torch.tensor([[[2, 1]]], dtype=torch.int32),
                                          torch.tensor([[[[0, bad], [1, 0]]]], dtype=torch.int32),
                                          BLOCK_SIZE=16, seq_lengths=(32, 32), compute_q_blocks=False)
        with pytest.raises(ValueError, match=rf"kv_indices\[0, 0, 0, 1\] = {bad} .* outside \[0, 2\)"):
            BlockSparseLayout.from_flex_block_mask(forged)
