"""Row-range pattern builders (``rows=(start, stop)``): the layout of query positions ``[start,
stop)`` against every key, equal to the whole layout's ``.rows(start, stop)`` and built from those
rows alone (what a decode step with a KV cache needs)."""
from __future__ import annotations

import random as pyrandom

import pytest
import torch

from sparse_io_attn import patterns
from sparse_io_attn.layout.patterns import _grid, builders

# every pattern of the registry, with its flags and the spec aliases (positional, key=value, lists)
SPECS = ["dense", "dense:causal", "causal", "sliding_window:5", "sliding_window:3,causal", "sliding_window:0",
         "sliding_window", "strided:4", "strided:13", "strided:13,causal", "strided:2,causal", "strided",
         "fixed:8,2", "fixed:8,2,causal", "fixed:5,5", "fixed:16,4,causal", "fixed",
         "longformer:window=3,global=2", "longformer:window=2,global=1/9/20,causal", "longformer",
         "bigbird:window=3,global=1,random=2", "bigbird:window=2,global=2,random=1,heads=3,causal", "bigbird",
         "random:0.3", "random:0.4,causal,heads=2,seed=5", "document:3", "document:lengths=5/0/9/30,causal",
         "prefix_lm:7", "prefix_lm"]
BLOCKS = [4, (4, 8), (8, 4), 3, (2, 5), 16]


def _cases(spec: str, seed: int, count: int):
    """``count`` random (block_size, (seqlen_q, seqlen_k), (start, stop)) cases: ragged lengths,
    ``seqlen_q != seqlen_k`` for the patterns that allow it, q in {1, 3, 16} or any."""
    rng = pyrandom.Random(f"{spec}/{seed}")
    for _ in range(count):
        bs = rng.choice(BLOCKS)
        if spec.startswith("document:lengths"):
            nq = nk = 44
        else:
            nq = rng.randint(1, 60)
            nk = nq if spec.startswith("document") or rng.random() < 0.5 else rng.randint(1, 60)
        q = min(nq, rng.choice([1, 3, 16, rng.randint(1, nq)]))
        start = rng.randint(0, nq - q)
        yield bs, (nq, nk), (start, start + q)


@pytest.mark.parametrize("spec", SPECS)
def test_rows_equal_the_whole_layouts_rows(spec):
    checked = 0
    for bs, seqlen, (start, stop) in _cases(spec, 0, 14):
        try:
            whole = patterns.from_spec(spec, seqlen, bs)
        except ValueError:      # e.g. more documents than positions: nothing to compare
            continue
        got = patterns.from_spec(spec, seqlen, bs, rows=(start, stop))
        want = whole.rows(start, stop)
        assert got.seqlen == (stop - start, seqlen[1])
        assert got.equal(want), (spec, bs, seqlen, (start, stop), got, want)
        checked += 1
    assert checked >= 10


def test_decode_rows_at_the_end_and_every_row_one_by_one():
    """The bottom-right rows a decode step asks for, and every single row of a ragged grid."""
    for spec in ("sliding_window:6,causal", "longformer:window=4,global=2", "strided:10", "fixed:12,3"):
        n = 37
        whole = patterns.from_spec(spec, n, (8, 4))
        for p in range(n):
            assert patterns.from_spec(spec, n, (8, 4), rows=(p, p + 1)).equal(whole.rows(p, p + 1)), (spec, p)


def test_rows_are_refused_with_the_accepted_form():
    for bad in [(3, 3), (-1, 2), (0, 11), (2,), "0:3", (0.0, 2), (True, 2)]:
        with pytest.raises(ValueError, match=r"rows must be a pair of ints \(start, stop\) with 0 <= start < stop "
                                              r"<= seqlen_q = 10"):
            patterns.sliding_window(10, 4, window=2, rows=bad)
    with pytest.raises(ValueError, match="unknown parameter"):
        patterns.get("sliding_window", 10, 4, window=2, row=(0, 1))
    assert patterns.get("sliding_window", 10, 4, window=2, rows=None).equal(patterns.sliding_window(10, 4, window=2))


def _count_work(monkeypatch):
    """Make the whole-grid routes fail and record the largest candidate count a builder asks for."""
    asked = []
    real = _grid._check_size

    def check_size(n):
        asked.append(n)
        return real(n)

    def no_cols(self):
        raise AssertionError("listed every key block (O(seqlen_k))")

    monkeypatch.setattr(_grid, "_check_size", check_size)
    monkeypatch.setattr(builders, "_check_size", check_size)
    monkeypatch.setattr(_grid._Grid, "cols", no_cols)
    return asked


@pytest.mark.parametrize("spec,most", [("sliding_window:256,causal", 6), ("sliding_window:256", 6),
                                       ("longformer:window=256,global=2", 8)])
def test_decode_step_at_a_million_keys_touches_only_the_window(monkeypatch, spec, most):
    """One query row against 2**20 keys: no whole-grid listing (``_Grid.cols`` would be O(seqlen_k),
    the square layout O(seqlen^2 / blocks)), at most a few candidate blocks."""
    N = 1 << 20
    asked = _count_work(monkeypatch)
    layout = patterns.from_spec(spec, N, 64, rows=(N - 1, N))
    assert layout.seqlen == (1, N) and layout.nnz_blocks <= most
    assert asked and max(asked) <= most
    monkeypatch.undo()
    # the same blocks as a brute-force count: keys within 256 of the last query (and the global ones)
    window = torch.arange(N - 1 - 256, N if "causal" in spec else N + 256).clamp(max=N - 1)
    want = set((window // 64).tolist()) | ({0} if spec.startswith("longformer") else set())
    _, _, c = layout.entries()
    assert set(c.tolist()) == want
