"""`context_parallel_attention` on per-step selections (`ContextParallelPlan.for_sequence(...).step(...)`)
over 2, 3 and 4 gloo processes, in one spawn of 4 (groups of ranks {0, 1}, {0, 1, 2} and all four):
outputs and q/k/v gradients equal single-process `block_sparse_attention` / `selection_attention`
on the unsharded tensors, for `patterns.topk` layouts and per-token selections, GQA, both causal
alignments; the network bytes counted under `IOCounter` equal the model of the steps exactly and
every rank receives that step's floor; backward is deterministic; a rank given bad input raises the
same ValueError on every rank (the group stays usable); `ContextParallelSelfAttention` with a selector
returning a per-token `Selection` equals the layer in one process (outputs and parameter gradients)."""
import datetime
import math

import torch
import torch.distributed as dist
from helpers import FP32_TOL, free_port, spawn

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns, selection_attention
from sparse_io_attn.accounting import IOCounter, TrafficReport
from sparse_io_attn.accounting.traffic import context_parallel_steps
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.distributed import ContextParallelPlan, ContextParallelSelfAttention, context_parallel_attention
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn import SparseSelfAttention

TIMEOUT_S = 120          # the process group's and the spawn's: a hung rank fails the test
WORLDS = (2, 3, 4)
#: the cases each world size runs (all of them at 2; at 3 and 4 every kind and alignment, fp32)
RUNS = {2: None, 3: ("topk-kv-causal-gqa", "topk-shared-bottom_right", "selection-gqa-causal",
                     "selection-per-query-head", "own-and-first"), 4: ("topk-kv-causal-gqa", "topk-shared-bottom_right", "topk-batch",
                                                      "selection-gqa-causal", "selection-per-query-head")}
N, BLOCK = 101, 8        # ragged: 13 blocks, the last of 5 tokens
BF16_TOL = 2e-2


def _cases():
    """``(id, source, causal, B, Hq, Hkv, num_heads_kv for the step, dtype)``."""
    R = math.ceil(N / BLOCK)
    g = torch.Generator().manual_seed(0)
    per_kv = patterns.topk(torch.randn(2, R, R, generator=g), 3, BLOCK, N, causal=True)
    shared = patterns.topk(torch.randn(R, R, generator=g), 4, BLOCK, N, causal="bottom_right")
    batch = patterns.topk(torch.randn(2, 1, R, R, generator=g), 3, BLOCK, N)
    tokens = torch.arange(N)
    sel = torch.randint(0, R, (2, N, 3), generator=g)
    sel[..., 0] = tokens // BLOCK                                       # each token's own block
    per_head = torch.randint(-1, 2 * R, (4, N, 4), generator=g)          # blocks of 4 tokens, per query head
    return [
        ("topk-kv-causal-gqa", per_kv, True, 1, 4, 2, None, torch.float32),
        ("topk-shared-bottom_right", shared, "bottom_right", 2, 2, 1, None, torch.float32),
        ("topk-batch", batch, False, 2, 2, 2, None, torch.float32),
        ("selection-gqa-causal", Selection(sel, BLOCK), True, 1, 4, 2, None, torch.float32),
        ("selection-per-query-head", Selection(per_head, BLOCK // 2), "bottom_right", 1, 4, 2, 2, torch.float32),
        ("selection-bf16", Selection(sel[:1], BLOCK), True, 1, 2, 1, None, torch.bfloat16),
        ("own-and-first", Selection(torch.stack([tokens // BLOCK, torch.zeros_like(tokens)], -1)[None], BLOCK),
         True, 1, 2, 2, None, torch.float32),                           # rank 0 receives nothing, the others block 0
    ]


def _plan(world, causal):
    return ContextParallelPlan.for_sequence(N, BLOCK, world, causal=causal,
                                            balance="zigzag" if 2 * world <= math.ceil(N / BLOCK) else "contiguous")


def _inputs(B, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, N, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv, Hq))


def _run_rank(plan, rank, source, causal, hkv, inputs, group):
    q, k, v, do = inputs
    step = plan.step(source, rank=rank, num_heads_kv=hkv)
    qs, ks, vs = (plan.shard(t, rank, 2).detach().clone().requires_grad_() for t in (q, k, v))
    with IOCounter() as io:
        out = context_parallel_attention(qs, ks, vs, step, group=group, causal=causal, backend="torch")
        out.backward(plan.shard(do, rank, 2))
    return out.detach(), qs.grad, ks.grad, vs.grad, io.network.to_dict()["kernels"]


def _bad(plan, rank, group):
    """Bad input on one rank: the message every rank raised (else what happened)."""
    sel = Selection(torch.zeros(2, N, 2, dtype=torch.long), BLOCK)
    q = plan.shard(torch.randn(1, 2, N, 8), rank, 2)
    cases = {
        "wrong-rank": lambda: plan.step(sel, rank=(rank + 1) % plan.world_size if rank == 1 else rank),
        "other-geometry": lambda: plan.step(Selection(torch.zeros(1 if rank == 2 else 2, N, 2, dtype=torch.long),
                                                      BLOCK), rank=rank),
        "short-shard": lambda: plan.step(sel, rank=rank),
        "static-plan": lambda: (ContextParallelPlan(patterns.causal(N, BLOCK), plan.world_size, causal=True)
                                if rank == 0 else plan.step(sel, rank=rank)),
    }
    out = {}
    for name, make in cases.items():
        qq = q[:, :, :-1] if name == "short-shard" and rank == 1 else q
        try:
            context_parallel_attention(qq, q, q, make(), group=group, causal=True, backend="torch")
            out[name] = "returned"
        except ValueError as exc:
            out[name] = str(exc)
    return out


class TokenSelector:
    """A per-token selector (one selection per K/V head): each query token's own key block, the first,
    and one chosen from its query's sign pattern (so the choice follows the activations)."""
    block_size = BLOCK
    causal = True

    def __call__(self, q, k):
        B, Hq, n, _ = q.shape
        own = torch.arange(n) // BLOCK
        picked = (q[0].view(k.shape[1], Hq // k.shape[1], n, -1)[:, 0, :, :4] > 0).long()
        other = (picked * torch.tensor([1, 2, 4, 8])).sum(-1) % (own + 1)            # an earlier block
        return Selection(torch.stack([own.expand_as(other), torch.zeros_like(other), other], -1), BLOCK)


def _layer():
    torch.manual_seed(5)
    return SparseSelfAttention(16, 4, selector=TokenSelector(), num_kv_heads=2, causal=True, backend="torch")


def _module_rank(rank, world, group):
    """The wrapped layer on this rank's tokens: its output and parameter gradients."""
    layer = _layer()
    plan = ContextParallelSelfAttention.plan_for(layer, N, world)
    x = plan.shard(torch.randn(2, N, 16, generator=torch.Generator().manual_seed(6)), rank, 1)
    out = ContextParallelSelfAttention(layer, plan, group=group)(x)
    out.backward(plan.shard(torch.randn(2, N, 16, generator=torch.Generator().manual_seed(7)), rank, 1))
    return out.detach(), {name: p.grad for name, p in layer.named_parameters()}


def _worker(rank: int, port: int, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=max(WORLDS),
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        groups = {w: dist.new_group(list(range(w))) if w < max(WORLDS) else None for w in WORLDS}
        results = {}
        for world in WORLDS:
            if rank >= world:
                continue
            group = groups[world]
            for i, (name, source, causal, B, Hq, Hkv, hkv, dtype) in enumerate(_cases()):
                if RUNS[world] is not None and name not in RUNS[world]:
                    continue
                plan = _plan(world, causal)
                inputs = _inputs(B, Hq, Hkv, 8, dtype, i)
                results[world, name] = _run_rank(plan, rank, source, causal, hkv, inputs, group)
                if name == "selection-gqa-causal":                    # determinism: a second run
                    results[world, name + "-rerun"] = _run_rank(plan, rank, source, causal, hkv, inputs, group)
            if world == 3:
                results["bad"] = _bad(_plan(world, True), rank, group)
            if world == 2:
                results["module"] = _module_rank(rank, world, group)
        torch.save(results, f"{path}.rank{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _report(kernels: dict) -> TrafficReport:
    rep = TrafficReport(source="counted")
    for name, kt in kernels.items():
        rep.add(name, kt["reads"], kt["writes"], kt["launches"])
    return rep


def test_steps_match_single_process(tmp_path):
    path = str(tmp_path / "steps")
    spawn(_worker, (free_port(), path), max(WORLDS), "context-parallel step workers", TIMEOUT_S)
    ranks = [torch.load(f"{path}.rank{r}") for r in range(max(WORLDS))]
    for i, (name, source, causal, B, Hq, Hkv, hkv, dtype) in enumerate(_cases()):
        q, k, v, do = _inputs(B, Hq, Hkv, 8, dtype, i)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if isinstance(source, BlockSparseLayout):
            out = block_sparse_attention(*leaves, source, causal=causal, backend="torch")
        else:
            out = selection_attention(*leaves, source, causal=causal, backend="torch", check=False)
        out.backward(do)
        single = [out.detach()] + [t.grad for t in leaves]
        tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
        for world in WORLDS:
            if RUNS[world] is not None and name not in RUNS[world]:
                continue
            plan = _plan(world, causal)
            got = [plan.unshard([ranks[r][world, name][j] for r in range(world)], 2) for j in range(4)]
            for what, g, s in zip(("out", "dq", "dk", "dv"), got, single):
                assert g.dtype == dtype and torch.isfinite(g).all(), (name, world, what)
                assert rel_err(g, s) <= tol, (name, world, what, rel_err(g, s))
            steps = [plan.step(source, rank=r, num_heads_kv=hkv) for r in range(world)]
            model = context_parallel_steps(steps, batch=B, num_heads_kv=Hkv, head_dim=8, dtype=dtype)
            assert model.recv == model.floor and any(model.recv), (name, world)
            for r in range(world):                                        # counted == predicted, bytes
                assert _report(ranks[r][world, name][4]) == model.report(r), (name, world, r)
    for world in WORLDS:                                                  # deterministic backward
        for r in range(world):
            first, again = ranks[r][world, "selection-gqa-causal"], ranks[r][world, "selection-gqa-causal-rerun"]
            for a, b in zip(first[:4], again[:4]):
                assert torch.equal(a, b), (world, r)
    layer = _layer()                    # the selector layer in one process (projections, selection_attention)
    x = torch.randn(2, N, 16, generator=torch.Generator().manual_seed(6))
    q, k, v = layer.project(x)
    out = layer.project_out(selection_attention(q, k, v, layer.selector(q, k), causal=True, backend="torch"))
    out.backward(torch.randn(2, N, 16, generator=torch.Generator().manual_seed(7)))
    plan = ContextParallelSelfAttention.plan_for(layer, N, 2)
    assert rel_err(plan.unshard([ranks[r]["module"][0] for r in range(2)], 1), out.detach()) <= FP32_TOL
    for name, p in layer.named_parameters():     # gradients summed over the ranks (k_proj.bias's is 0: absolute)
        got = ranks[0]["module"][1][name] + ranks[1]["module"][1][name]
        assert (got - p.grad).abs().max() <= FP32_TOL * max(1.0, float(p.grad.abs().max())), name
    bad = [ranks[r]["bad"] for r in range(3)]
    expected = {"wrong-rank": "rank 1 refused its inputs: the step was built for rank 2",
                "other-geometry": "ranks disagree: rank 2 has step digest 0x",
                "short-shard": "rank 1 refused its inputs: q_local has",
                "static-plan": "ranks disagree: rank 1 has plan layout digest 0x"}
    for case, text in expected.items():
        messages = {b[case] for b in bad}
        assert len(messages) == 1, (case, messages)                      # the same error on every rank
        message = messages.pop()
        assert text in message and "no rank started the exchange" in message, (case, message)
