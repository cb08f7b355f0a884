"""Ranks that disagree get the same ValueError on every rank, never a crash, a hang or mixed data
(issue #34). One spawn of 3 gloo processes runs every case in turn (each raises on every rank, the
agreement completes, so the group stays usable) and ends with a valid call checked against the
float64 reference; the descriptors' comparison is also tested in-process, field by field."""
import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import FP32_TOL, free_port, spawn

from sparse_io_attn import patterns
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.distributed import ContextParallelPlan, ContextParallelSelfAttention, context_parallel_attention
from sparse_io_attn.distributed.agreement import _FIELDS, _describe, _disagreement, agreement_bytes
from sparse_io_attn.distributed.call import _check_local
from sparse_io_attn.layout.patterns import topk
from sparse_io_attn.nn import SparseSelfAttention

WORLD = 3
PG_TIMEOUT_S = 30          # the process group's: a rank left waiting fails its collective after this
SPAWN_TIMEOUT_S = 90       # the whole run's: every process killed after this
CASE_LIMIT_S = 10          # a case that takes longer waited in a collective (no case should)
N, BLOCK, D = 48, 8, 8


def _shard(plan, rank, B=1, H=2, dim=D, dtype=torch.float32, seed=0):
    x = torch.randn(B, H, N, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return plan.shard(x, rank, 2)


def _call(plan, rank, q, k=None, v=None, **kwargs):
    return context_parallel_attention(q, q if k is None else k, q if v is None else v, plan, backend="torch", **kwargs)


def _cases(rank: int):
    """``(name, run)``: each ``run()`` must raise on every rank (what differs is on one rank)."""
    plan = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 4), WORLD)

    def dtype():
        return _call(plan, rank, _shard(plan, rank, dtype=torch.bfloat16 if rank == 1 else torch.float32))

    def head_dim():
        return _call(plan, rank, _shard(plan, rank, dim=16 if rank == 1 else 8))

    def layouts():
        other = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 30 if rank == 2 else 4), WORLD)
        return _call(other, rank, _shard(other, rank))

    def batch_heads():                                                  # same bytes on every rank
        B, Hq, Hkv = (1, 4, 2) if rank == 0 else (2, 2, 1)
        return _call(plan, rank, _shard(plan, rank, B, Hq), _shard(plan, rank, B, Hkv), _shard(plan, rank, B, Hkv))

    def edited_layout():                                                # a selection refilled in place
        layout = topk(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)), 2, BLOCK, N)
        edited = ContextParallelPlan(layout, WORLD)
        refill = topk(torch.randn(6, 6, generator=torch.Generator().manual_seed(2)), 2, BLOCK, N)
        layout.crow_indices.copy_(refill.crow_indices)
        layout.col_slots.copy_(refill.col_slots)
        return _call(edited, rank, _shard(edited, rank))

    def plan_world():                                                   # raised before the agreement once
        return _call(ContextParallelPlan(plan.source_layout, 2) if rank == 1 else plan, rank, _shard(plan, rank))

    def module_short():
        torch.manual_seed(0)
        layer = SparseSelfAttention(16, 2, plan.source_layout, backend="torch")
        wrapped = ContextParallelSelfAttention(layer, ContextParallelSelfAttention.plan_for(layer, N, WORLD))
        x = wrapped.plan.shard(torch.randn(1, N, 16), rank, 1)
        return wrapped(x[:, :-1] if rank == 1 else x)

    def grad_on_rank0():                                                # rank 0 would wait in backward
        q = _shard(plan, rank).requires_grad_(rank == 0)
        out = _call(plan, rank, q)
        if out.requires_grad:
            out.sum().backward()

    def sm_scale():
        return _call(plan, rank, _shard(plan, rank), sm_scale=0.5 if rank == 2 else None)

    return [("dtype", dtype), ("head_dim", head_dim), ("layouts", layouts), ("batch_heads", batch_heads),
            ("edited_layout", edited_layout), ("plan_world", plan_world), ("module_short", module_short),
            ("grad_on_rank0", grad_on_rank0), ("sm_scale", sm_scale)]


EXPECTED = {
    "dtype": "ranks disagree: rank 1 has q dtype torch.bfloat16, rank 0 torch.float32",
    "head_dim": "ranks disagree: rank 1 has head dim 16, rank 0 8",
    "layouts": "ranks disagree: rank 2 has plan layout digest 0x",
    "batch_heads": "ranks disagree: rank 1 has batch 2, rank 0 1",
    "edited_layout": "ranks 0, 1, 2 refused their inputs; rank 0: the layout 'topk(k=2)' was edited in place after "
                     "ContextParallelPlan was built",
    "plan_world": "rank 1 refused its inputs: the process group has 3 ranks but the plan was built for 2",
    "module_short": "rank 1 refused its inputs: expected this rank's tokens x_local of shape [batch, ",
    "grad_on_rank0": "ranks disagree: rank 1 has no backward to run (q/k/v requires_grad False/False/False, grad "
                     "mode on), rank 0 a backward to run (q/k/v requires_grad True/True/True",
    "sm_scale": "ranks disagree: rank 2 has sm_scale 0.5, rank 0 0.35355",
}


def _worker(rank: int, port: int, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        results = {}
        for name, run in _cases(rank):
            start = time.monotonic()
            try:
                run()
                got = ("returned", None)
            except Exception as exc:                                    # noqa: BLE001 (reported to the test)
                got = (type(exc).__name__, str(exc))
            results[name] = (*got, time.monotonic() - start)
        plan = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 4), WORLD, causal=True)
        q, k, v = (_shard(plan, rank, seed=s).requires_grad_() for s in (1, 2, 3))
        out = _call(plan, rank, q, k, v, causal=True)                   # the group is still usable
        out.backward(_shard(plan, rank, seed=4))
        results["valid"] = [out.detach(), q.grad, k.grad, v.grad]
        torch.save(results, f"{path}.rank{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_disagreeing_ranks_raise_the_same_error_on_every_rank(tmp_path):
    path = str(tmp_path / "agree")
    start = time.monotonic()
    spawn(_worker, (free_port(), path), WORLD, "disagreeing context-parallel ranks", SPAWN_TIMEOUT_S)
    assert time.monotonic() - start < SPAWN_TIMEOUT_S / 2
    ranks = [torch.load(f"{path}.rank{r}") for r in range(WORLD)]
    for name, expected in EXPECTED.items():
        got = [r[name] for r in ranks]
        for rank, (kind, message, seconds) in enumerate(got):
            assert kind == "ValueError", (name, rank, kind, message)
            assert expected in message and "no rank started the exchange" in message, (name, rank, message)
            assert seconds < CASE_LIMIT_S, (name, rank, seconds)
        assert len({message for _, message, _ in got}) == 1, (name, got)   # the same error everywhere

    plan = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 4), WORLD, causal=True)
    q, k, v, do = (torch.randn(1, 2, N, D, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3, 4))
    out, _, *grads = attention_reference(q, k, v, plan.source_layout, causal=True, do=do)
    for i, want in enumerate([out] + grads):
        assert rel_err(plan.unshard([r["valid"][i] for r in ranks], 2), want) <= FP32_TOL, i


def _descriptor(q, plan, sm_scale=None):
    """A one-process rank's descriptor (its local checks as a rank runs them, on a 1-rank plan)."""
    local = _check_local(q, q, q, plan, plan.world_size, 0, plan.causal, sm_scale, "torch")[0]
    return _describe(q, q, q, plan, local, None, 3)


@pytest.mark.parametrize("field, change, expected", [
    ("plan causality", dict(causal=True), "rank 1 has plan causality True, rank 0 False"),
    ("query heads", dict(heads=1), "rank 1 has query heads 1, rank 0 2"),
    ("sm_scale", dict(sm_scale=0.25), "rank 1 has sm_scale 0.25, rank 0 0.3535"),
    ("plan assignment digest", dict(word=1), "rank 1 has plan assignment digest 0x"),
    ("k dtype", dict(word=3), "rank 1 has k dtype torch.bfloat16, rank 0 torch.float32"),
    ("backend", dict(word=3), "rank 1 has backend 'cpu', rank 0 'torch'"),
])
def test_each_field_is_compared_and_named(field, change, expected):
    """Descriptors of in-process "ranks" through the comparison every rank runs: equal ones agree;
    one field changed is named with both values (``word``: a field a rank's own checks would refuse
    or that needs a build, written into the descriptor directly)."""
    plan = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 4), 1)
    q = torch.randn(1, 2, N, D)
    mine = _descriptor(q, plan)
    assert _disagreement(torch.stack([mine, mine, mine])) is None
    other = ContextParallelPlan(plan.source_layout, 1, causal=change.get("causal", False))
    theirs = _descriptor(q[:, :change.get("heads", 2)], other, change.get("sm_scale"))
    if "word" in change:
        i = _FIELDS.index(field)
        theirs[i] = theirs[i] ^ 1 if field.endswith("digest") else change["word"]
    message = _disagreement(torch.stack([mine, theirs, mine]))
    assert message is not None and expected in message, message


def test_a_refused_rank_sends_its_error_text():
    """A refused rank's error text (cut to the descriptor's bytes, UTF-8 kept valid) reaches every rank;
    a rank whose inputs are not even tensors still describes itself."""
    plan = ContextParallelPlan(patterns.sliding_window(N, BLOCK, 4), 1)
    q = torch.randn(1, 2, N, D)
    good = _describe(q, q, q, plan, None, None, 2)
    assert good.numel() * 8 == agreement_bytes(2) == agreement_bytes(0) + 16 * 2
    bad = _describe(None, [], 3, "not a plan", None, ValueError("é" + "x" * 1000), 2)
    message = _disagreement(torch.stack([good, bad]))
    assert message.startswith("context_parallel_attention: rank 1 refused its inputs: éxxx"), message
    assert message.endswith("xx... (no rank started the exchange)") and len(message) < 600, message


def test_docs_state_the_agreement_bytes():
    root = Path(__file__).resolve().parents[2]
    assert f"({agreement_bytes(0)} + 16 W bytes per rank" in (root / "docs" / "CONTEXT_PARALLEL.md").read_text()
    assert f"a {agreement_bytes(0)} + 16 W-byte int64 descriptor" in (root / "docs" / "ARCHITECTURE.md").read_text()
