import pytest
import torch

from sparse_io_attn import BlockSparseLayout, plan
from sparse_io_attn.layout._csr import csr_to_mask, front_slots, pack_front


@pytest.mark.parametrize("shape,block,seqlen", [
    pytest.param((5, 7), 16, None, id="2d"),
    pytest.param((3, 5, 7), (16, 32), (70, 200), id="heads-rect-ragged"),
    pytest.param((2, 3, 4, 4), 8, (30, 25), id="batch-heads"),
])
def test_block_mask_roundtrip_and_csc(shape, block, seqlen):
    m = torch.rand(shape) > 0.5
    lo = BlockSparseLayout.from_block_mask(m, block, seqlen)
    assert torch.equal(lo.to_block_mask().reshape(m.shape), m)
    m3 = m.reshape(-1, *m.shape[-2:])
    assert torch.equal(csr_to_mask(lo.ccol_indices, lo.row_indices, m.shape[-2]), m3.transpose(1, 2))
    assert lo.nnz_blocks == int(m.sum())
    assert lo.density == pytest.approx(m.float().mean().item())


def test_dense_mask_exact_and_block_level():
    mask = torch.zeros(20, 12, dtype=torch.bool)
    mask[17, 3] = True       # last (ragged) query block, first key block: a partial block
    mask[0:8, 4:8] = True    # block (0, 1) entirely: a full block
    expect = torch.zeros(3, 3, dtype=torch.bool)
    expect[2, 0] = expect[0, 1] = True
    exact = BlockSparseLayout.from_dense_mask(mask, (8, 4))
    assert torch.equal(exact.to_block_mask()[0, 0], expect) and exact.seqlen == (20, 12)
    assert exact.num_partial_blocks == 1 and exact.partial_masks.shape[0] == 1
    assert torch.equal(exact.to_dense_mask()[0, 0], mask)
    approx = BlockSparseLayout.from_dense_mask(mask, (8, 4), exact=False)
    assert torch.equal(approx.to_block_mask()[0, 0], expect) and approx.num_partial_blocks == 0
    dense = approx.to_dense_mask()[0, 0]
    assert dense.shape == (20, 12) and dense[16:, :4].all() and dense.sum() == 4 * 4 + 8 * 4


def test_validation_errors():
    crow = torch.tensor([[0, 2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="sorted and unique"):
        BlockSparseLayout(crow, torch.tensor([1, 0, 0], dtype=torch.int32), block_size=4, seqlen=8)
    with pytest.raises(ValueError, match="duplicate"):
        BlockSparseLayout(crow, torch.tensor([1, 1, 0], dtype=torch.int32), block_size=4, seqlen=8)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        BlockSparseLayout(crow, torch.tensor([0, 1, 2], dtype=torch.int32), block_size=4, seqlen=8)
    with pytest.raises(TypeError, match="int32 or int64"):
        BlockSparseLayout(crow.float(), torch.tensor([0, 1, 0]), block_size=4, seqlen=8)
    with pytest.raises(TypeError, match="torch.bool"):
        BlockSparseLayout.from_block_mask(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="needs a block mask of"):
        BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 4, seqlen=(12, 8))
    with pytest.raises(ValueError, match="positive"):
        BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 0)


def test_union_intersection_and_str():
    a = BlockSparseLayout.from_block_mask(torch.eye(4, dtype=torch.bool), 16, name="diag")
    b = BlockSparseLayout.from_block_mask(torch.ones(4, 4, dtype=torch.bool).tril(), 16, name="causal")
    assert torch.equal((a | b).to_block_mask(), b.to_block_mask())
    assert torch.equal((a & b).to_block_mask(), a.to_block_mask())
    s = str(a)
    assert "█░░░" in s and "nnz_blocks=4" in repr(a)
    big = BlockSparseLayout.from_block_mask(torch.ones(100, 100, dtype=torch.bool), 1)
    assert "more block rows" in str(big)


# ------------------------------------------------------------------------------ validation
CROW = torch.tensor([[0, 2, 3]], dtype=torch.int32)  # 2 block rows, 3 stored blocks


@pytest.mark.parametrize("crow,col,exc,match", [
    pytest.param(CROW, torch.tensor([0, 1, 0.5]), TypeError, "col_indices must be int32 or int64", id="float-col"),
    pytest.param(CROW.bool(), torch.tensor([0, 1, 0]), TypeError, "crow_indices must be int32", id="bool-crow"),
    pytest.param(CROW.tolist(), torch.tensor([0, 1, 0]), TypeError, "must be a torch.Tensor, got list", id="list"),
    pytest.param(CROW[0], torch.tensor([0, 1, 0]), ValueError, r"shape \[L, 3\]", id="1d-crow"),
    pytest.param(torch.zeros(0, 3, dtype=torch.int32), torch.tensor([], dtype=torch.int32), ValueError,
                 r"L >= 1", id="no-layouts"),
    pytest.param(torch.tensor([[0, 1, 2, 3]]), torch.tensor([0, 1, 0]), ValueError, r"\[L, 3\]", id="wrong-rows"),
    pytest.param(CROW, torch.tensor([[0, 1, 0]]), ValueError, "1-D", id="2d-col"),
    pytest.param(torch.tensor([[1, 2, 3]]), torch.tensor([0, 1, 0]), ValueError, r"\[0, 0\] must be 0", id="offset"),
    pytest.param(torch.tensor([[0, 2, 1]]), torch.tensor([0, 1]), ValueError, "non-decreasing", id="decreasing"),
    pytest.param(CROW, torch.tensor([0, 1]), ValueError, "must equal len", id="short-col"),
    pytest.param(CROW, torch.tensor([0, 1, -1]), ValueError, r"\[0, 2\), got values in \[-1, 1\]", id="negative"),
    pytest.param(torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([0, 1, 0, 1]), ValueError, "absolute offsets",
                 id="relative-offsets"),
])
def test_validate_csr_errors(crow, col, exc, match):
    with pytest.raises(exc, match=match):
        BlockSparseLayout(crow, col, block_size=4, seqlen=8)


def test_valid_csr_accepted_and_int64_narrowed():
    crow = torch.tensor([[0, 2, 3], [3, 3, 4]])
    col = torch.tensor([0, 1, 1, 0])
    lo = BlockSparseLayout(crow, col, block_size=(4, 2), seqlen=(7, 4), layout_batch=2)
    assert lo.crow_indices.dtype == torch.int32 and lo.col_indices.dtype == torch.int32
    expect = torch.tensor([[[1, 1], [0, 1]], [[0, 0], [1, 0]]], dtype=torch.bool)
    assert torch.equal(lo.to_block_mask().reshape(2, 2, 2), expect)
    assert (lo.layout_batch, lo.layout_heads) == (2, 1)
    with pytest.raises(ValueError, match="layout_batch \\* layout_heads"):
        BlockSparseLayout(crow, col, block_size=4, seqlen=8, layout_batch=2, layout_heads=2)


def test_plan_layout_strides_and_expand():
    m = torch.rand(3, 2, 2) > 0.3
    lo = BlockSparseLayout.from_block_mask(m, 4, (7, 8))
    assert plan(lo).layout_strides(5, 3) == (0, 1)
    shared = BlockSparseLayout.from_block_mask(m[0], 4, (7, 8))
    assert plan(shared).layout_strides(5, 3) == (0, 0)
    batched = BlockSparseLayout.from_block_mask(m.view(3, 1, 2, 2), 4, (7, 8))
    assert plan(batched).layout_strides(3, 6) == (1, 0)
    with pytest.raises(ValueError, match="3 head masks but q has 4 heads"):
        plan(lo).layout_strides(1, 4)
    with pytest.raises(ValueError, match="3 batch masks but the input has batch 2"):
        plan(batched).layout_strides(2, 1)
    with pytest.raises(ValueError, match="3 batch masks but the input has batch 2"):
        batched.expand_dense_mask(2, 1)
    full = lo.expand_dense_mask(2, 3)
    assert full.shape == (2, 3, 7, 8)
    assert torch.equal(full[1, 2], m[2].repeat_interleave(4, 0).repeat_interleave(4, 1)[:7, :8])


def test_expand_dense_mask_serves_a_per_kv_head_layout_as_the_attention_does():
    """A layout of one mask per KV head (what pooled top-k returns for GQA) expands to the query heads of
    each group, as the attention applies it; other head counts raise naming 1, Hq and per KV head."""
    m = torch.rand(2, 2, 3, 3) > 0.4
    lo = BlockSparseLayout.from_block_mask(m, 4, (11, 12))                     # batch 2, 2 KV heads
    want = lo.for_query_heads(6, 2).to_dense_mask()
    assert torch.equal(lo.expand_dense_mask(2, 6), want)
    assert torch.equal(lo.expand_dense_mask(2, 6, num_heads_kv=2), want)
    assert torch.equal(lo.expand_dense_mask(2, 6)[1, 4], m[1, 1].repeat_interleave(4, 0).repeat_interleave(4, 1)[:11, :12])
    with pytest.raises(ValueError, match="2 head masks but q has 6 heads and k/v 3; .*1 \\(shared\\), 6 .*per KV head"):
        lo.expand_dense_mask(2, 6, num_heads_kv=3)
    with pytest.raises(ValueError, match="2 head masks but q has 5 heads; .*one per KV head"):
        lo.expand_dense_mask(2, 5)
    with pytest.raises(ValueError, match="2 batch masks but the input has batch 3"):
        lo.expand_dense_mask(3, 6)


def test_to_same_device_and_equal_ignores_name():
    m = torch.rand(3, 3) > 0.5
    a = BlockSparseLayout.from_block_mask(m, 8, name="a")
    assert a.to("cpu") is a
    b = BlockSparseLayout.from_block_mask(m.clone(), 8, name="b")
    assert a.equal(b) and not a.equal(BlockSparseLayout.from_block_mask(m, 8, seqlen=(20, 24)))
    assert not a.equal(BlockSparseLayout.from_block_mask(~m, 8)) or bool((m == ~m).all())
    assert not a.equal("a")


def test_stack_layouts_and_combine_errors():
    from sparse_io_attn import stack_layouts
    parts = [BlockSparseLayout.from_block_mask(torch.rand(2, 3) > 0.5, 4) for _ in range(3)]
    st = stack_layouts(parts)
    assert st.layout_heads == 3
    assert all(torch.equal(st.to_block_mask()[0, h], p.to_block_mask()[0, 0]) for h, p in enumerate(parts))
    with pytest.raises(ValueError, match="at least one"):
        stack_layouts([])
    other = BlockSparseLayout.from_block_mask(torch.ones(2, 3, dtype=torch.bool), 8)
    with pytest.raises(ValueError, match="share block_size and seqlen"):
        parts[0] | other
    with pytest.raises(TypeError, match="expected a BlockSparseLayout"):
        parts[0] & "x"
    with pytest.raises(ValueError, match="do not broadcast"):
        st | BlockSparseLayout.from_block_mask(torch.ones(2, 2, 3, dtype=torch.bool), 4)


def test_relative_absolute_offsets():
    from sparse_io_attn.layout._csr import from_relative_offsets, to_relative_offsets
    rel = torch.tensor([[0, 2, 3], [0, 0, 4], [0, 1, 1]])
    ab = from_relative_offsets(rel)
    assert ab.tolist() == [[0, 2, 3], [3, 3, 7], [7, 8, 8]]
    assert torch.equal(to_relative_offsets(ab), rel)


def test_partial_blocks_algebra_pickle_draw_and_device():
    """Element-level | and &, pickling, .to(device) and the picture keep the partial blocks."""
    import pickle

    from sparse_io_attn import patterns

    a = patterns.sliding_window(100, 16, 9)
    b = patterns.document([0, 30, 70, 100], 16, causal=True)
    ea, eb = a.to_dense_mask()[0, 0], b.to_dense_mask()[0, 0]
    assert torch.equal((a | b).to_dense_mask()[0, 0], ea | eb)
    assert torch.equal((a & b).to_dense_mask()[0, 0], ea & eb)
    full = BlockSparseLayout.from_block_mask(torch.ones(7, 7, dtype=torch.bool), 16, 100)
    assert (a & full).equal(a) and (a | full).equal(full)
    back = pickle.loads(pickle.dumps(b))
    assert back.equal(b) and back.num_partial_blocks == b.num_partial_blocks > 0
    pic = b.draw()
    assert "▒" in pic and "█" in pic and "░" in pic
    assert f"({b.num_partial_blocks} partial)" in repr(b)
    # the transposed copy carries the partial ids in its own order
    from sparse_io_attn.layout._csr import csr_transpose
    _, _, perm = csr_transpose(b.crow_indices, b.col_indices, b.num_kv_blocks)
    assert torch.equal(b.csc_partial_ids, b.partial_ids[perm])


@pytest.mark.parametrize("n, p", [(0, 0.5), (1, 1.0), (7, 0.0), (50, 0.3), (50, 1.0), (513, 0.6)])
def test_pack_front_equals_boolean_indexing(n, p):
    """``pack_front`` (one scatter, fixed size) puts exactly ``values[keep]`` first, in order, then ``fill``."""
    g = torch.Generator().manual_seed(n)
    keep = torch.rand(n, generator=g) < p
    values = torch.randint(-1000, 1000, (n,), generator=g)
    got = pack_front(front_slots(keep), values, -7)
    want = torch.cat([values[keep], torch.full((n - int(keep.sum()),), -7)]).to(torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)
