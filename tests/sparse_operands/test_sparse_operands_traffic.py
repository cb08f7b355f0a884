"""The paper kernels' traffic model at sizes the interpreter cannot run (it equals the counters
exactly: test_sparse_operands_attention.py; Theorem 4.5 against it: tests/experiments/test_sparsity_stress.py),
the multiply-add model, plan caching."""
import torch

from sparse_io_attn import sparse_operands
from sparse_io_attn.sparse_operands import plan as plan_mod
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix


def test_dense_and_fully_stored_operands_move_the_same_bytes():
    g = torch.Generator().manual_seed(1)
    n, d, b = 256, 64, 16
    A1, A2, A3, X, Y = (torch.randn(s, generator=g) for s in ((n, d), (n, d), (n, d), (d, d), (d, d)))
    full = lambda t, blk: BlockSparseMatrix.from_dense(t, blk)  # noqa: E731
    qk_free = sparse_operands.predict_traffic(full(A1, (64, b)), full(A2, (64, b)), A3, full(X, (b, b)), Y)
    dense = sparse_operands.predict_traffic(A1, A2, A3, X, Y)  # dense: tiles 64 (n) and 64 (d): other d tiles
    assert qk_free.source == dense.source == "predicted"
    same_tiles = sparse_operands.predict_traffic(A1, A2, A3, full(X, (b, b)), Y)  # X fixes the d tiles at 16
    # the attention kernels move the same bytes; the A1 X product re-reads differ only by tile shape
    for k in ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "paper_attn_bwd_preprocess"):
        assert qk_free.kernels[k]._key()[1:] == same_tiles.kernels[k]._key()[1:], k
    assert dense.kernels["paper_attn_fwd"].reads["a2"] == qk_free.kernels["paper_attn_fwd"].reads["a2"]


def test_dense_forward_matches_closed_form():
    """All dense, n a multiple of the blocks: every query block reads all of A2 and h once."""
    n, d, dv, bm = 512, 64, 32, 64
    t = lambda *s: torch.randn(*s)  # noqa: E731
    rep = sparse_operands.predict_traffic(t(n, d), t(n, d), t(n, dv), t(d, d), t(dv, dv), backward=False)
    fwd = rep.kernels["paper_attn_fwd"]
    nqb = n // bm
    assert fwd.reads["q"] == 4 * n * d and fwd.reads["a2"] == 4 * nqb * n * d and fwd.reads["h"] == 4 * nqb * n * dv
    assert fwd.writes == {"o": 4 * n * dv, "lse": 4 * n}
    assert fwd.reads.get("hsum", 0) == 0  # no structurally zero block
    q = rep.kernels["paper_q"]  # Q = A1 X by row panels: A1 read once, all of X once per query block
    assert q.reads["a1"] == 4 * n * d and q.reads["x"] == 4 * d * d * nqb and q.writes["q"] == 4 * n * d


def test_plans_are_computed_once_and_cached(monkeypatch):
    """On a fresh cache (whatever earlier tests planned on this worker): the first prediction builds
    every plan, the second builds none and returns the same objects."""
    cache = plan_mod.PlanCache()
    monkeypatch.setattr(plan_mod, "CACHE", cache)
    g = torch.Generator().manual_seed(2)
    A1, A2 = (BlockSparseMatrix.random(torch.rand(4, 2, generator=g) < 0.7, (32, 16), generator=g) for _ in range(2))
    X = BlockSparseMatrix.random(torch.rand(2, 2, generator=g) < 0.7, 16, generator=g)
    A3, Y = torch.randn(128, 32, generator=g), torch.randn(32, 32, generator=g)
    qk = BlockSparseLayout.from_block_mask(torch.rand(4, 4, generator=g) < 0.5, 32, (128, 128))
    sparse_operands.predict_traffic(A1, A2, A3, X, Y, qk_layout=qk)
    assert {k[0] for k in cache.entries} == {"product", "attention"}
    assert cache.misses == len(cache.entries)
    first, lookups = dict(cache.entries), cache.misses + cache.hits
    sparse_operands.predict_traffic(A1, A2, A3, X, Y, qk_layout=qk)
    assert cache.misses == len(first) and cache.hits == lookups + (lookups - len(first))
    assert cache.entries.keys() == first.keys()
    assert all(cache.entries[k] is v for k, v in first.items())


def test_product_plan_lists_exactly_the_structural_pairs():
    """Row panel i lists k iff A[i, k] is stored and B[k, :] meets C[i, :] (C here: a pattern that
    is not the structural product, as for a masked gradient)."""
    g = torch.Generator().manual_seed(7)
    a = torch.rand(5, 4, generator=g) < 0.5
    b = torch.rand(4, 3, generator=g) < 0.5
    c = torch.rand(5, 3, generator=g) < 0.5

    def tile_ids(m):
        t = torch.full(m.shape, -1, dtype=torch.int32)
        t[m] = torch.arange(int(m.sum()), dtype=torch.int32)
        return t

    amap = tile_ids(a)
    p = plan_mod.product_plan(amap, tile_ids(b), tile_ids(c))
    assert p.num_rows == 5
    for i in range(5):
        ks = [int(k) for k in p.pair_k[p.pair_ptr[i]:p.pair_ptr[i + 1]]]
        assert ks == [k for k in range(4) if a[i, k] and (b[k] & c[i]).any()], i
        assert [int(t) for t in p.pair_a[p.pair_ptr[i]:p.pair_ptr[i + 1]]] == [int(amap[i, k]) for k in ks]
    sp = plan_mod.structural_product(a, b)
    assert torch.equal(sp, (a.double() @ b.double()) > 0)


def test_dot_mac_model_closed_forms():
    """Dense: every kept block multiplies all d-tiles. X with its last column tile removed: Q has
    that tile nowhere, so every score product loses exactly one of its 4 tile products."""
    g = torch.Generator().manual_seed(5)
    n, d, dv, bm, bd = 256, 64, 32, 64, 16
    A1, A2, A3, X, Y = (torch.randn(s, generator=g) for s in ((n, d), (n, d), (n, d), (d, d), (d, dv)))
    nb, nt, tile, pv = n // bm, d // bd, bm * bm * bd, bm * bm * dv
    dense = sparse_operands.predict_dot_macs(A1, A2, A3, BlockSparseMatrix.from_dense(X, (bd, bd)), Y)
    assert {k: dense[k] for k in ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq")} == {
            "paper_attn_fwd": nb * nb * (nt * tile + pv),
            "paper_attn_bwd_dkv": nb * nb * (2 * nt * tile + 2 * pv),
            "paper_attn_bwd_dq": nb * nb * (2 * nt * tile + pv)}
    Xs = X.clone()
    Xs[:, -bd:] = 0
    sparse = sparse_operands.predict_dot_macs(A1, A2, A3, BlockSparseMatrix.from_dense(Xs, (bd, bd)), Y)
    assert sparse["paper_attn_fwd"] == dense["paper_attn_fwd"] - nb * nb * tile
    assert sparse["paper_attn_bwd_dkv"] == dense["paper_attn_bwd_dkv"] - 2 * nb * nb * tile
    assert sparse["paper_attn_bwd_dq"] == dense["paper_attn_bwd_dq"] - 2 * nb * nb * tile
    # Q = A1 X: one program per query block, per pair (i, k) a [bm, bd] x [bd, bd] product per column
    # tile of X's row k stored in Q's row i: 4 tiles dense, 3 without the last column tile
    assert dense["paper_q"] == nb * nt * nt * bm * bd * bd
    assert sparse["paper_q"] == nb * nt * (nt - 1) * bm * bd * bd
