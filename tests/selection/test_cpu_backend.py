"""Backend "cpu" of selection_attention (the C++ kernels in sparse_io_attn/selection/cpu/) against the
float64 reference, with both kernel families forced on every case (key-major: gathered query rows
per key block; query-major: gathered keys per query token); low precision against a same-precision
baseline; strided inputs; bitwise determinism across runs and thread counts; the plan's C++
normalisations equal to the torch versions; raw ops refusing corrupted inputs."""
import math

import pytest
import torch

from helpers import FP32_TOL, check_within_baseline, no_host_sync
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection import cpu
from sparse_io_attn.selection import plan as plan_module
from sparse_io_attn.selection.api import selection_attention
from sparse_io_attn.selection.plan import SelectionPlan, key_lists, normalize_rows
from sparse_io_attn.selection.reference import selection_mask, selection_reference

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason=f"CPU kernel unavailable: {cpu.unavailable_reason()}")

FAMILIES = ("key", "query")


def make_selection(B, G, Nq, Nk, bs, K, *, counts=False, batched=True, empty_rows=()):
    """Random indices with repeats, empty slots (-1) and, with ``counts``, rows cut short."""
    nkb = math.ceil(Nk / bs)
    shape = (B, G, Nq, K) if batched else (G, Nq, K)
    idx = torch.randint(-1, nkb, shape)
    if K > 1:
        idx[..., 1] = idx[..., 0]                   # a repeat in every row
    for t in empty_rows:
        idx[..., t, :] = -1
    cnt = torch.randint(0, K + 1, shape[:-1]) if counts else None
    return Selection(idx, bs, cnt)


def run_cpu(q, k, v, do, selection, causal, family, sm_scale=None):
    """``(out, lse, dq, dk, dv)`` from the backend's forward and backward on a plan."""
    D = q.shape[-1]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    plan = SelectionPlan(selection, k.shape[2], causal_offset(causal, q.shape[2], k.shape[2]))
    out, lse, stats = cpu.forward(q, k, v, plan, sm_scale=sm_scale, family_name=family)
    dq, dk, dv = cpu.backward(do, q, k, v, out, stats, plan, sm_scale=sm_scale, family_name=family)
    return out, lse, dq, dk, dv


def check_close(got, ref, tol=FP32_TOL):
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    lse, r_lse = got[1], ref[1]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)), "lse must be -inf exactly on empty rows"
    fin = torch.isfinite(r_lse)
    errs = {"out": rel_err(got[0], ref[0]), "lse": rel_err(lse[fin], r_lse[fin]),
            "dq": rel_err(got[2], ref[2]), "dk": rel_err(got[3], ref[3]), "dv": rel_err(got[4], ref[4])}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype),
            torch.randn(B, Hkv, Nk, D, dtype=dtype), torch.randn(B, Hq, Nq, D, dtype=dtype))


CASES = [  # B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, counts, batched
    pytest.param(1, 4, 2, 1, 40, 40, 16, 1, 12, True, False, False, id="tokens-G1-gqa-causal"),
    pytest.param(2, 4, 2, 2, 37, 45, 24, 4, 5, "bottom_right", True, True, id="micro4-Ghkv-bottom-right-counts"),
    pytest.param(1, 4, 4, 4, 33, 33, 32, 4, 6, False, False, True, id="micro4-Ghq-mha-full"),
    pytest.param(2, 4, 2, 4, 50, 70, 16, 16, 3, True, True, True, id="block16-Ghq-gqa-rect-counts"),
    pytest.param(1, 4, 2, 2, 130, 130, 64, 64, 2, True, False, False, id="block64-Ghkv-causal"),
    pytest.param(1, 2, 1, 1, 70, 100, 32, 64, 2, "bottom_right", False, True, id="block64-mqa-ragged-bottom-right"),
    pytest.param(1, 8, 2, 8, 30, 90, 20, 7, 4, "bottom_right", False, True, id="block7-Ghq-odd-dim"),
    pytest.param(1, 6, 3, 3, 29, 29, 48, 5, 5, True, True, False, id="block5-G3-ragged"),
    pytest.param(1, 2, 2, 2, 19, 300, 8, 1, 40, None, False, True, id="tokens-long-rows-small-dim"),
    pytest.param(1, 4, 1, 2, 45, 45, 130, 3, 4, True, False, True, id="block3-head-dim-130-generic"),
    pytest.param(1, 2, 1, 1, 20, 700, 16, 300, 2, "bottom_right", False, False, id="block300-split-key-tiles"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("B,Hq,Hkv,G,Nq,Nk,D,bs,K,causal,counts,batched", CASES)
def test_matches_float64_reference(family, B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, batched):
    selection = make_selection(B, G, Nq, Nk, bs, K, counts=counts, batched=batched)
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run_cpu(q, k, v, do, selection, causal or False, family)
    check_close(got, selection_reference(q, k, v, selection, causal=causal or False, do=do))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bs", [1, 16], ids=["tokens", "block16"])
def test_empty_rows_give_zero_output_minus_inf_lse_zero_gradients(family, bs):
    """Rows with every slot empty, rows whose blocks all lie in the causal future (bottom_right with
    Nq > Nk: the first rows see no key), and rows cut to zero by counts."""
    B, Hq, Hkv, G, Nq, Nk, D, K = 1, 4, 2, 2, 40, 24, 16, 3
    selection = make_selection(B, G, Nq, Nk, bs, K, empty_rows=(5, 30))
    counts = torch.full((B, G, Nq), K)
    counts[..., 33] = 0
    selection = Selection(selection.indices, bs, counts)
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run_cpu(q, k, v, do, selection, "bottom_right", family)
    ref = selection_reference(q, k, v, selection, causal="bottom_right", do=do)
    check_close(got, ref)
    empty = torch.isneginf(ref[1])
    assert empty[..., :Nq - Nk].all() and empty[..., 5].all() and empty[..., 30].all() and empty[..., 33].all()
    assert (got[0][empty] == 0).all() and (got[2][empty] == 0).all()


def test_everything_empty_gives_zero_key_gradients():
    q, k, v, do = inputs(1, 2, 1, 20, 20, 16)
    selection = Selection(torch.full((1, 20, 3), -1), 4)
    for family in FAMILIES:
        out, lse, dq, dk, dv = run_cpu(q, k, v, do, selection, True, family)
        assert (out == 0).all() and torch.isneginf(lse).all()
        assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_vs_same_precision_baseline(family, dtype):
    """flash-attention's rule: error vs float64 at most 2x (outputs) / 3x (gradients) the error of
    plain PyTorch attention with the same element mask, run in the same dtype."""
    B, Hq, Hkv, G, N, D, bs, K = 1, 4, 2, 2, 96, 64, 8, 6
    selection = make_selection(B, G, N, N, bs, K)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D, dtype=dtype)
    out, lse, dq, dk, dv = run_cpu(q, k, v, do, selection, True, family)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    ref = selection_reference(q, k, v, selection, causal=True, do=do)
    mask = selection_mask(selection, B, Hq, N, causal=True)
    check_within_baseline((out, lse, dq, dk, dv), ref, q, k, v, do, mask)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_views_give_the_contiguous_result(family, dtype):
    B, Hq, Hkv, G, N, D, bs, K = 2, 4, 2, 4, 48, 32, 4, 5
    selection = make_selection(B, G, N, N, bs, K)
    # [B, N, H, D] storage seen as [B, H, N, D]; a head dim with stride 2; an expanded kv head
    q = torch.randn(B, N, Hq, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, N, 2 * D, dtype=dtype)[..., ::2]
    v = torch.randn(B, 1, N, D, dtype=dtype).expand(B, Hkv, N, D)
    do = torch.randn(B, N, Hq, D, dtype=dtype).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or do.is_contiguous())
    got = run_cpu(q, k, v, do, selection, True, family, sm_scale=0.3)
    want = run_cpu(*(t.contiguous() for t in (q, k, v, do)), selection, True, family, sm_scale=0.3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if dtype == torch.float32:
        check_close(got, selection_reference(q, k, v, selection, causal=True, sm_scale=0.3, do=do))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


DETERMINISM = [  # B, Hq, Hkv, G, Nq, Nk, D, block, K, hot: every token also picks block 0
    pytest.param(1, 4, 1, 1, 1100, 1100, 16, 16, 2, True, id="block16-one-block-chosen-by-4400-rows"),
    pytest.param(2, 4, 2, 4, 300, 300, 32, 4, 6, False, id="micro4-Ghq"),
    pytest.param(1, 8, 2, 1, 200, 200, 16, 1, 40, True, id="tokens-G1"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("B,Hq,Hkv,G,Nq,Nk,D,bs,K,hot", DETERMINISM)
def test_bitwise_identical_across_runs_and_thread_counts(threads, family, B, Hq, Hkv, G, Nq, Nk, D, bs, K, hot):
    """Decompositions depend on the plan and shapes only: one thread and two give the same bits (the
    first case cuts one key block's 4400 gathered rows into several chunks, summed in order)."""
    selection = make_selection(B, G, Nq, Nk, bs, K)
    if hot:
        selection.indices[..., 0] = 0
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D)
    results = []
    for n in (1, 2, 2):
        threads(n)
        results.append(run_cpu(q, k, v, do, selection, True, family))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_at_large_logits(family):
    """Logits ~1e6: backward recomputes P with the forward's exact arithmetic."""
    selection = make_selection(1, 2, 48, 48, 4, 5)
    q, k, v, do = inputs(1, 2, 2, 48, 48, 16)
    q, k = q * 1e3, k * 1e3
    got = run_cpu(q, k, v, do, selection, False, family)
    ref = selection_reference(q, k, v, selection, do=do)
    assert rel_err(got[0], ref[0]) <= 1e-6 and rel_err(got[4], ref[4]) <= 1e-6


def test_no_host_synchronisation():
    selection = make_selection(1, 2, 40, 40, 4, 5)
    q, k, v, do = inputs(1, 4, 2, 40, 40, 16)
    plan = SelectionPlan(selection, 40, 0)
    with no_host_sync():
        for family in FAMILIES:
            out, lse, stats = cpu.forward(q, k, v, plan, sm_scale=0.25, family_name=family)
            cpu.backward(do, q, k, v, out, stats, plan, sm_scale=0.25, family_name=family)


def test_family_choice(monkeypatch):
    plan16 = SelectionPlan(make_selection(1, 1, 8, 64, 16, 2), 64, None)
    plan4 = SelectionPlan(make_selection(1, 1, 8, 64, 4, 2), 64, None)
    assert cpu.family(plan16) == "key" and cpu.family(plan4) == "query"
    big = torch.empty(1, 64, 2 ** 20, 64, device="meta")        # pair partials past 2 GiB: query-major
    assert cpu.family(plan16, q=big) == "query" and cpu.family(plan16, q=big[:, :, :8]) == "key"
    monkeypatch.setenv(cpu.FAMILY_ENV, "query")
    assert cpu.family(plan16) == "query" and cpu.family(plan16, "key") == "key"
    monkeypatch.setenv(cpu.FAMILY_ENV, "fastest")
    with pytest.raises(ValueError, match="family must be one of"):
        cpu.family(plan16)


def test_through_selection_attention():
    """The public op with backend="cpu": autograd through it, lse returned."""
    selection = make_selection(1, 2, 64, 64, 16, 3)
    q, k, v, do = inputs(1, 4, 2, 64, 64, 32)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = selection_attention(q_, k_, v_, selection, causal=True, return_lse=True, backend="cpu")
    out.backward(do)
    check_close((out.detach(), lse, q_.grad, k_.grad, v_.grad),
                selection_reference(q, k, v, selection, causal=True, do=do))


def test_cuda_tensors_are_refused():
    q = torch.empty(1, 1, 16, 16, device="meta")
    plan = SelectionPlan(make_selection(1, 1, 16, 16, 4, 2), 16, None)
    with pytest.raises(ValueError, match="backend 'cpu' runs on CPU tensors"):
        cpu.forward(q, q, q, plan, sm_scale=1.0)


# ------------------------------------------------------------------------ the plan's C++ normalisations
@pytest.fixture
def torch_plan(monkeypatch):
    """normalize_rows / key_lists as their torch reference (the C++ dispatch switched off)."""
    monkeypatch.setattr(plan_module, "_native_ops", lambda t: None)


PLAN_CASES = [  # L, Nq, Nk, K, block, causal offset, counts, index dtype
    pytest.param(3, 9, 17, 5, 4, 0, True, torch.int64, id="ragged-causal-counts"),
    pytest.param(2, 6, 13, 6, 1, 7, False, torch.int32, id="tokens-bottom-right-int32"),
    pytest.param(2, 5, 64, 3, 64, -2, True, torch.int64, id="one-block-negative-offset"),
    pytest.param(1, 300, 5000, 700, 1, None, False, torch.int64, id="tokens-wide-rows-sorted-path"),
    pytest.param(2, 100, 1000, 40, 3, -5, True, torch.int32, id="block3-counts-past-K"),
    pytest.param(1, 2100, 2100, 64, 1, 0, False, torch.int64, id="tokens-several-row-blocks"),
]


@pytest.mark.parametrize("L,Nq,Nk,K,bs,delta,with_counts,dtype", PLAN_CASES)
def test_plan_ops_equal_the_torch_versions(torch_plan, L, Nq, Nk, K, bs, delta, with_counts, dtype):
    ops = cpu.load()
    nkb = math.ceil(Nk / bs)
    idx = torch.randint(-2, nkb + 2, (L, Nq, K), dtype=dtype)    # empty slots, out of range
    idx[..., : K // 2] = torch.randint(0, min(nkb, 30), (L, Nq, K // 2), dtype=dtype)   # repeats, dense rows
    counts = torch.randint(-1, K + 2, (L, Nq)) if with_counts else None
    rows, row_counts = ops.selection_rows(idx, counts, nkb, bs, delta)
    want_rows, want_counts = normalize_rows(idx, counts, nkb, bs, delta)
    assert torch.equal(rows, want_rows) and torch.equal(row_counts, want_counts)
    got, want = ops.selection_keys(rows, nkb), key_lists(want_rows, nkb)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_plan_dispatches_to_the_cpu_ops(monkeypatch):
    cpu.load()
    selection = make_selection(1, 2, 50, 200, 1, 20, counts=True)
    native = SelectionPlan(selection, 200, 3)
    native_keys = native.keys()
    called = []
    monkeypatch.setattr(plan_module, "_native_ops", lambda t: called.append(t) and None)
    reference = SelectionPlan(selection, 200, 3)
    assert called and torch.equal(native.rows, reference.rows)
    assert torch.equal(native.row_counts, reference.row_counts)
    for a, b in zip(native_keys, reference.keys()):
        assert torch.equal(a, b)


def test_plan_under_torch_compile_fullgraph():
    """Traced code builds the plan with the torch ops (one graph, no break)."""
    cpu.load()

    def build(idx):
        rows, counts = normalize_rows(idx, None, 16, 4, 0)
        return rows, counts, key_lists(rows, 16)

    idx = torch.randint(-1, 16, (2, 20, 5))
    got = torch.compile(build, fullgraph=True, backend="eager")(idx)
    want = build(idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)


def test_selection_keys_refuses_rows_that_are_not_normalised():
    ops = cpu.load()
    rows = torch.tensor([[[0, 2, -1], [3, 1, -1]]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="normalised rows"):
        ops.selection_keys(rows, 4)
    with pytest.raises(RuntimeError, match="normalised rows"):
        ops.selection_keys(torch.tensor([[[0, -1, 2]]], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="normalised rows"):
        ops.selection_keys(torch.tensor([[[0, 5]]], dtype=torch.int32), 4)


# ------------------------------------------------------------------------ raw ops refuse corrupted inputs
def _raw(family="key"):
    selection = make_selection(1, 2, 24, 24, 4, 4)
    q, k, v, do = inputs(1, 4, 2, 24, 24, 16)
    plan = SelectionPlan(selection, 24, 0)
    keys = plan.keys()
    args = dict(rows=plan.rows.clone(), counts=plan.row_counts.clone(), ptr=keys.col_ptr.clone(),
                query=keys.col_query.clone(), slot=keys.col_slot.clone())
    return q, k, v, do, args, {"key": 1, "query": 2}[family]


def _fwd(q, k, v, a, fam, stride_lb=0, hps=2, block=4):
    return cpu.load().selection_fwd(q, k, v, a["rows"], a["counts"], a["ptr"], a["query"], a["slot"], block,
                                    stride_lb, hps, 0, 0.25, fam)


def _bwd(q, k, v, do, a, fam):
    ops = cpu.load()
    out, _, stats, _ = ops.selection_fwd(q, k, v, a["rows"], a["counts"], a["ptr"], a["query"], a["slot"], 4, 0, 2,
                                         0, 0.25, 2)
    return ops.selection_bwd(do, q, k, v, out, stats, a["rows"], a["counts"], a["ptr"], a["query"], a["slot"], 4,
                             0, 2, 0, 0.25, fam)


def _used(a):
    """Flat index of the first row with a kept block."""
    return int(torch.argmax((a["counts"].reshape(-1) > 0).to(torch.int32)))


CORRUPT = [
    pytest.param(lambda a: a["rows"].view(-1).__setitem__(_used(a) * 4, 99), "not normalised",
                 id="block-out-of-range"),
    pytest.param(lambda a: a["rows"].view(-1).__setitem__(_used(a) * 4, -5), "not normalised", id="negative-block"),
    pytest.param(lambda a: a["counts"].view(-1).__setitem__(0, 5), "not normalised", id="count-past-K"),
    pytest.param(lambda a: a["counts"].view(-1).__setitem__(0, -1), "not normalised", id="negative-count"),
    pytest.param(lambda a: a["query"].__setitem__(0, 1000), "inconsistent", id="token-out-of-range"),
    pytest.param(lambda a: a["slot"].__setitem__(0, 7), "inconsistent", id="slot-out-of-range"),
    pytest.param(lambda a: a["ptr"].view(-1).__setitem__(3, 10 ** 6), "span|decrease|hold", id="pointer-past-end"),
    pytest.param(lambda a: a["ptr"].view(-1).__setitem__(-1, 0), "span|decrease|hold", id="pointers-decrease"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("corrupt,message", CORRUPT)
def test_raw_ops_refuse_corrupted_plans(family, corrupt, message):
    q, k, v, do, a, fam = _raw(family)
    corrupt(a)
    with pytest.raises(RuntimeError, match=message):
        _bwd(q, k, v, do, a, fam)
    if family == "key" or "normalised" in message:
        with pytest.raises(RuntimeError, match=message):
            _fwd(q, k, v, a, fam)


def test_raw_ops_refuse_lists_naming_another_block():
    q, k, v, do, a, fam = _raw("key")
    e = int(a["ptr"][0, 1])          # first entry of block 1's list: point it at another slot of its row
    t, j = int(a["query"][e]), int(a["slot"][e])
    other = [s for s in range(int(a["counts"][0, t])) if s != j]
    if not other:
        pytest.skip("the drawn row holds one block")
    a["slot"][e] = other[0]
    with pytest.raises(RuntimeError, match="naming another block"):
        _fwd(q, k, v, a, fam)


def test_raw_ops_refuse_bad_head_maps_and_shapes():
    q, k, v, do, a, fam = _raw("key")
    with pytest.raises(RuntimeError, match="reach selection"):
        _fwd(q, k, v, a, fam, hps=1)      # heads 0..3 would use selections 0..3 of 2
    with pytest.raises(RuntimeError, match="heads_per_selection"):
        _fwd(q, k, v, a, fam, hps=3)
    with pytest.raises(RuntimeError, match="rows must be"):
        _fwd(q[:, :, :10], k, v, a, fam)
    with pytest.raises(RuntimeError, match="not normalised"):
        _fwd(q, k, v, a, fam, block=12)        # 2 key blocks: the plan's blocks 2..5 are out of range
    with pytest.raises(RuntimeError, match="family"):
        _fwd(q, k, v, a, 7)
