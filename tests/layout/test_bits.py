"""The bit-packed element-mask format: pack/unpack round trip and the bit count the traffic model uses."""
import pytest
import torch

from sparse_io_attn.layout import _bits


def test_pack_unpack_round_trip_and_popcount():
    """Random masks (block widths not a multiple of 32 included) survive pack -> unpack exactly, and
    ``popcount`` equals the number of allowed elements, for words with the sign bit set too."""
    for bk in (1, 31, 32, 33, 100):
        mask = torch.rand(40, 8, bk) < torch.rand(40, 1, 1)
        words = _bits.pack(mask)
        assert torch.equal(_bits.unpack(words, bk), mask)
        assert torch.equal(_bits.popcount(words), mask.sum(dim=(-2, -1)))
    extremes = torch.tensor([[[-1, 0]], [[-2 ** 31, 1]], [[2 ** 31 - 1, -2]]], dtype=torch.int32)
    assert _bits.popcount(extremes).tolist() == [32, 2, 62]


def _brute_counts(r, c, ids, masks, block_size, seqlen, delta):
    """Allowed elements per block by expanding each block to its elements (the reference)."""
    (bq, bk), (sq, sk) = block_size, seqlen
    out = []
    for ri, ci, p in zip(r.tolist(), c.tolist(), ids.tolist()):
        q = ri * bq + torch.arange(bq)[:, None]
        k = ci * bk + torch.arange(bk)[None, :]
        allowed = (q < sq) & (k < sk)
        if p >= 0:
            allowed &= _bits.unpack(masks[p], bk)
        if delta is not None:
            allowed &= k <= q + delta
        out.append(int(allowed.sum()))
    return out


@pytest.mark.parametrize("block_size,seqlen", [
    pytest.param((16, 16), (100, 100), id="b16-N100"),
    pytest.param((16, 48), (77, 203), id="b16x48-rect"),
    pytest.param((32, 8), (64, 61), id="b32x8-ragged-k"),
    pytest.param((7, 33), (50, 70), id="b7x33-odd"),
])
@pytest.mark.parametrize("delta", [None, 0, -9, 13, -1000, 1000], ids=lambda d: f"delta{d}")
def test_block_counts_match_element_expansion(block_size, seqlen, delta):
    """``block_counts`` (full blocks by their in-range rectangle, masks popcounted once, causal
    crossings grouped) equals counting the expanded elements of every block, for ragged ends,
    rectangular blocks and diagonals below, through and above the grid."""
    (bq, bk), (sq, sk) = block_size, seqlen
    R, C = -(-sq // bq), -(-sk // bk)
    r, c = torch.meshgrid(torch.arange(R), torch.arange(C), indexing="ij")
    r, c = r.flatten(), c.flatten()
    # canonical masks as layouts store them: no bit past the sequence ends; interior blocks share
    # a few masks, edge blocks get their own
    inrange = ((r * bq)[:, None, None] + torch.arange(bq)[None, :, None] < sq) & \
              ((c * bk)[:, None, None] + torch.arange(bk)[None, None, :] < sk)
    shared = torch.rand(3, bq, bk) < torch.rand(3, 1, 1)
    pick = torch.randint(0, 3, (r.numel(),))
    elems = torch.where(inrange.all((1, 2))[:, None, None], shared[pick], torch.rand(r.numel(), bq, bk) < 0.5)
    masks = torch.cat([_bits.pack(shared), _bits.pack(elems & inrange)])
    ids = torch.where(torch.rand(r.numel()) < 0.3, -1,
                      torch.where(inrange.all((1, 2)), pick, 3 + torch.arange(r.numel())))
    got = _bits.block_counts(r, c, ids, masks, block_size, seqlen, delta)
    assert got.dtype == torch.int64
    assert got.tolist() == _brute_counts(r, c, ids, masks, block_size, seqlen, delta)


def test_block_counts_without_masks_and_without_blocks():
    """All-full layouts (no stored mask) and empty block lists are counted too."""
    none = torch.zeros(0, 4, 1, dtype=torch.int32)
    r, c = torch.tensor([0, 1, 2]), torch.tensor([2, 1, 0])
    ids = torch.full((3,), -1)
    assert _bits.block_counts(r, c, ids, none, (4, 4), (10, 10)).tolist() == [8, 16, 8]
    assert _bits.block_counts(r, c, ids, none, (4, 4), (10, 10), 0).tolist() == [0, 10, 8]
    e = torch.zeros(0, dtype=torch.int64)
    assert _bits.block_counts(e, e, e, none, (4, 4), (10, 10), 0).tolist() == []
