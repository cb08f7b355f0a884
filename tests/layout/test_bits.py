"""The bit-packed element-mask format: pack/unpack round trip and the bit count the traffic model uses."""
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
