"""The layout stores int32 indices and mask words: values that do not fit are refused, never
truncated, by every constructor and conversion."""
from __future__ import annotations

import pytest
import torch

import sparse_io_attn.layout._csr as csr_module
from sparse_io_attn.layout import _bits, patterns
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix


def _one_partial(word: int, dtype=torch.int64):
    """A 1 x 1-block layout of block (2, 8) with one partial block whose words are ``word``."""
    crow = torch.tensor([[0, 1]], dtype=torch.int32)
    col = torch.tensor([0], dtype=torch.int32)
    ids = torch.tensor([0], dtype=torch.int32)
    masks = torch.full((1, 2, _bits.num_words(8)), word, dtype=dtype)
    return crow, col, ids, masks


@pytest.mark.parametrize("word", [2 ** 33 + 5, 2 ** 31, -(2 ** 31) - 1])
@pytest.mark.parametrize("validate", [True, False])
def test_partial_masks_outside_int32_refused(word, validate):
    crow, col, ids, masks = _one_partial(word)
    with pytest.raises(ValueError, match=r"partial_masks .*int32.*-2147483648, 2147483647"):
        BlockSparseLayout(crow, col, block_size=(2, 8), seqlen=(2, 8), partial_ids=ids,
                          partial_masks=masks, validate=validate)


def test_partial_masks_int64_inside_int32_kept():
    crow, col, ids, masks = _one_partial(5)
    layout = BlockSparseLayout(crow, col, block_size=(2, 8), seqlen=(2, 8), partial_ids=ids, partial_masks=masks)
    assert torch.equal(layout.partial_masks, torch.full((1, 2, 1), 5, dtype=torch.int32))
    want = torch.tensor([[True, False, True, False, False, False, False, False]] * 2)
    assert torch.equal(layout.to_dense_mask()[0, 0], want)


@pytest.mark.parametrize("name", ["crow_indices", "col_indices", "partial_ids"])
def test_int64_indices_outside_int32_refused(name):
    crow, col, ids, masks = _one_partial(1, torch.int32)
    args = {"crow_indices": crow.to(torch.int64), "col_indices": col.to(torch.int64), "partial_ids": ids.to(torch.int64)}
    args[name] = args[name] + 2 ** 32    # truncation to int32 would give back the valid value
    with pytest.raises(ValueError, match="int32"):
        BlockSparseLayout(args["crow_indices"], args["col_indices"], block_size=(2, 8), seqlen=(2, 8),
                          partial_ids=args["partial_ids"], partial_masks=masks, validate=False)


@pytest.fixture
def index_limit(monkeypatch):
    """At most 5 stored blocks fit the indices (instead of 2**31 - 1)."""
    monkeypatch.setattr(csr_module, "INDEX_MAX", 5)


def _blocks(n: int) -> torch.Tensor:
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask.view(-1)[torch.randperm(9)[:n]] = True
    return mask


def test_every_constructor_refuses_too_many_blocks(index_limit):
    block_mask = _blocks(6)
    dense = block_mask.repeat_interleave(4, 0).repeat_interleave(4, 1)
    crow, col = csr_module.mask_to_csr(block_mask[None])
    builds = {
        "from_block_mask": lambda: BlockSparseLayout.from_block_mask(block_mask, 4),
        "from_dense_mask": lambda: BlockSparseLayout.from_dense_mask(dense, 4),
        "from_dense_mask(exact=False)": lambda: BlockSparseLayout.from_dense_mask(dense, 4, exact=False),
        "constructor": lambda: BlockSparseLayout(crow, col, block_size=4, seqlen=12),
        "constructor(validate=False)": lambda: BlockSparseLayout(crow, col, block_size=4, seqlen=12, validate=False),
        "from_scipy_bsr": lambda: BlockSparseLayout.from_scipy_bsr(
            __import__("scipy.sparse").sparse.csr_matrix(dense.numpy().astype("int8")).tobsr(blocksize=(4, 4))),
        "from_torch_bsr": lambda: BlockSparseLayout.from_torch_bsr(dense.to_sparse_bsr((4, 4))),
        "from_kv_indices": lambda: BlockSparseLayout.from_kv_indices(torch.zeros(3, 2, dtype=torch.long), 4, 12),
        "patterns.topk": lambda: patterns.topk(torch.randn(3, 3), 2, 4, 12),   # capacity: 3 rows x 2 slots
    }
    for what, build in builds.items():
        with pytest.raises(ValueError, match="at most 5 stored blocks"):
            build()
            pytest.fail(f"{what} accepted 6 blocks with room for 5")


def test_blocks_within_the_limit_accepted(index_limit):
    layout = BlockSparseLayout.from_block_mask(_blocks(5), 4)
    assert layout.nnz_blocks == 5


def test_block_sparse_matrix_refuses_too_many_blocks(index_limit):
    dense = torch.randn(12, 12) * _blocks(6).repeat_interleave(4, 0).repeat_interleave(4, 1)
    with pytest.raises(ValueError, match="at most 5 stored blocks"):
        BlockSparseMatrix.from_dense(dense, 4)
