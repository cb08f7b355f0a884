"""BlockSparseMatrix: conversions, counts, validation, printing, gradients, nnz_stats interop."""
import math

import pytest
import torch

from sparse_io_attn.layout._csr import csr_transpose, mask_to_csr
from sparse_io_attn.layout.matrix import BlockSparseMatrix


def _random_sparse_dense(shape, block, density, dtype=torch.float32):
    """A dense tensor whose blocks are zero with probability 1 - density (never all zero)."""
    br, bc = block
    R, C = math.ceil(shape[0] / br), math.ceil(shape[1] / bc)
    keep = torch.rand(R, C) < density
    keep.view(-1)[torch.randint(R * C, (1,))] = True
    elem = keep.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: shape[0], : shape[1]]
    return torch.randn(shape, dtype=dtype) * elem, keep


CASES = [
    pytest.param((64, 32), (16, 16), 0.5, id="64x32-b16-half"),
    pytest.param((70, 40), (16, 16), 0.3, id="70x40-b16-ragged"),
    pytest.param((33, 50), (8, 16), 0.8, id="33x50-b8x16-rect"),
    pytest.param((16, 16), (16, 16), 1.0, id="one-block"),
    pytest.param((100, 24), (32, 8), 0.05, id="100x24-b32x8-sparse"),
]


@pytest.mark.parametrize("shape,block,density", CASES)
def test_dense_roundtrip_and_counts(shape, block, density):
    x, keep = _random_sparse_dense(shape, block, density)
    m = BlockSparseMatrix.from_dense(x, block)
    assert torch.equal(m.to_dense(), x)
    assert torch.equal(m.to_block_mask(), keep)
    assert m.nnz_blocks == int(keep.sum())
    br, bc = block
    elem = keep.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: shape[0], : shape[1]]
    assert m.nnz == int(elem.sum())
    assert m.density == pytest.approx(int(elem.sum()) / (shape[0] * shape[1]))
    crow, col = mask_to_csr(keep[None])
    assert torch.equal(m.crow_indices, crow[0]) and torch.equal(m.col_indices, col)
    assert m.crow_indices.dtype == torch.int32 and m.col_indices.dtype == torch.int32


@pytest.mark.parametrize("shape,block,density", CASES)
def test_scipy_and_torch_roundtrip(shape, block, density):
    x, _ = _random_sparse_dense(shape, block, density, torch.float64)
    m = BlockSparseMatrix.from_dense(x, block)
    s = m.to_scipy_bsr()
    br, bc = block
    assert s.blocksize == block and s.shape == (m.num_block_rows * br, m.num_block_cols * bc)
    assert torch.equal(torch.from_numpy(s.toarray())[: shape[0], : shape[1]], x)
    back = BlockSparseMatrix.from_scipy_bsr(s, dtype=torch.float64, shape=shape)
    assert torch.equal(back.to_dense(), x)
    t = m.to_torch_bsr()
    assert torch.equal(t.to_dense()[: shape[0], : shape[1]], x)
    assert torch.equal(BlockSparseMatrix.from_torch_bsr(t, shape=shape).to_dense(), x)


def test_from_torch_bsr_of_to_sparse_bsr():
    x, _ = _random_sparse_dense((48, 32), (16, 8), 0.5)
    m = BlockSparseMatrix.from_torch_bsr(x.to_sparse_bsr((16, 8)))
    assert torch.equal(m.to_dense(), x) and m.block_size == (16, 8)


def test_index_map_and_transpose_share_csr_helpers():
    x, keep = _random_sparse_dense((80, 48), (16, 16), 0.5)
    m = BlockSparseMatrix.from_dense(x, 16)
    bmap = m.block_index_map()
    assert torch.equal(bmap >= 0, keep)
    assert torch.equal(bmap[keep], torch.arange(m.nnz_blocks, dtype=torch.int32))
    ccol, row, perm = m.transposed_indices()
    ref = csr_transpose(m.crow_indices[None], m.col_indices, m.num_block_cols)
    assert torch.equal(ccol, ref[0][0]) and torch.equal(row, ref[1]) and torch.equal(perm, ref[2])
    # values[perm] walks the blocks column by column
    mt = BlockSparseMatrix.from_dense(x.t().contiguous(), 16)
    assert torch.equal(m.values[perm].transpose(1, 2), mt.values)


def test_repr_and_str_draw_the_pattern():
    keep = torch.tensor([[True, False], [False, True], [True, True]])
    m = BlockSparseMatrix.random(keep, 16, shape=(40, 32))
    r = repr(m)
    assert "shape=(40, 32)" in r and "block_size=(16, 16)" in r and "nnz_blocks=4" in r
    assert str(m).splitlines()[1:] == ["█░", "░█", "██"]
    assert m.nnz == 16 * 16 * 2 + 8 * 16 * 2  # last block row has 8 rows in bounds
    big = BlockSparseMatrix.random(torch.ones(70, 70, dtype=torch.bool), 2)
    lines = big.draw().splitlines()
    assert lines[-1] == "⋮" and lines[0].endswith("…")


def test_random_zeroes_padding_and_validation_rejects_nonzero_padding():
    m = BlockSparseMatrix.random(torch.ones(2, 2, dtype=torch.bool), 16, shape=(20, 30))
    assert torch.equal(m.to_dense(), m.to_dense())  # usable
    full = m.to_torch_bsr().to_dense()
    assert (full[20:] == 0).all() and (full[:, 30:] == 0).all()
    vals = torch.randn(4, 16, 16)
    with pytest.raises(ValueError, match="outside shape"):
        BlockSparseMatrix(m.crow_indices, m.col_indices, vals, (20, 30), 16)


@pytest.mark.parametrize("bad,match", [
    pytest.param(dict(crow=torch.tensor([0, 1], dtype=torch.int32)), "crow_indices must have shape", id="crow-len"),
    pytest.param(dict(col=torch.tensor([1, 0, 0], dtype=torch.int32)), "sorted and unique", id="unsorted"),
    pytest.param(dict(col=torch.tensor([0, 5, 0], dtype=torch.int32)), r"must lie in \[0, 2\)", id="col-range"),
    pytest.param(dict(values=torch.randn(3, 16, 8)), r"values must have shape", id="values-shape"),
    pytest.param(dict(values=torch.ones(3, 16, 16, dtype=torch.int64)), "floating point", id="values-int"),
    pytest.param(dict(crow=torch.tensor([[0, 2, 3]])), "1-D", id="crow-2d"),
])
def test_validation_errors(bad, match):
    crow = bad.get("crow", torch.tensor([0, 2, 3], dtype=torch.int32))
    col = bad.get("col", torch.tensor([0, 1, 0], dtype=torch.int32))
    values = bad.get("values", torch.randn(3, 16, 16))
    with pytest.raises((ValueError, TypeError), match=match):
        BlockSparseMatrix(crow, col, values, (32, 32), 16)


def test_constructor_type_errors():
    with pytest.raises(TypeError, match="2-D torch.Tensor"):
        BlockSparseMatrix.from_dense(torch.randn(2, 3, 4), 2)
    with pytest.raises(TypeError, match="scipy.sparse bsr"):
        BlockSparseMatrix.from_scipy_bsr(torch.randn(4, 4))
    with pytest.raises(TypeError, match="sparse_bsr"):
        BlockSparseMatrix.from_torch_bsr(torch.randn(4, 4))
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockSparseMatrix.from_dense(torch.randn(4, 4), 0)


def test_gradient_lands_on_the_pattern_and_optimizer_steps():
    keep = torch.tensor([[True, False, True], [False, True, False]])
    m = BlockSparseMatrix.random(keep, 8, shape=(16, 20))
    m.values = torch.nn.Parameter(m.values)
    w = torch.randn(16, 20)
    loss = (m.to_dense() * w).sum()
    loss.backward()
    dense_grad = w.clone()
    expect = BlockSparseMatrix.from_dense(torch.ones(16, 20), 8)  # all blocks, to pick blocks from
    picked = torch.zeros(m.nnz_blocks, 8, 8)
    full = torch.zeros(16, 24)
    full[:, :20] = dense_grad
    for p, (r, c) in enumerate(zip(m.row_ids().tolist(), m.col_indices.tolist())):
        picked[p] = full[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8]
    assert torch.equal(m.values.grad, picked)
    assert m.grad.nnz_blocks == m.nnz_blocks and expect.nnz_blocks == 6
    before = m.values.detach().clone()
    torch.optim.SGD([m.values], lr=0.1).step()
    assert torch.allclose(m.values.detach(), before - 0.1 * picked)


def test_to_dtype_and_device_and_detach():
    m = BlockSparseMatrix.random(torch.ones(2, 2, dtype=torch.bool), 4)
    assert m.to("cpu") is m
    h = m.to(dtype=torch.float64)
    assert h.dtype == torch.float64 and torch.equal(h.to_dense(), m.to_dense().double())
    m.requires_grad_()
    assert m.requires_grad and not m.detach().requires_grad


@pytest.mark.parametrize("level", ["element", "block"])
def test_nnz_stats_accepts_block_sparse_operands(level):
    from sparse_io_attn.bounds import nnz_stats

    n, d, b = 96, 48, 16
    a1, _ = _random_sparse_dense((n, d), (b, b), 0.5)
    x, _ = _random_sparse_dense((d, d), (b, b), 0.5)
    a2, _ = _random_sparse_dense((n, d), (b, b), 0.7)
    A1, X, A2 = (BlockSparseMatrix.from_dense(t, b) for t in (a1, x, a2))
    st = nnz_stats(A1, X, A2, level=level)
    if level == "element":
        s1, sx, s2 = ((t.to_dense() != 0) | _stored(t) for t in (A1, X, A2))
        assert st.Z_A == min(A1.nnz, A2.nnz) and st.Z_X == X.nnz
        s1x = (s1.double() @ sx.double()) > 0
        sx2 = (sx.double() @ s2.double().t()) > 0
        assert st.Z_AX == min(int(s1x.sum()), int(sx2.sum()))
        assert st.Z_AXA == int(((s1x.double() @ s2.double().t()) > 0).sum())
    else:
        P1, PX, P2 = (t.to_block_mask().double() for t in (A1, X, A2))
        assert st.Z_A == min(A1.nnz_blocks, A2.nnz_blocks) and st.Z_X == X.nnz_blocks
        assert st.Z_AX == min(int(((P1 @ PX) > 0).sum()), int(((PX @ P2.t()) > 0).sum()))
        assert st.Z_AXA == int((((P1 @ PX) > 0).double() @ P2.t() > 0).sum())


def _stored(m: BlockSparseMatrix) -> torch.Tensor:
    """Element mask of stored blocks (a stored block counts fully, zeros included)."""
    br, bc = m.block_size
    mask = m.to_block_mask().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return mask[: m.shape[0], : m.shape[1]]
