"""Pattern builders cost O(kept blocks): a million-token sequence with block 16 builds under a small
memory budget (the builders' own guard is set to 512 MiB here, so a builder that listed the block grid
or more candidates than it keeps would refuse), and patterns that keep too many blocks by their
definition refuse up front, before listing any block."""
import random

import pytest
import torch

from sparse_io_attn import patterns
from sparse_io_attn import _memory
from sparse_io_attn.layout.patterns import _grid, builders

N = 2 ** 20
BUDGET = 512 * 2 ** 20


@pytest.fixture
def small_memory(monkeypatch):
    monkeypatch.setattr(_memory, "available_memory_bytes", lambda device: (BUDGET, "test budget"))


def _rows_match(layout, elem, start: int, stop: int):
    """The layout's element mask for queries ``[start, stop)`` equals ``elem(q, k)`` there."""
    q = torch.arange(start, stop)[:, None]
    k = torch.arange(layout.seqlen_k)[None, :]
    got = layout.rows(start, stop).to_dense_mask()[0, 0]
    assert torch.equal(got, elem(q, k))


@pytest.mark.parametrize("name", ["sliding_window", "causal_window", "longformer", "bigbird", "document"])
def test_million_tokens_block_16_build_within_budget(small_memory, name):
    mid = N // 2 - 8                      # 32 query rows straddling block and document boundaries
    if name == "sliding_window":
        layout = patterns.sliding_window(N, 16, window=256)
        elem = lambda q, k: (q - k).abs() <= 256  # noqa: E731
        per_row = 2 * 256 // 16 + 1
    elif name == "causal_window":
        layout = patterns.sliding_window(N, 16, window=256, causal=True)
        elem = lambda q, k: ((q - k) >= 0) & ((q - k) <= 256)  # noqa: E731
        per_row = 256 // 16 + 1
    elif name == "longformer":
        layout = patterns.longformer(N, 16, window=256, global_tokens=[0, 5, N // 2])
        glob = torch.zeros(N, dtype=torch.bool)
        glob[[0, 5, N // 2]] = True
        elem = lambda q, k: ((q - k).abs() <= 256) | glob[q] | glob[k]  # noqa: E731
        per_row = None
    elif name == "bigbird":
        layout = patterns.bigbird(N, 16)
        elem, per_row = None, None
    else:
        layout = patterns.document(list(range(0, N + 1, 1000)) + [N], 16)
        doc = torch.arange(N) // 1000
        elem = lambda q, k: doc[q] == doc[k]  # noqa: E731
        per_row = None
    assert layout.seqlen == (N, N)
    counts = layout.row_counts()[0]
    assert counts.numel() == N // 16
    if per_row is not None:               # interior rows keep exactly the band's blocks
        assert int(counts[1000]) == per_row
    if name == "bigbird":                 # window (3 blocks) + 2 global columns + 3 random per row
        assert int(counts[1000]) == 3 + 2 + 3
        assert int(counts[0]) == N // 16  # global rows are complete
    if elem is not None:
        _rows_match(layout, elem, mid, mid + 32)


@pytest.mark.parametrize("build,count", [
    # each query attends every 256th token of the whole sequence: (about) N/16 rows x N/256 diagonals
    pytest.param(lambda: patterns.strided(N, 16, stride=256), None, id="strided"),
    # every key block holding a chunk's summary is attended by every row: N/16 x N/128 blocks at least
    pytest.param(lambda: patterns.fixed(N, 16), (N // 16) * (N // 128), id="fixed"),
    # default window is N/25 each side: about 2 * 41943 / 16 blocks per row
    pytest.param(lambda: patterns.longformer(N, 16), None, id="longformer-default-window"),
    pytest.param(lambda: patterns.prefix_lm(N, 16, prefix=N // 2), None, id="prefix-lm"),
    pytest.param(lambda: patterns.bigbird(N, 16, window=N // 4), None, id="bigbird-wide-window"),
])
def test_patterns_too_large_refuse_before_listing_blocks(small_memory, monkeypatch, build, count):
    def no_listing(*args, **kwargs):
        raise AssertionError("a block list was built before the size check")

    monkeypatch.setattr(_grid, "_expand", no_listing)
    monkeypatch.setattr(builders, "_expand", no_listing)
    with pytest.raises(ValueError, match=r"keeps about ([\d,]+) blocks.*0\.5 GiB is available \(test budget\)") as e:
        build()
    if count is not None:
        assert int(e.value.args[0].split("about ")[1].split(" blocks")[0].replace(",", "")) >= count


def test_diagonal_count_is_exact():
    """The guard's count of blocks on thin diagonals equals the blocks holding an element of them."""
    rng = random.Random(1234)
    for _ in range(300):
        sq, sk = rng.randint(1, 90), rng.randint(1, 90)
        bq, bk = rng.randint(1, 24), rng.randint(1, 24)
        g = _grid._Grid((sq, sk), (bq, bk))
        offsets = rng.sample(range(-sk - 3, sq + 3), 12)
        expect = sum(len({(q // bq, (q - d) // bk) for q in range(sq) if 0 <= q - d < sk}) for d in offsets)
        assert g.diagonals_count(torch.tensor(offsets)) == expect, (sq, sk, bq, bk, offsets)

