import pytest
import torch

from sparse_io_attn import BlockSparseLayout
from sparse_io_attn._csr import csr_to_mask


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


def test_dense_mask_keeps_block_if_any_element():
    mask = torch.zeros(20, 12, dtype=torch.bool)
    mask[17, 3] = True  # last (partial) query block, first key block
    lo = BlockSparseLayout.from_dense_mask(mask, (8, 4))
    expect = torch.zeros(3, 3, dtype=torch.bool)
    expect[2, 0] = True
    assert torch.equal(lo.to_block_mask()[0, 0], expect)
    assert lo.seqlen == (20, 12)
    dense = lo.to_dense_mask()[0, 0]
    assert dense.shape == (20, 12) and dense[16:, :4].all() and dense.sum() == 4 * 4


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
