"""`context_parallel_attention` on 2, 3 and 4 gloo CPU processes (one spawn per world size running
every case; at 3 and 4 ranks some rows are spread: their queries travel instead of K/V): outputs
and q/k/v gradients equal single-process `block_sparse_attention` on the unsharded tensors (and the
float64 reference), the network bytes counted under `IOCounter` equal the model exactly, backward
is deterministic, and bad input raises a clear ValueError on every rank."""
import datetime

import pytest
import torch
import torch.distributed as dist
from helpers import FP32_TOL, free_port, spawn

from sparse_io_attn import block_sparse_attention, patterns
from sparse_io_attn.accounting import IOCounter, TrafficReport
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.accounting.traffic import context_parallel
from sparse_io_attn.distributed import ContextParallelPlan, context_parallel_attention
from sparse_io_attn.layout import stack_layouts

TIMEOUT_S = 120  # a hung rank fails the test instead of blocking the suite
BACKEND = "torch"
BF16_TOL = 2e-2


def _cases():
    """``(id, layout, causal, B, Hq, Hkv, D, dtype)``: small, ragged lengths (not a multiple of the block)."""
    n, b = 101, 8
    docs = [0, 13, 40, 41, 77, 101]                                     # documents cross rank boundaries
    per_head = stack_layouts([patterns.sliding_window(n, b, 9), patterns.causal(n, b),
                              patterns.bigbird(n, b, seed=3), patterns.document(docs, b)])
    return [
        ("sliding_window", patterns.sliding_window(n, b, 12), False, 2, 2, 2, 16, torch.float32),
        ("causal-gqa", patterns.dense(n, b), True, 1, 4, 2, 16, torch.float32),
        ("causal-bottom_right", patterns.sliding_window(n, b, 30), "bottom_right", 1, 2, 1, 8, torch.float32),
        ("documents-causal", patterns.document(docs, b, causal=True), False, 1, 2, 2, 16, torch.float32),
        ("documents", patterns.document(docs, b), True, 2, 2, 1, 8, torch.float32),
        ("bigbird-per-head", patterns.bigbird(n, b, num_heads=2, seed=1), False, 1, 2, 1, 16, torch.float32),
        ("per-head-gqa", per_head, False, 1, 4, 2, 8, torch.float32),
        ("longformer-global-gqa", patterns.longformer(n, b, 4, [0, 50]), False, 1, 4, 2, 8, torch.float32),
        ("longformer-bf16", patterns.longformer(n, b, 4, [0, 50]), False, 1, 2, 2, 16, torch.bfloat16),
        ("sliding_window-causal-bf16", patterns.sliding_window(n, b, 20), True, 1, 2, 2, 16, torch.bfloat16),
    ]


def _run_rank(plan, rank, q, k, v, do, causal, group=None):
    """One rank: shard, forward + backward under a counter; ``(out, dq, dk, dv, network report)``."""
    qs, ks, vs = (plan.shard(t, rank, 2).detach().clone().requires_grad_() for t in (q, k, v))
    with IOCounter() as io:
        out = context_parallel_attention(qs, ks, vs, plan, group=group, causal=causal, backend=BACKEND)
        out.backward(plan.shard(do, rank, 2))
    return out.detach(), qs.grad, ks.grad, vs.grad, io.network.to_dict()["kernels"]


def _report(kernels: dict) -> TrafficReport:
    """A counted network report back from its ``to_dict()`` form (what the workers save)."""
    rep = TrafficReport(source="counted")
    for name, kt in kernels.items():
        rep.add(name, kt["reads"], kt["writes"], kt["launches"])
    return rep


def _bad_inputs(plan, rank, x):
    """Each bad input on this rank (or only on rank 1): the error message every rank raised."""
    msgs = {}
    q = plan.shard(x, rank, 2)
    short = q[:, :, :-1] if rank == 1 else q                             # only rank 1 is wrong
    for what, args in (("short-shard", (short, q, q, plan)),
                       ("group-size", (q, q, q, ContextParallelPlan(plan.source_layout, plan.world_size + 1))),
                       ("causal-mismatch", (q, q, q, plan))):
        try:
            context_parallel_attention(*args, causal=what == "causal-mismatch" and not plan.causal, backend=BACKEND)
        except ValueError as exc:
            msgs[what] = str(exc)
    return msgs


def _worker(rank: int, world: int, port: int, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        inputs = torch.load(path + ".in")
        results = {}
        for (name, layout, causal, *_), (q, k, v, do) in zip(_cases(), inputs):
            plan = ContextParallelPlan(layout, world, causal=causal)
            results[name] = _run_rank(plan, rank, q, k, v, do, causal)
            if name in ("sliding_window", "longformer-global-gqa"):      # determinism: a second run
                results[name + "-rerun"] = _run_rank(plan, rank, q, k, v, do, causal)
            if name == "sliding_window":
                results["bad"] = _bad_inputs(plan, rank, q)
        torch.save(results, f"{path}.rank{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()



def _spawn(world: int, path: str):
    spawn(_worker, (world, free_port(), path), world, "context-parallel workers", TIMEOUT_S)
    return [torch.load(f"{path}.rank{r}") for r in range(world)]


def _inputs(B, Hq, Hkv, n, D, dtype):
    return tuple(torch.randn(B, h, n, D).to(dtype) for h in (Hq, Hkv, Hkv, Hq))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_matches_single_process(world, tmp_path):
    cases = _cases()
    inputs = [_inputs(B, Hq, Hkv, layout.seqlen_q, D, dtype) for _, layout, _, B, Hq, Hkv, D, dtype in cases]
    path = str(tmp_path / "cp")
    torch.save(inputs, path + ".in")
    ranks = _spawn(world, path)

    for (name, layout, causal, B, Hq, Hkv, D, dtype), (q, k, v, do) in zip(cases, inputs):
        plan = ContextParallelPlan(layout, world, causal=causal)
        got = [plan.unshard([r[name][i] for r in ranks], 2) for i in range(4)]
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = block_sparse_attention(*leaves, layout, causal=causal, backend=BACKEND)
        out.backward(do)
        single = [out.detach()] + [t.grad for t in leaves]
        ref64 = attention_reference(*(t.double() for t in (q, k, v)), layout, causal=causal)[0]
        tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
        for what, g, s in zip(("out", "dq", "dk", "dv"), got, single):
            assert g.dtype == dtype and torch.isfinite(g).all(), (name, what)
            assert rel_err(g, s) <= tol, (name, what, rel_err(g, s))
        assert rel_err(got[0], ref64) <= tol, (name, rel_err(got[0], ref64))
        model = context_parallel(plan, batch=B, num_heads_kv=Hkv, head_dim=D, dtype=dtype, num_heads_q=Hq)
        for r in range(world):
            assert _report(ranks[r][name][4]) == model.report(r), (name, r)          # counted == predicted, bytes
        assert model.recv == model.floor, name

    for r in ranks:                                                       # deterministic backward
        for name in ("sliding_window", "longformer-global-gqa"):
            for a, b in zip(r[name][:4], r[name + "-rerun"][:4]):
                assert torch.equal(a, b), name
        bad = r["bad"]
        assert set(bad) == {"short-shard", "group-size", "causal-mismatch"}, bad
        assert "rank 1" in bad["short-shard"] and "plan.shard" in bad["short-shard"] or "refused" in bad["short-shard"]
        assert f"built for {world + 1}" in bad["group-size"]
        assert "causal" in bad["causal-mismatch"]
