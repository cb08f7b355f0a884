"""SelectionPlan: normalised rows and key-major lists against a plain Python reading of the rules."""
import math

import pytest
import torch

from helpers import no_host_sync
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import plan_selection


def _rows_by_hand(indices, counts, nkb, bs, delta):
    L, Nq, K = indices.shape
    out = []
    for l in range(L):
        for t in range(Nq):
            n = K if counts is None else int(counts[l, t])
            blocks = {int(c) for c in indices[l, t, :n].tolist()
                      if 0 <= c < nkb and (delta is None or c * bs <= t + delta)}
            out.append(sorted(blocks))
    return out


CASES = [  # (L, Nq, Nk, K, block_size, causal_offset, with_counts)
    pytest.param(1, 7, 20, 4, 4, None, False, id="L1-N7-bs4"),
    pytest.param(3, 9, 17, 5, 4, 0, True, id="L3-ragged-causal-counts"),
    pytest.param(2, 6, 13, 6, 1, 7, False, id="single-tokens-bottom-right"),
    pytest.param(2, 5, 64, 3, 64, -2, True, id="one-block-negative-offset"),
]


@pytest.mark.parametrize("L, Nq, Nk, K, bs, delta, with_counts", CASES)
def test_rows_and_key_lists_follow_the_rules(L, Nq, Nk, K, bs, delta, with_counts):
    nkb = math.ceil(Nk / bs)
    indices = torch.randint(-2, nkb + 2, (L, Nq, K))          # repeats, empty slots, out of range
    counts = torch.randint(0, K + 1, (L, Nq)) if with_counts else None
    with no_host_sync():
        plan = plan_selection(Selection(indices, bs, counts), Nk, causal_offset=delta)
        keys = plan.keys()
    want = _rows_by_hand(indices, counts, nkb, bs, delta)
    rows = plan.rows.reshape(L * Nq, K)
    for i, blocks in enumerate(want):
        assert rows[i, :len(blocks)].tolist() == blocks
        assert (rows[i, len(blocks):] == -1).all()
        assert int(plan.row_counts.reshape(-1)[i]) == len(blocks)
    # key-major: for every (l, c), the tokens that chose c, ascending, with their slot
    ptr = keys.col_ptr
    assert ptr.shape == (L, nkb + 1) and int(ptr[0, 0]) == 0
    for l in range(L):
        for c in range(nkb):
            lo, hi = int(ptr[l, c]), int(ptr[l, c + 1])
            tokens = [t for t in range(Nq) if c in want[l * Nq + t]]
            assert keys.col_query[lo:hi].tolist() == tokens
            for t, j in zip(tokens, keys.col_slot[lo:hi].tolist()):
                assert int(plan.rows[l, t, j]) == c
    assert int(ptr[-1, -1]) == sum(len(b) for b in want)


def test_selection_refuses_bad_shapes_and_types():
    with pytest.raises(TypeError, match="int32 or int64"):
        Selection(torch.zeros(1, 2, 3), 4)
    with pytest.raises(ValueError, match=r"\[B, G, Nq, K\]"):
        Selection(torch.zeros(2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="positive int"):
        Selection(torch.zeros(1, 2, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="counts must have shape"):
        Selection(torch.zeros(1, 2, 3, dtype=torch.int64), 4, torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="key block 9"):
        Selection(torch.full((1, 2, 3), 9), 4).check(seqlen_k=20)
