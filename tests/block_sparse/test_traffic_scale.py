"""Kept-element counts at a million tokens, against brute-force counts of smaller instances, and
unchanged from the element-expanding implementation they replaced."""
import pytest
import torch

from sparse_io_attn.block_sparse import traffic
from sparse_io_attn.layout import _bits
from sparse_io_attn.layout.patterns import from_spec


def _per_head(layout, causal=False):
    """Kept elements of each stored mask, ``[L]`` (what ``kept_elements`` sums over heads)."""
    lid, r, c = layout.entries()
    delta = 0 if causal else None
    counts = _bits.block_counts(r, c, layout.partial_ids, layout.partial_masks, layout.block_size,
                                layout.seqlen, delta)
    return torch.zeros(layout.num_layouts, dtype=torch.int64).index_add_(0, lid, counts).tolist()


def _brute_per_head(spec, n, block, causal):
    """Allowed elements of each head from the expanded element mask (``k <= q`` when causal)."""
    mask = from_spec(spec, n, block).to_dense_mask()[0]          # [heads, n, n]
    if causal:
        mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
    return mask.sum((1, 2)).tolist()


# Each pattern's per-head element count is affine in N once N is past its edge effects (a band of
# fixed width, global rows and columns of fixed height, a fixed number of whole random blocks per
# block row, documents of fixed length): two brute-forced small instances fix the line, and the
# count at 1M tokens must lie on it.
@pytest.mark.parametrize("spec,block,small,N,causal", [
    pytest.param(lambda n: "sliding_window:512", 64, (2048, 4096), 1 << 20, False, id="sliding_window512"),
    pytest.param(lambda n: "sliding_window:300,causal", (64, 32), (2048, 4096), 1 << 20, False,
                 id="sliding_window300-causal"),
    pytest.param(lambda n: "sliding_window:200", 64, (2048, 4096), 1 << 20, True, id="sliding_window200-causal-call"),
    pytest.param(lambda n: "bigbird:num_heads=2", 64, (2048, 4096), 1 << 20, False, id="bigbird-2heads"),
    pytest.param(lambda n: "bigbird:100,1,2,causal", 32, (2048, 4096), 1 << 20, False, id="bigbird-causal"),
    pytest.param(lambda n: f"documents:{n // 1024}", 64, (2048, 4096), 1 << 20, False, id="documents1024"),
    pytest.param(lambda n: f"documents:{n // 1000},causal", 64, (2000, 4000), 1000 << 10, False,
                 id="documents1000-causal"),
])
def test_kept_elements_at_a_million_tokens_match_brute_force_line(spec, block, small, N, causal):
    n1, n2 = small
    c1, c2 = (_brute_per_head(spec(n), n, block, causal) for n in small)
    assert all((b - a) * (N - n1) % (n2 - n1) == 0 for a, b in zip(c1, c2))
    expect = [a + (b - a) * (N - n1) // (n2 - n1) for a, b in zip(c1, c2)]
    big = from_spec(spec(N), N, block)
    assert _per_head(big, causal) == expect
    assert traffic.kept_elements(big, 3, len(expect), causal=causal) == 3 * sum(expect)


# (spec, n, block, (kept elements, kept elements causal)) from the implementation that expanded
# every kept block to its elements (summed over the layout's heads).
BEFORE = [
    ("sliding_window:100", 1000, 16, (190900, 95950)),
    ("sliding_window:37,causal", 517, (16, 48), (18943, 18943)),
    ("bigbird:64,num_heads=2", 1000, 32, (654544, 336208)),
    ("document:5", 777, 32, (120749, 60763)),
    ("longformer:40", 600, 16, (48078, 24339)),
    ("strided:48", 500, 16, (49964, 25232)),
    ("fixed:64,8,causal", 640, 32, (43840, 43840)),
    ("prefix_lm:77", 300, (32, 16), (48076, 45150)),
    ("random:0.3,heads=2", 400, 16, (96256, 43616)),
]


@pytest.mark.parametrize("spec,n,block,expect", BEFORE, ids=[b[0] for b in BEFORE])
def test_kept_elements_unchanged(spec, n, block, expect):
    layout = from_spec(spec, n, block)
    got = tuple(traffic.kept_elements(layout, 1, layout.layout_heads, causal=c) for c in (False, True))
    assert got == expect
    mask = layout.to_dense_mask()[0]
    assert got[1] == int((mask & torch.ones(n, n, dtype=torch.bool).tril()).sum())
