"""Hypothesis: for random layouts and shapes every conversion round-trips exactly, the CSC copy is
the transpose of the CSR, and nnz / density / row and column counts agree with the block mask."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_io_attn import BlockSparseLayout
from sparse_io_attn.layout._csr import csr_to_mask, validate_csr


@st.composite
def layouts(draw):
    lb = draw(st.integers(1, 2))
    lh = draw(st.integers(1, 3))
    bq = draw(st.sampled_from([1, 2, 4, 8, 16]))
    bk = draw(st.sampled_from([1, 2, 4, 8, 16]))
    sq = draw(st.integers(1, 6 * bq))
    sk = draw(st.integers(1, 6 * bk))
    R, C = -(-sq // bq), -(-sk // bk)
    density = draw(st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(lb, lh, R, C, generator=g) < density
    return BlockSparseLayout.from_block_mask(mask, (bq, bk), (sq, sk)), mask


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(layouts())
def test_csr_csc_counts(case):
    lo, mask = case
    L, R, C = lo.num_layouts, lo.num_q_blocks, lo.num_kv_blocks
    validate_csr(lo.crow_indices, lo.col_indices, R, C)
    validate_csr(lo.ccol_indices, lo.row_indices, C, R)  # the CSC copy is itself a valid CSR
    m3 = mask.reshape(L, R, C)
    assert torch.equal(lo.to_block_mask(), mask)
    assert torch.equal(csr_to_mask(lo.ccol_indices, lo.row_indices, R), m3.transpose(1, 2))
    assert lo.nnz_blocks == int(mask.sum()) == int(lo.row_indices.numel())
    assert lo.density == pytest.approx(int(mask.sum()) / mask.numel(), abs=0, rel=1e-12)
    assert torch.equal(lo.row_counts(), m3.sum(2))
    assert torch.equal(lo.col_counts(), m3.sum(1))


@SETTINGS
@given(layouts())
def test_roundtrips(case):
    lo, mask = case
    assert BlockSparseLayout.from_dense_mask(lo.to_dense_mask(), lo.block_size).equal(lo)
    sci = lo.to_scipy_bsr()
    assert BlockSparseLayout.from_scipy_bsr(sci, lo.seqlen, layout_batch=lo.layout_batch).equal(lo)
    parts = lo.to_torch_bsr(as_list=True)
    assert BlockSparseLayout.from_torch_bsr(parts, lo.seqlen, layout_batch=lo.layout_batch).equal(lo)
    nnz = mask.reshape(lo.num_layouts, -1).sum(1)
    if bool((nnz == nnz[0]).all()):
        assert BlockSparseLayout.from_torch_bsr(lo.to_torch_bsr(), lo.seqlen).equal(lo)
    assert BlockSparseLayout.from_flex_block_mask(lo.to_flex_block_mask()).equal(lo)
    assert BlockSparseLayout.from_flex_block_mask(
        lo.to_flex_block_mask(separate_full_blocks=False)).equal(lo)
    # a layout rebuilt from its own CSR (validated) is the same layout
    again = BlockSparseLayout(lo.crow_indices, lo.col_indices, block_size=lo.block_size, seqlen=lo.seqlen,
                              layout_batch=lo.layout_batch, layout_heads=lo.layout_heads)
    assert again.equal(lo)
