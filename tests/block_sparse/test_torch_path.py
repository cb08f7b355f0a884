"""backend="torch" specifics (the shared correctness matrix is in test_correctness.py): plan
structure (views, strided windows, gathers; only kept blocks read), small score budgets, every plan
kind against the float64 reference, thread counts, CUDA."""
import pytest
import torch

from sparse_io_attn import BlockSparseLayout, patterns, plan
from sparse_io_attn.block_sparse.torch_path import plan as torch_path
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err

import helpers
from helpers import FP32_TOL, check_close, make_inputs


def run(q, k, v, do, layout, causal, sm_scale=None):
    return helpers.run(q, k, v, do, layout, causal, backend="torch", sm_scale=sm_scale)


def check_fp32(got, ref, tol=FP32_TOL):
    check_close(got, ref, tol)


PATTERNS = [  # every plan kind: strided windows, unit-batched views, gathered blocks, per-head
    pytest.param(lambda: patterns.sliding_window(512, 32, 64), False, id="sliding-window"),
    pytest.param(lambda: patterns.sliding_window(500, 32, 70, causal=True), True, id="sliding-window-causal-ragged"),
    pytest.param(lambda: patterns.causal(384, 32), True, id="causal"),
    pytest.param(lambda: patterns.causal(400, 32), False, id="block-triangle-not-causal-ragged"),
    pytest.param(lambda: patterns.dense(256, 32), False, id="dense"),
    pytest.param(lambda: patterns.bigbird(512, 32, num_heads=2), False, id="bigbird-per-head"),
    pytest.param(lambda: patterns.bigbird(448, (32, 16), causal=True), True, id="bigbird-rect-block-causal"),
]


@pytest.mark.parametrize("make,causal", PATTERNS)
def test_patterns(make, causal):
    layout = make()
    Nq, Nk = layout.seqlen
    q, k, v, do = make_inputs(1, 2, 2, Nq, Nk, 32)
    check_fp32(run(q, k, v, do, layout, causal), attention_reference(q, k, v, layout, causal=causal, do=do))


def test_plan_uses_views_windows_and_gathers():
    """The fast paths are really taken: a sliding window runs as strided windows, a causal layout
    as unit-batched views, BigBird's random blocks through gathers."""
    def kinds(layout, delta, B=1, H=2):
        return {ch.kind for ch in torch_path.get_plan(plan(layout, causal=delta is not None), B, H, H,
                                                      torch.device("cpu")).chunks}
    assert "strided" in kinds(patterns.sliding_window(1024, 32, 96), None)
    assert kinds(patterns.causal(512, 32), 0) == {"units"}
    assert "gather" in kinds(patterns.bigbird(1024, 32), None)


@pytest.mark.parametrize("make,delta", [
    pytest.param(lambda: patterns.causal(2048, 64), 0, id="causal-prefixes"),
    pytest.param(lambda: patterns.sliding_window(1000, 32, 70), None, id="window-ragged"),
    pytest.param(lambda: patterns.bigbird(640, 32, num_heads=2), None, id="bigbird-per-head"),
])
def test_plan_reads_only_kept_blocks(make, delta):
    """Every (unit, query block, key block) a chunk multiplies is a block the layout keeps (and the
    causal diagonal does not remove), each exactly once."""
    layout = make()
    host = torch_path.get_plan(plan(layout, causal=delta is not None), 1, 2, 2, torch.device("cpu"))
    read = sum(ch.steps * ch.nb * ch.R * ch.C for ch in host.chunks)
    expect = layout.to("cpu")
    if delta is not None:
        expect = expect & patterns.causal(layout.seqlen, layout.block_size)
    assert read == expect.nnz_blocks * (2 if layout.layout_heads == 1 else 1)


@pytest.mark.parametrize("budget", [1, 4096, 1 << 14])
@pytest.mark.parametrize("make,causal", [
    pytest.param(lambda: patterns.sliding_window(320, 32, 50), False, id="sliding-window"),
    pytest.param(lambda: patterns.dense(200, 32), True, id="dense-causal-ragged"),
    pytest.param(lambda: patterns.bigbird(320, 32, num_heads=4), False, id="bigbird-per-head"),
])
def test_small_score_budget_splits_work(monkeypatch, budget, make, causal):
    """Tiny budgets split classes into pieces and runs into several chunks; results must not change."""
    monkeypatch.setattr(torch_path, "SCORE_BUDGET", budget)
    layout = make()
    Nq, Nk = layout.seqlen
    q, k, v, do = make_inputs(2, 4, 2, Nq, Nk, 16)
    check_fp32(run(q, k, v, do, layout, causal), attention_reference(q, k, v, layout, causal=causal, do=do))


def test_causal_rows_without_keys_have_no_nan():
    """Causal + a layout missing the diagonal: early query positions see no key at all."""
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1, 0] = mask[2, 0] = mask[3, 2] = True
    mask[0, 1] = True  # above the diagonal: fully dropped by causal, row 0 becomes empty
    layout = BlockSparseLayout.from_block_mask(mask, 16)
    q, k, v, do = make_inputs(1, 1, 1, 64, 64, 16)
    got = run(q, k, v, do, layout, True)
    check_fp32(got, attention_reference(q, k, v, layout, causal=True, do=do))
    assert torch.isneginf(got[1][0, 0, :16]).all()


def test_host_plan_is_kept_in_the_attention_plan():
    layout = patterns.sliding_window(256, 32, 40)
    dev = torch.device("cpu")
    p1 = torch_path.get_plan(plan(layout), 1, 2, 2, dev)
    assert torch_path.get_plan(plan(layout), 1, 2, 2, dev) is p1
    assert torch_path.get_plan(plan(layout, causal=True), 1, 2, 2, dev) is not p1
    assert torch_path.get_plan(plan(layout), 2, 2, 2, dev) is not p1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda():
    layout = patterns.bigbird(256, 32, num_heads=2)
    q, k, v, do = (t.cuda() for t in make_inputs(1, 2, 2, 256, 256, 32))
    got = [t.cpu() for t in run(q, k, v, do, layout.to("cuda"), True)]
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), layout, causal=True, do=do.cpu())
    check_fp32(got, ref, tol=1e-4)  # TF32 may be on for CUDA matmuls


def test_same_result_with_one_or_several_threads():
    """Several torch threads spread chunks over workers; one thread runs them in order."""
    layout = patterns.bigbird(512, 32, num_heads=2)
    q, k, v, do = make_inputs(1, 2, 2, 512, 512, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        multi = run(q, k, v, do, layout, True)
        torch.set_num_threads(1)
        single = run(q, k, v, do, layout, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(multi[0], single[0]) and torch.equal(multi[1], single[1])  # forward: row-exact
    for a, b in zip(multi[2:], single[2:]):
        assert rel_err(a, b) <= 1e-6  # backward: dK/dV sums may be grouped differently
    assert torch.get_num_threads() == before
