"""backend="torch" (sparse_io_attn.block_sparse.torch_path) against the float64 reference: outputs, lse and all
three gradients on fresh random inputs, curated edge cases, low precision, plan structure."""
import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn.block_sparse.torch_path import plan as torch_path
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask, masked_attention, rel_err

FP32_TOL = 1e-5


def make_layout(B, Hq, Nq, Nk, block, *, density=0.5, per_head=False, per_batch=False,
                empty_rows=(), fill=None):
    """Random block mask ``torch.rand(...) < density`` (``fill`` True/False: all kept/none kept),
    optional empty query-block rows."""
    bq, bk = (block, block) if isinstance(block, int) else block
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    lb, lh = (B if per_batch else 1), (Hq if per_head else 1)
    if fill is None:
        mask = torch.rand(lb, lh, nqb, nkb) < density
    else:
        mask = torch.full((lb, lh, nqb, nkb), fill, dtype=torch.bool)
    for r in empty_rows:
        mask[..., r, :] = False
    return BlockSparseLayout.from_block_mask(mask, (bq, bk), (Nq, Nk))


def make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32):
    mk = lambda h, n: torch.randn(B, h, n, D, dtype=dtype)  # noqa: E731
    return mk(Hq, Nq), mk(Hkv, Nk), mk(Hkv, Nk), mk(Hq, Nq)


def run(q, k, v, do, layout, causal, sm_scale=None):
    """Forward + backward through the public API with backend="torch"."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, sm_scale=sm_scale,
                                      return_lse=True, backend="torch")
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def check_fp32(got, ref, tol=FP32_TOL):
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = ref
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:3]
    # lse is -inf exactly where the reference row is empty
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    fin = torch.isfinite(r_lse)
    errs = {"out": rel_err(out, r_out), "lse": rel_err(lse[fin], r_lse[fin]),
            "dq": rel_err(dq, r_dq), "dk": rel_err(dk, r_dk), "dv": rel_err(dv, r_dv)}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


CASES = [  # (B, Hq, Hkv, Nq, Nk, D, block, causal, layout options)
    pytest.param(2, 4, 4, 128, 128, 64, 32, False, {}, id="B2-H4-N128-D64-b32"),
    pytest.param(2, 2, 2, 203, 203, 48, 32, False, {}, id="B2-H2-N203-D48-ragged"),
    pytest.param(1, 2, 2, 203, 203, 48, 32, True, {}, id="N203-D48-causal-ragged"),
    pytest.param(1, 2, 2, 100, 300, 32, 32, False, {}, id="rect-Nq100-Nk300"),
    pytest.param(1, 2, 2, 300, 100, 32, 32, True, {}, id="rect-Nq300-Nk100-causal"),
    pytest.param(1, 2, 2, 90, 150, 32, 32, True, {}, id="rect-Nq90-Nk150-causal"),
    pytest.param(1, 2, 2, 96, 160, 32, (16, 32), True, {}, id="rect-block16x32-causal"),
    pytest.param(1, 2, 2, 130, 96, 32, (32, 16), False, {}, id="rect-block32x16-ragged"),
    pytest.param(2, 4, 4, 96, 96, 32, 16, False, {"per_head": True}, id="per-head"),
    pytest.param(3, 2, 2, 96, 96, 32, 16, True, {"per_batch": True}, id="per-batch-causal"),
    pytest.param(2, 3, 3, 64, 80, 16, 16, False, {"per_batch": True, "per_head": True}, id="per-batch-head"),
    pytest.param(2, 8, 2, 128, 128, 32, 32, False, {}, id="gqa8-2"),
    pytest.param(1, 4, 2, 96, 112, 16, 16, True, {"per_head": True}, id="gqa4-2-per-head-causal"),
    pytest.param(2, 4, 2, 96, 96, 32, 16, True, {"per_batch": True}, id="gqa4-2-per-batch-causal"),
    pytest.param(1, 2, 2, 100, 90, 32, 128, True, {"fill": True}, id="block128-longer-than-seqlen-causal"),
    pytest.param(2, 4, 1, 100, 100, 32, 32, True, {}, id="mqa4-1-causal-ragged"),
    pytest.param(1, 3, 1, 80, 80, 32, 16, False, {"per_head": True}, id="mqa3-1-per-head"),
    pytest.param(1, 2, 2, 128, 128, 32, 32, False, {"empty_rows": (0, 2)}, id="empty-rows"),
    pytest.param(1, 2, 1, 128, 96, 32, 32, True, {"empty_rows": (1,)}, id="empty-rows-gqa-causal"),
    pytest.param(1, 2, 2, 100, 100, 32, 32, False, {"fill": True}, id="all-dense-ragged"),
    pytest.param(1, 2, 2, 128, 128, 32, 32, True, {"fill": True}, id="all-dense-causal"),
    pytest.param(2, 2, 1, 64, 96, 32, 32, False, {"fill": False}, id="all-empty"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,block,causal,opts", CASES)
def test_matches_reference_fp32(B, Hq, Hkv, Nq, Nk, D, block, causal, opts):
    layout = make_layout(B, Hq, Nq, Nk, block, **opts)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run(q, k, v, do, layout, causal)
    ref = attention_reference(q, k, v, layout, causal=causal, do=do)
    check_fp32(got, ref)


@pytest.mark.parametrize("D", [16, 48, 64, 80, 128, 256])
def test_head_dims(D):
    layout = make_layout(1, 2, 96, 96, 32, density=0.6)
    q, k, v, do = make_inputs(1, 2, 2, 96, 96, D)
    check_fp32(run(q, k, v, do, layout, True), attention_reference(q, k, v, layout, causal=True, do=do))


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
    def kinds(layout, causal, B=1, H=2):
        return {ch.kind for ch in torch_path.get_plan(layout, B, H, H, causal, torch.device("cpu")).chunks}
    assert "strided" in kinds(patterns.sliding_window(1024, 32, 96), False)
    assert kinds(patterns.causal(512, 32), True) == {"units"}
    assert "gather" in kinds(patterns.bigbird(1024, 32), False)


def test_rows_with_nested_key_ranges_are_stacked():
    """Causal prefixes of consecutive rows share one taller matmul over the union of their ranges."""
    plan = torch_path.get_plan(patterns.causal(2048, 64), 1, 2, 2, True, torch.device("cpu"))
    assert max(ch.R for ch in plan.chunks) == torch_path.MIN_ROWS_M // 64
    blocks = sum(ch.steps * ch.nb * ch.R * ch.C for ch in plan.chunks) / 2   # per unit
    assert 32 * 33 / 2 <= blocks <= 32 * 33 / 2 * (1 + torch_path.MERGE_WASTE)


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


def test_empty_rows_are_exact_zeros():
    layout = make_layout(1, 2, 128, 128, 32, empty_rows=(1, 3))
    q, k, v, do = make_inputs(1, 2, 2, 128, 128, 32)
    out, lse, dq, _, _ = run(q, k, v, do, layout, False)
    rows = torch.cat([torch.arange(32, 64), torch.arange(96, 128)])
    assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows]))
    assert torch.isneginf(lse[:, :, rows]).all()
    assert torch.equal(dq[:, :, rows], torch.zeros_like(dq[:, :, rows]))


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


def test_noncontiguous_inputs_and_sm_scale():
    layout = make_layout(2, 4, 96, 96, 32, density=0.6)
    q, k, v, do = (torch.randn(2, 96, h, 32).transpose(1, 2) for h in (4, 2, 2, 4))
    got = run(q, k, v, do, layout, True, sm_scale=0.3)
    check_fp32(got, attention_reference(q, k, v, layout, causal=True, sm_scale=0.3, do=do))


def test_backward_is_deterministic():
    layout = patterns.bigbird(256, 32)
    q, k, v, do = make_inputs(1, 2, 1, 256, 256, 32)
    a, b = run(q, k, v, do, layout, False), run(q, k, v, do, layout, False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_plan_is_cached_on_the_layout():
    layout = patterns.sliding_window(256, 32, 40)
    dev = torch.device("cpu")
    p1 = torch_path.get_plan(layout, 1, 2, 2, False, dev)
    assert torch_path.get_plan(layout, 1, 2, 2, False, dev) is p1
    assert torch_path.get_plan(layout, 1, 2, 2, True, dev) is not p1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,N,D,block,causal,opts", [
    pytest.param(1, 2, 2, 160, 64, 32, False, {}, id="N160-D64"),
    pytest.param(2, 4, 2, 100, 32, 32, True, {"empty_rows": (1,)}, id="gqa-causal-ragged-empty"),
    pytest.param(1, 2, 2, 96, 48, (16, 32), True, {"per_head": True}, id="per-head-rect-block"),
])
def test_low_precision_vs_same_precision_baseline(dtype, B, Hq, Hkv, N, D, block, causal, opts):
    """flash-attention's rule: error vs float64 at most 2x (outputs) / 3x (gradients) the error of
    plain dense PyTorch attention run in the same dtype."""
    layout = make_layout(B, Hq, N, N, block, **opts)
    q, k, v, do = make_inputs(B, Hq, Hkv, N, N, D, dtype=dtype)
    out, lse, dq, dk, dv = run(q, k, v, do, layout, causal)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    r_out, r_lse, r_dq, r_dk, r_dv = attention_reference(q, k, v, layout, causal=causal, do=do)
    mask = element_mask(layout, B, Hq, N, N, causal=causal)
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    b_out, _ = masked_attention(qb, kb, vb, mask, D ** -0.5)
    b_dq, b_dk, b_dv = torch.autograd.grad(b_out, (qb, kb, vb), do)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    assert rel_err(out, r_out) <= 2 * rel_err(b_out, r_out)
    for name, x, b, r in (("dq", dq, b_dq, r_dq), ("dk", dk, b_dk, r_dk), ("dv", dv, b_dv, r_dv)):
        assert rel_err(x, r) <= 3 * rel_err(b, r), f"{name}: {rel_err(x, r):.2e} vs baseline {rel_err(b, r):.2e}"
    fin = torch.isfinite(r_lse)
    assert rel_err(lse[fin], r_lse[fin]) <= FP32_TOL * 10  # lse is computed in fp32 from rounded inputs


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
