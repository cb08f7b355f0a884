"""`ContextParallelPlan` without processes: balance, the send sets and the per-rank layouts against
brute force over the dense element mask, shard/unshard, the traffic model, the row-statistics merge
and a one-rank `context_parallel_attention`."""
import pytest
import torch
from helpers import FP32_TOL, make_layout

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn.accounting import traffic
from sparse_io_attn.block_sparse import torch_path
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.distributed import (ContextParallelPlan, causal_layout, context_parallel,
                                        context_parallel_attention, merge_partials)
from sparse_io_attn.layout import stack_layouts


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


@pytest.mark.parametrize("world, balance", [(1, "work"), (2, "contiguous"), (3, "zigzag"), (5, "lpt"), (3, "work")])
def test_send_blocks_and_rank_layouts_match_brute_force(world, balance):
    n, b = 117, 8                                                        # ragged last block
    for name, (layout, causal) in _layouts(n, b).items():
        plan = ContextParallelPlan(layout, world, causal=causal, balance=balance)
        dense = _dense(plan)
        assert plan.layout.equal(BlockSparseLayout.from_dense_mask(
            dense.view(layout.layout_batch, layout.layout_heads, n, n), b)), name
        owned = [plan.token_index(r) for r in range(world)]
        assert torch.equal(torch.sort(torch.cat(owned)).values, torch.arange(n)), name
        for dst in range(world):
            rows = plan.rows(dst)
            assert torch.equal(rows, _blocks_of(owned[dst], b)), name
            read = dense[:, owned[dst]].any(0).any(0).nonzero().squeeze(1)   # key tokens dst's rows read
            for src in range(world):
                want = _blocks_of(read[torch.isin(read, owned[src])], b) if src != dst else torch.zeros(0)
                assert torch.equal(plan.send_blocks(src, dst), want.long()), (name, src, dst)
            lay = plan.rank_layouts(dst)
            assert torch.equal(lay.local.to_dense_mask().flatten(0, 1), dense[:, owned[dst]][:, :, owned[dst]]), name
            recv = plan.recv_blocks(dst)
            if recv.numel():
                keys = torch.cat([torch.arange(int(c) * b, min(int(c) * b + b, n)) for c in recv])
                assert torch.equal(lay.received.to_dense_mask().flatten(0, 1), dense[:, owned[dst]][:, :, keys]), name
            else:
                assert lay.received is None
        model = context_parallel(plan, batch=2, num_heads_kv=3, head_dim=16, dtype=torch.float32)
        assert model.recv == model.floor and sum(model.send) == sum(model.recv), name


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
        work = torch.zeros(world, dtype=torch.int64).index_add_(0, plan.owner, plan.row_work)
        assert torch.equal(plan.work, work)
        assert plan.imbalance == pytest.approx(float(work.max()) / float(work.float().mean()))
        assert plan.imbalance <= 1.05, (name, plan)


def test_whole_rows_bound_the_balance():
    """A row heavier than the mean rank (BigBird's global query rows at many ranks) sets the imbalance:
    rows are not split, so max / mean >= that row's work / mean; the plan reaches that bound."""
    b, world = 8, 32
    plan = ContextParallelPlan(patterns.bigbird(16 * world * b, b), world)
    bound = float(plan.row_work.max()) / float(plan.work.float().mean())
    assert bound > 1.05 and plan.imbalance == pytest.approx(bound)


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
    plan = ContextParallelPlan(patterns.dense(20, 8), 2, balance="contiguous")
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
    kw = dict(causal_offset=None, sm_scale=D ** -0.5, layout_strides=(0, 0))
    o1, _, s1 = torch_path.forward(q, k[:, :, :24], v[:, :, :24], one, **kw)
    o2, _, s2 = torch_path.forward(q, k[:, :, 24:], v[:, :, 24:], two, **kw)
    out, lse, stats = merge_partials(o1, s1, o2, s2)
    ref, ref_lse, ref_stats = torch_path.forward(q, k, v, full, **kw)
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
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).unshard([torch.zeros(16)], 0), "list of 2 shards"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).shard(torch.zeros(30), 0, 0), "plan shards 32"),
    (lambda: ContextParallelPlan(patterns.dense(32, 8), 2).send_blocks(0, 2), r"dst must be an int in \[0, 2\)"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 31, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 1)),
     r"plan.shard\(x, 0, dim=2\)"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 32, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 2)),
     "built for 2"),
    (lambda: context_parallel_attention(*(torch.zeros(1, 1, 32, 8),) * 3, ContextParallelPlan(patterns.dense(32, 8), 1),
                                        causal=True), "plan was built with causal=False"),
])
def test_bad_input_names_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
