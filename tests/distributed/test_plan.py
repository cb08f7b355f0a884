"""`ContextParallelPlan` without processes: balance, the send sets and the per-rank layouts against
brute force over the dense element mask, shard/unshard, the traffic model, the row-statistics merge
and a one-rank `context_parallel_attention`."""
import pytest
import torch
from helpers import FP32_TOL, make_layout

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn import plan as attention_plan
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse import torch_path
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.accounting.traffic import context_parallel
from sparse_io_attn.distributed import (ContextParallelPlan, causal_layout, context_parallel_attention,
                                        merge_partials)
from sparse_io_attn.distributed.plan import layout_digest
from sparse_io_attn.layout import stack_layouts
from sparse_io_attn.tally import count_network


def _dense(plan: ContextParallelPlan) -> torch.Tensor:
    """The plan's element mask ``[L, N, N]`` from the source layout (causal applied here, densely)."""
    m = plan.source_layout.to_dense_mask().flatten(0, 1)
    if plan.causal:
        m = m & torch.ones(plan.seqlen, plan.seqlen, dtype=torch.bool).tril()
    return m


def _blocks_of(tokens: torch.Tensor, b: int) -> torch.Tensor:
    return torch.unique(tokens // b)


def _layouts(n, b):
    docs = [0, 5, 40, 41, 90, n]
    return {
        "sliding_window": (patterns.sliding_window(n, b, 2 * b), False),
        "causal": (patterns.dense(n, b), True),
        "documents": (patterns.document(docs, b), True),
        "bigbird-per-head": (patterns.bigbird(n, b, num_heads=3, seed=2), False),
        "per-head-per-batch": (make_layout(2, 2, n, n, b, density=0.3, per_head=True, per_batch=True), False),
        "stacked": (stack_layouts([patterns.causal(n, b), patterns.document(docs, b)]), "bottom_right"),
    }


def _tokens_of(blocks: torch.Tensor, b: int, n: int) -> torch.Tensor:
    return torch.cat([torch.arange(int(c) * b, min(int(c) * b + b, n)) for c in blocks] + [torch.zeros(0, dtype=torch.long)])


@pytest.mark.parametrize("world, balance", [(1, "work"), (2, "contiguous"), (3, "zigzag"), (5, "lpt"), (4, "work")])
def test_send_sets_and_rank_layouts_match_brute_force(world, balance):
    n, b = 117, 8                                                        # ragged last block
    for name, (layout, causal) in _layouts(n, b).items():
        plan = ContextParallelPlan(layout, world, causal=causal, balance=balance)
        dense = _dense(plan)
        assert plan.layout.equal(BlockSparseLayout.from_dense_mask(
            dense.view(layout.layout_batch, layout.layout_heads, n, n), b)), name
        total = int(plan.row_work.sum())
        assert torch.equal(plan.spread, plan.row_work * world > 0.5 * total if world > 1 else plan.spread & False)
        spread_tok = plan.spread[torch.arange(n) // b]                   # token of a spread row
        owned = [plan.token_index(r) for r in range(world)]
        assert torch.equal(torch.sort(torch.cat(owned)).values, torch.arange(n)), name
        for dst in range(world):
            assert torch.equal(plan.rows(dst), _blocks_of(owned[dst], b)), name
            rows_kv = owned[dst][~spread_tok[owned[dst]]]                 # rows that receive K/V
            read = dense[:, rows_kv].any(0).any(0).nonzero().squeeze(1)  # key tokens those rows read
            for src in range(world):
                want = _blocks_of(read[torch.isin(read, owned[src])], b) if src != dst else torch.zeros(0)
                assert torch.equal(plan.send_blocks(src, dst), want.long()), (name, src, dst)
                mine = owned[src][spread_tok[owned[src]]]                # src's spread rows reading dst's keys
                hit = dense[:, mine][:, :, owned[dst]].any(0).any(1)
                want_q = _blocks_of(mine[hit], b) if src != dst else torch.zeros(0)
                assert torch.equal(plan.send_queries(src, dst), want_q.long()), (name, src, dst)
            lay = plan.rank_layouts(dst)
            rows = dense[:, owned[dst]]
            assert torch.equal(lay.local.to_dense_mask().flatten(0, 1), rows[:, :, owned[dst]]), name
            keys = _tokens_of(plan.recv_blocks(dst), b, n)
            if keys.numel():
                want = rows[:, :, keys] & ~spread_tok[owned[dst]][None, :, None]
                assert torch.equal(lay.received.to_dense_mask().flatten(0, 1), want), name
            else:
                assert lay.received is None
            queries = _tokens_of(plan.recv_queries(dst), b, n)
            if queries.numel():
                assert torch.equal(lay.foreign.to_dense_mask().flatten(0, 1), dense[:, queries][:, :, owned[dst]]), name
            else:
                assert lay.foreign is None
        model = context_parallel(plan, batch=2, num_heads_kv=3, head_dim=16, dtype=torch.float32)
        assert model.recv == model.floor and sum(model.send) == sum(model.recv), name
        assert sum(model.q_send) == sum(model.q_recv), name


@pytest.mark.parametrize("world", [4, 8])
def test_balance_at_16_blocks_per_rank(world):
    b = 8
    n = 16 * world * b + 5
    cases = {"sliding_window": (patterns.sliding_window(n, b, 4 * b), False),
             "causal": (patterns.dense(n, b), True),
             "causal-layout": (patterns.causal(n, b), False),
             "documents": (patterns.document([0, 100, 131, n // 2, n // 2 + 9, n], b, causal=True), False),
             "bigbird": (patterns.bigbird(n, b), False)}
    for name, (layout, causal) in cases.items():
        plan = ContextParallelPlan(layout, world, causal=causal)
        _, r, c = plan.layout.entries()
        cost = torch.where(plan.layout.partial_ids >= 0, 5, 4).long()
        at = torch.where(plan.spread[r], c, r)                           # spread rows: work where the keys live
        work = torch.zeros(world, dtype=torch.int64).index_add_(0, plan.owner[at], cost)
        assert torch.equal(plan.work, work)
        assert plan.imbalance == pytest.approx(float(work.max()) / float(work.float().mean()))
        assert plan.imbalance <= 1.05, (name, plan)


@pytest.mark.parametrize("world", [16, 32])
def test_global_rows_are_spread(world):
    """BigBird's global query rows outweigh a rank's mean work at many ranks: kept whole
    (``split_rows=False``) they set the imbalance (max / mean >= their work / mean); spread over the
    owners of their keys the plan balances, and their owner receives no K/V for them."""
    b = 8
    layout = patterns.bigbird(16 * world * b, b)
    whole = ContextParallelPlan(layout, world, split_rows=False)
    bound = float(whole.row_work.max()) / float(whole.work.float().mean())
    assert bound > 1.05 and whole.imbalance == pytest.approx(bound) and not whole.spread.any()
    plan = ContextParallelPlan(layout, world)
    assert plan.spread.sum() == 2 and plan.imbalance <= 1.05, plan
    m_whole = context_parallel(whole, batch=1, num_heads_kv=1, head_dim=8)
    m = context_parallel(plan, batch=1, num_heads_kv=1, head_dim=8)
    assert max(m.recv) < max(m_whole.recv) / 4


def test_shard_unshard_round_trip_and_views():
    layout = patterns.causal(101, 8)
    for balance in ("contiguous", "zigzag"):
        plan = ContextParallelPlan(layout, 3, balance=balance)
        x = torch.randn(2, 101, 3, requires_grad=True)
        shards = [plan.shard(x, r, 1) for r in range(3)]
        assert [s.shape[1] for s in shards] == [plan.num_tokens(r) for r in range(3)]
        back = plan.unshard(shards, -2)
        assert torch.equal(back, x)
        back.sum().backward()                                             # differentiable
        assert torch.equal(x.grad, torch.ones_like(x))
        if balance == "contiguous":
            assert shards[1]._base is x                                   # one range: a view


def test_traffic_model_bytes():
    """Dense layout, 20 tokens in blocks of 8 (the last holds 4), 2 ranks, K/V [2, 3, 20, 16] fp32."""
    plan = ContextParallelPlan(patterns.dense(20, 8), 2, balance="contiguous", split_rows=False)
    token = 16 * 4 * 2 * 2 * 3                                           # head_dim, fp32, k and v, B, Hkv
    n = [plan.num_tokens(r) for r in range(2)]
    model = traffic.context_parallel(plan, batch=2, num_heads_kv=3, head_dim=16, dtype=torch.float32)
    assert sorted(n) == [4, 16]                                          # 12 work per row: cut 2 + 1
    assert model.recv == tuple(token * (20 - k) for k in n) == model.floor == model.all_gather
    assert model.send == tuple(reversed(model.recv))
    assert model.ring == (token * 16,) * 2
    rep = model.report(0)
    assert rep.per_tensor()["k"] == (model.recv[0] // 2, model.send[0] // 2)
    assert rep.per_tensor()["dv"] == (model.send[0] // 2, model.recv[0] // 2)
    # every row is a third of the work (> half a rank's mean): all spread, queries move instead of K/V
    plan = ContextParallelPlan(patterns.dense(20, 8), 2, balance="contiguous")
    assert plan.spread.all() and plan.spreads
    model = traffic.context_parallel(plan, batch=2, num_heads_kv=3, head_dim=16, dtype=torch.float32, num_heads_q=6)
    q_token = 16 * 4 * 2 * 6
    assert model.recv == (0, 0) and model.q_send == tuple(q_token * k for k in n)
    rep = model.report(0).per_tensor()
    assert rep["q"] == (q_token * n[1], q_token * n[0]) and rep["dq"] == (q_token * n[0], q_token * n[1])
    assert rep["o"] == (n[0] * 16 * 4 * 12 + n[1] * 16 * 4 * 12,) * 2     # partials back, backward's out
    assert rep["stats"] == ((n[0] + n[1]) * 2 * 4 * 12,) * 2


def test_merge_partials_equals_attention_over_the_union():
    """Keys split in two (empty rows in one part, in both): the merge gives the whole softmax."""
    B, H, N, D, b = 1, 2, 40, 8, 8
    mask = torch.rand(N, N) < 0.5
    mask[:8] = False                                                      # rows empty in both parts
    cols = torch.arange(N) >= 24
    mask[8:16, 24:] = False                                               # rows empty in the second part
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    full = BlockSparseLayout.from_dense_mask(mask, b)
    one = BlockSparseLayout.from_dense_mask(mask[:, ~cols], b)
    two = BlockSparseLayout.from_dense_mask(mask[:, cols], b)
    kw = dict(sm_scale=D ** -0.5)
    o1, _, s1 = torch_path.forward(q, k[:, :, :24], v[:, :, :24], attention_plan(one), **kw)
    o2, _, s2 = torch_path.forward(q, k[:, :, 24:], v[:, :, 24:], attention_plan(two), **kw)
    out, lse, stats = merge_partials(o1, s1, o2, s2)
    ref, ref_lse, ref_stats = torch_path.forward(q, k, v, attention_plan(full), **kw)
    assert rel_err(out, ref) <= FP32_TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert rel_err(lse[fin], ref_lse[fin]) <= FP32_TOL
    assert torch.equal(stats[0] == float("inf"), ref_stats[0] == float("inf"))
    assert torch.isfinite(out).all() and (out[:, :, :8] == 0).all()


def test_one_rank_without_torch_distributed():
    layout = patterns.document([0, 30, 70], 8, causal=True)
    plan = ContextParallelPlan(layout, 1)
    q, k, v, do = (torch.randn(1, 2, 70, 16, requires_grad=i < 3) for i in range(4))
    out = context_parallel_attention(q, k, v, plan, backend="torch")
    ref = block_sparse_attention(q, k, v, layout, backend="torch")
    assert rel_err(out, ref) <= FP32_TOL
    g = torch.autograd.grad(out, (q, k, v), do)
    g_ref = torch.autograd.grad(ref, (q, k, v), do)
    for a, r in zip(g, g_ref):
        assert rel_err(a, r) <= FP32_TOL


def test_causal_layout_is_the_intersection():
    layout = patterns.bigbird(93, 8, num_heads=2, seed=5)
    assert causal_layout(layout).equal(layout & patterns.causal(93, 8))


@pytest.mark.parametrize("bad, match", [
    (lambda: ContextParallelPlan(BlockSparseLayout.from_block_mask(torch.ones(4, 2, dtype=torch.bool), (8, 16)), 2),
     "BLOCK_SIZE_Q must equal BLOCK_SIZE_KV"),
    (lambda: ContextParallelPlan(patterns.dense((32, 48), 8), 2), "seqlen_q must equal seqlen_k"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 5), "4 block rows for 5 ranks"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2, balance="even"), "balance must be one of"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 3, balance="zigzag"), "at least 2 \\* world_size = 6 blocks"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).unshard([torch.zeros(16)], 0), "list of 2 shards"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).shard(torch.zeros(30), 0, 0), "plan shards 32"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).send_blocks(0, 2), r"dst must be an int in \[0, 2\)"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 31, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 1)),
     r"plan.shard\(x, 0, dim=2\)"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 32, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 2)),
     "built for 2"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 32, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 1),
                                        causal=True), "plan was built with causal=False"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 2, 32, 8),) * 3,
                                        ContextParallelPlan(patterns.bigbird(32, 8, num_heads=3), 1)),
     "layout has 3 head masks but q has 2 heads"),
])
def test_bad_input_names_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_count_network_adds_to_every_active_counter():
    """The network level: collectives add to ``io.network`` of every active counter (nested too),
    kernel counts stay empty, ``reset`` clears it, nothing is recorded outside a counter."""
    count_network("outside", {"k": 1}, {"k": 2})
    with IOCounter() as outer:
        with IOCounter() as inner:
            count_network("exchange", {"k": 10, "v": 10}, {"k": 3, "v": 3})
        count_network("exchange", {"k": 1}, {"k": 0})
    assert inner.network.per_tensor() == {"k": (3, 10), "v": (3, 10)}
    assert outer.network.per_tensor() == {"k": (3, 11), "v": (3, 10)}
    assert outer.network.kernels["exchange"].launches == 2 and "outside" not in outer.network.kernels
    assert outer.report.total_bytes == 0
    outer.reset()
    assert outer.network.total_bytes == 0


def test_plan_detects_a_layout_edited_in_place():
    """The plan keeps its own copy of the layout (a later in-place edit never reaches its views);
    ``check_source`` (which the attention runs) refuses an edit that changed the contents and accepts
    a refill with the same ones."""
    n, b = 48, 8
    layout = patterns.topk(torch.randn(6, 6), 2, b, n)
    plan, single = ContextParallelPlan(layout, 2), ContextParallelPlan(layout, 1)
    before = [plan.rank_layouts(r).local for r in range(2)]
    original = BlockSparseLayout.from_block_mask(layout.to_block_mask(), b, n)
    layout.col_slots.copy_(layout.col_slots.clone())                      # version moves, contents do not
    assert plan.check_source() is plan
    refill = patterns.topk(torch.randn(6, 6), 2, b, n)
    while refill.equal(layout):
        refill = patterns.topk(torch.randn(6, 6), 2, b, n)
    layout.crow_indices.copy_(refill.crow_indices)
    layout.col_slots.copy_(refill.col_slots)
    with pytest.raises(ValueError, match="edited in place after ContextParallelPlan was built"):
        plan.check_source()
    q = torch.randn(1, 1, n, 8)
    with pytest.raises(ValueError, match=r"rebuild the plan: ContextParallelPlan\(layout, 1"):
        context_parallel_attention(q, q, q, single, backend="torch")
    assert plan.layout.equal(original) and not plan.layout.equal(layout)
    assert [plan.rank_layouts(r).local for r in range(2)] == before
    rebuilt = ContextParallelPlan(layout, 1)
    out = context_parallel_attention(q, q, q, rebuilt, backend="torch")
    assert rel_err(out, block_sparse_attention(q, q, q, layout, backend="torch")) <= FP32_TOL


def test_digest_follows_contents_and_assignment():
    """Equal layouts (however stored) give equal digests; another layout, causality, world size or
    balance gives another plan digest."""
    n, b = 61, 8
    window = patterns.sliding_window(n, b, 12)
    same = BlockSparseLayout.from_dense_mask(window.to_dense_mask(), b)
    assert layout_digest(same) == layout_digest(window)
    assert layout_digest(patterns.sliding_window(n, b, 13)) != layout_digest(window)
    digests = {ContextParallelPlan(lay, w, causal=c, balance=bal).digest
               for lay, w, c, bal in ((window, 2, False, "contiguous"), (same, 2, False, "contiguous"))}
    assert len(digests) == 1
    others = [ContextParallelPlan(window, 2, causal=True, balance="contiguous"),
              ContextParallelPlan(window, 3, balance="contiguous"),
              ContextParallelPlan(window, 2, balance="lpt"),
              ContextParallelPlan(patterns.sliding_window(n, b, 13), 2, balance="contiguous")]
    assert len({p.digest for p in others} | digests) == 5


def test_unshard_names_a_shard_that_is_not_a_tensor():
    plan = ContextParallelPlan(patterns.dense(32, 8), 3)
    with pytest.raises(TypeError, match="one tensor per rank .* got list for shard 0"):
        plan.unshard([[1.0]] * 3, 2)
