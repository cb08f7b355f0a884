"""The arguments both attention ops take beyond ``(q, k, v, mask)`` on backends ``cpu`` and ``torch``:
per-head attention sinks (value and gradient), a V head dim other than Q/K's, and the backward's
row deltas from the forward's fp32 output (bf16 gradients against float64). Every case against the
float64 references (the sink as one more score column, the mask from the layout or selection), on
fresh random inputs: GQA, empty rows with and without a sink, a ``-inf`` sink, both causal
alignments, decode calls (``Nq <= 16``), both selection kernel families. Triton's sinks are tested
below, its V head dim of its own in test_triton_value_dim.py."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import make_layout
from selection.test_correctness import _cpu_kernel_present  # noqa: F401 (autouse fixture: skips cpu without C++)
from sparse_io_attn import Selection, block_sparse_attention, selection_attention
from sparse_io_attn._attention.sinks import fold_sinks
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.selection.reference import selection_reference

BACKENDS = ("torch", "cpu")


def _selection(B, Hkv, Nq, Nk, bs, K, empty_rows=()):
    """Random blocks per (batch, kv head, token), a quarter of the slots empty, some rows empty."""
    idx = torch.randint(0, math.ceil(Nk / bs), (B, Hkv, Nq, K))
    idx = torch.where(torch.rand(idx.shape) < 0.25, -1, idx)
    for t in empty_rows:
        idx[..., t, :] = -1
    return Selection(idx, bs)


def _run(op, q, k, v, do, mask, causal, backend, sinks=None):
    """Forward + backward through the public API: ``(out, lse, dq, dk, dv[, dsinks])``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().clone().requires_grad_()
    fn = selection_attention if op == "selection" else block_sparse_attention
    out, lse = fn(*leaves, mask, causal=causal, sinks=s, return_lse=True, backend=backend)
    out.backward(do)
    grads = [t.grad for t in leaves] + ([] if s is None else [s.grad])
    return (out.detach(), lse, *grads)


def _reference(op, q, k, v, do, mask, causal, sinks=None):
    ref = selection_reference if op == "selection" else attention_reference
    return ref(q, k, v, mask, causal=causal, do=do, sinks=sinks)


def _check(got, ref, tol=2e-5):
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, x in zip(names, got):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1])), "lse -inf exactly where the reference's is"
    fin = torch.isfinite(ref[1])
    errs = {n: rel_err(g[fin] if n == "lse" else g, r[fin] if n == "lse" else r) for n, g, r in zip(names, got, ref)}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


def _mask(op, B, Hq, Hkv, Nq, Nk, bs, empty_rows=()):
    if op == "selection":
        return _selection(B, Hkv, Nq, Nk, bs, 3, empty_rows)
    return make_layout(B, Hq, Nq, Nk, bs, density=0.4, empty_rows=tuple(r // bs for r in empty_rows))


# (B, Hq, Hkv, Nq, Nk, D, Dv, block, causal, empty rows)
CASES = [
    pytest.param(2, 4, 2, 37, 53, 16, 16, 4, False, (), id="gqa-bs4-full"),
    pytest.param(1, 4, 1, 40, 70, 16, 24, 16, "bottom_right", (), id="mqa-bs16-Dv24-bottom-right"),
    pytest.param(2, 2, 2, 33, 33, 24, 8, 8, True, (8, 9, 10, 11, 12, 13, 14, 15), id="mha-Dv8-causal-empty-rows"),
    pytest.param(1, 4, 2, 3, 61, 16, 40, 16, "bottom_right", (), id="decode-Nq3-Dv40"),
    pytest.param(1, 2, 1, 1, 45, 20, 24, 4, "bottom_right", (), id="decode-Nq1-D20-Dv24"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["selection", "block_sparse"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,Dv,bs,causal,empty_rows", CASES)
def test_sinks_and_value_dim_match_float64(op, backend, B, Hq, Hkv, Nq, Nk, D, Dv, bs, causal, empty_rows):
    mask = _mask(op, B, Hq, Hkv, Nq, Nk, bs, empty_rows)
    q, k, do = torch.randn(B, Hq, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, Hq, Nq, Dv)
    v = torch.randn(B, Hkv, Nk, Dv)
    sinks = torch.randn(Hq)
    sinks[-1] = float("-inf")                 # a head without a sink
    for s in (sinks, None):
        got = _run(op, q, k, v, do, mask, causal, backend, s)
        ref = _reference(op, q, k, v, do, mask, causal, s)
        _check(got, ref)
        assert got[0].shape == (B, Hq, Nq, Dv) and got[4].shape == v.shape


# Triton (the interpreter, fp32): the sink folded where each kernel stores its rows: the block-sparse
# forward and decode (one split, and split-K with the merge), the selection query-major, key-major
# (merge) and element-masked forwards and its decode. (B, Hq, Hkv, Nq, Nk, D, block, causal, empty rows)
TRITON_SINK_CASES = [
    pytest.param(2, 4, 2, 37, 53, 16, 16, False, (), id="gqa-bs16"),
    pytest.param(1, 2, 2, 48, 48, 16, 16, True, (16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31),
                 id="causal-empty-rows"),
    pytest.param(1, 4, 2, 3, 61, 16, 16, "bottom_right", (), id="decode-Nq3"),
    pytest.param(1, 2, 1, 1, 2100, 16, 16, "bottom_right", (), id="decode-split-K"),
]


@pytest.mark.parametrize("op,family", [("block_sparse", None), ("selection", None), ("selection", "query"),
                                       ("selection", "masked")],
                         ids=["block_sparse", "selection-auto", "selection-query", "selection-masked"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,bs,causal,empty_rows", TRITON_SINK_CASES)
def test_triton_sinks_match_float64(monkeypatch, op, family, B, Hq, Hkv, Nq, Nk, D, bs, causal, empty_rows):
    from sparse_io_attn._triton.runtime import INTERPRET
    from sparse_io_attn.selection.tiles import FAMILY_ENV

    if not INTERPRET:
        pytest.skip("CPU tensors: run under Triton's interpreter")
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    long = Nk > 1000                          # decode split over the keys (merged with the sink folded in)
    if op == "block_sparse":
        mask = make_layout(B, Hq, Nq, Nk, bs, density=1.0 if long else 0.4,
                           empty_rows=tuple(r // bs for r in empty_rows))
    else:
        mask = _selection(B, Hkv, Nq, Nk, bs, 60 if long else 3, empty_rows)
    q, k, v, do = torch.randn(B, Hq, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, Hkv, Nk, D), \
        torch.randn(B, Hq, Nq, D)
    sinks = torch.randn(Hq) * 2
    sinks[-1] = float("-inf")                 # a head without a sink
    got = _run(op, q, k, v, do, mask, causal, "triton", sinks)
    _check(got, _reference(op, q, k, v, do, mask, causal, sinks))


@pytest.mark.parametrize("backend", BACKENDS + ("triton",))
@pytest.mark.parametrize("op", ["selection", "block_sparse"])
def test_row_without_keys_with_a_sink(op, backend):
    """No allowed key: output 0, lse = the sink (the row's only term), zero dq, and the sink's gradient
    from the other rows only; without a sink (-inf) the row stays empty (lse -inf)."""
    from sparse_io_attn._triton.runtime import INTERPRET

    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: run under Triton's interpreter")
    B, Hq, Hkv, N, D = 1, 2, 1, 16, 16
    bs = 16 if backend == "triton" else 4     # (Triton's blocks: a power-of-two divisor >= 16)
    if op == "selection":
        mask = Selection(torch.full((1, N, 2), -1), bs)
    else:
        mask = make_layout(B, Hq, N, N, bs, fill=False)
    q, k, v, do = torch.randn(B, Hq, N, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hq, N, D)
    sinks = torch.tensor([0.7, float("-inf")])
    out, lse, dq, dk, dv, dsinks = _run(op, q, k, v, do, mask, False, backend, sinks)
    assert (out == 0).all() and (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    torch.testing.assert_close(lse[0, 0], torch.full((N,), 0.7), rtol=1e-6, atol=1e-6)   # 0.7 log2(e) ln 2
    assert torch.isneginf(lse[0, 1]).all()
    assert (dsinks == 0).all()


def test_fold_sinks_equals_a_score_column():
    """The torch paths' fold against softmax over ``[scores, sink]`` in float64 (non-empty, empty,
    -inf sink, large logits)."""
    Hq, n = 3, 20
    s = torch.randn(2, Hq, 5, n, dtype=torch.float64) * 30
    s[0, 0, 1] = float("-inf")                                   # a row without keys
    sinks = torch.tensor([1.5, 40.0, float("-inf")])
    v = torch.randn(2, Hq, n, 4, dtype=torch.float64)
    m = s.amax(-1)
    empty = torch.isneginf(m)
    p = torch.exp2((s - torch.where(empty, 0.0, m)[..., None]) * 1.4426950408889634)
    l = p.sum(-1)
    out = torch.where(empty[..., None], 0.0, (p @ v) / l.clamp(min=1e-300)[..., None])
    m2 = torch.where(empty, float("inf"), m * 1.4426950408889634)
    log2l = torch.where(empty, 0.0, torch.log2(l))
    got_out, got_lse, _, _ = fold_sinks(out.float(), m2.float(), log2l.float(), sinks)
    full = torch.cat([s, sinks.view(1, Hq, 1, 1).expand(2, Hq, 5, 1).double()], -1)
    lse = torch.logsumexp(full, -1)
    ref_out = torch.softmax(full, -1)[..., :n] @ v
    ref_out[0, 2] = torch.where(torch.isneginf(lse[0, 2])[..., None], 0.0, ref_out[0, 2])
    assert rel_err(got_out, torch.nan_to_num(ref_out)) < 1e-6
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(lse))
    fin = torch.isfinite(lse)
    assert rel_err(got_lse[fin], lse[fin]) < 1e-6


# ------------------------------------------------------------------------ bf16: delta from fp32
def _nsa_selection(T, H, S, bs):
    """native-sparse-attention's test selection: up to S distinct earlier blocks per token, sorted,
    padding T, a random count in 1..S."""
    idx = torch.full((1, H, T, S), T, dtype=torch.long)
    for t in range(T):
        for h in range(H):
            pick = torch.randperm(max(1, math.ceil(t / bs)))[:S]
            idx[0, h, t, :len(pick)] = pick
    return Selection(idx.sort(-1).values, bs, torch.randint(1, S + 1, (1, H, T)))


def _err_ratio(ref, x):
    """native-sparse-attention's get_err_ratio: rms(ref - x) / rms(ref)."""
    ref = ref.double()
    return ((ref - x.double()).square().mean().sqrt() / ref.square().mean().sqrt()).item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_gradients_within_native_sparse_attention_ratio(backend):
    """native-sparse-attention's test data (linspace(0, 1) permuted along the sequence, broadcast over
    heads and head dim, scale 0.1, blocks of 32, S = 16; here T = 128, 16 query heads) in bf16: every
    tensor within the peer's 5e-3 ratio of float64. With delta from the bf16-rounded output dq was
    6-7e-2 off on these data (benchmarks/results/bf16_gradients.md)."""
    T, H, HQ, D, S, bs = 128, 2, 16, 64, 16, 32
    line = lambda h: torch.linspace(0, 1, T)[torch.randperm(T)].view(1, 1, T, 1).expand(1, h, T, D).to(torch.bfloat16)  # noqa: E731
    q, k, v = line(HQ), line(H), line(H)
    do = torch.randn(1, HQ, T, D).to(torch.bfloat16)
    sel = _nsa_selection(T, H, S, bs)
    ref = selection_reference(q, k, v, sel, causal=True, sm_scale=0.1, do=do)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = selection_attention(*leaves, sel, causal=True, sm_scale=0.1, backend=backend, check=False)   # padding T
    out.backward(do)
    for name, r, x in zip(("o", "dq", "dk", "dv"), (ref[0], *ref[2:]), (out, *(t.grad for t in leaves))):
        assert _err_ratio(r, x) < 5e-3, f"{name}: {_err_ratio(r, x):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["selection", "block_sparse"])
def test_bf16_sinks_gradient_close_to_float64(op, backend):
    """bf16 with sinks: the sink's gradient (formed from the fp32 row deltas) within 1e-2 of float64;
    outputs and input gradients within their bf16 rounding."""
    B, Hq, Hkv, N, D = 1, 4, 2, 48, 32
    mask = _mask(op, B, Hq, Hkv, N, N, 8)
    q, k, v, do = (torch.randn(B, h, N, D).to(torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    sinks = torch.randn(Hq)
    got = _run(op, q, k, v, do, mask, True, backend, sinks)
    ref = _reference(op, q, k, v, do, mask, True, sinks)
    for name, x, r in zip(("out", "dq", "dk", "dv", "dsinks"), (got[0], *got[2:]), (ref[0], *ref[2:])):
        assert rel_err(x, r) < 1e-2, f"{name}: {rel_err(x, r):.2e}"


@pytest.mark.parametrize("backend", BACKENDS + ("triton",))
def test_residual_only_when_a_gradient_is_needed(backend):
    """The forward op returns the output's rounding residual for low-precision calls that need a
    gradient, an empty tensor otherwise (fp32, no_grad, no input requiring grad)."""
    from sparse_io_attn.selection.op import selection_attn_fwd
    from sparse_io_attn.selection.plan import plan_selection
    sel = _selection(1, 2, 20, 20, 4, 3)
    plan = plan_selection(sel, 20).register()
    args = lambda q: (q, q[:, :2], q[:, :2], plan.rows, plan.row_counts, None, list(plan.meta), None, 0.25, backend)  # noqa: E731
    q = torch.randn(1, 4, 20, 16)
    for dtype, residual, made in ((torch.bfloat16, True, True), (torch.bfloat16, False, False),
                                  (torch.float32, True, False)):
        out, _, _, res = selection_attn_fwd(*args(q.to(dtype)), None, residual)
        assert res.numel() == (out.numel() if made else 0)
        if made:
            o32 = out.float() + res.float()
            assert not torch.equal(o32, out.float()), "the residual carries the digits the rounding dropped"


@pytest.mark.parametrize("op,family", [("block_sparse", None), ("selection", "query"), ("selection", "key"),
                                       ("selection", "masked")],
                         ids=["block_sparse", "selection-query", "selection-key", "selection-masked"])
def test_triton_16bit_delta_from_the_fp32_output(monkeypatch, op, family):
    """Triton's 16-bit backward forms its row deltas from the fp32 output (the forward's rounding residual,
    read by the preprocess): on native-sparse-attention's kind of data (a permuted linspace broadcast over
    the head dim, scale 0.1) in fp16, dq within 1e-3 of float64 (ratio of rms errors; 2.0-2.1e-4 here, as the
    torch backend's), where the deltas from the fp16-rounded output leave it at 5.8e-3 (selection) / 5.0e-3
    (block-sparse). fp16 because the
    interpreter's fp16 dots round as a GPU's do and its bf16 dots do not."""
    from sparse_io_attn._triton.runtime import INTERPRET
    from sparse_io_attn.selection.tiles import FAMILY_ENV

    if not INTERPRET:
        pytest.skip("CPU tensors: run under Triton's interpreter")
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    torch.manual_seed(0)
    T, H, HQ, D, S, bs = 64, 1, 4, 32, 4, 16
    line = lambda h: torch.linspace(0, 1, T)[torch.randperm(T)].view(1, 1, T, 1).expand(1, h, T, D).half()  # noqa: E731
    q, k, v = line(HQ), line(H), line(H)
    do = torch.randn(1, HQ, T, D).half()
    mask = _nsa_selection(T, H, S, bs) if op == "selection" else make_layout(1, HQ, T, T, bs, density=0.6)
    fn, ref_fn = ((selection_attention, selection_reference) if op == "selection"
                  else (block_sparse_attention, attention_reference))
    ref = ref_fn(q, k, v, mask, causal=True, sm_scale=0.1, do=do)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, mask, causal=True, sm_scale=0.1, backend="triton",
             **({"check": False} if op == "selection" else {}))      # (the peer pads its selections with T)
    out.backward(do)
    errs = {n: _err_ratio(r, x) for n, r, x in zip(("o", "dq", "dk", "dv"), (ref[0], *ref[2:]),
                                                     (out, *(t.grad for t in leaves)))}
    assert max(errs.values()) < 1e-3, errs


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("sinks,err,match", [
    pytest.param(torch.zeros(3), ValueError, r"sinks must have shape \[num_heads_q\] = \[2\]", id="shape"),
    pytest.param(torch.zeros(2, dtype=torch.int64), TypeError, "sinks has dtype torch.int64", id="dtype"),
    pytest.param([0.0, 1.0], TypeError, "sinks must be a tensor", id="list"),
    pytest.param(torch.tensor([0.0, float("nan")]), ValueError, "NaN or \\+inf at head 1", id="nan"),
    pytest.param(torch.tensor([float("inf"), 0.0]), ValueError, "NaN or \\+inf at head 0", id="posinf"),
])
@pytest.mark.parametrize("op", ["selection", "block_sparse"])
def test_bad_sinks(op, sinks, err, match):
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16)
    fn = selection_attention if op == "selection" else block_sparse_attention
    with pytest.raises(err, match=match):
        fn(q, k, k, _mask(op, 1, 2, 1, 8, 8, 4), sinks=sinks, backend="torch")


def test_value_shape_must_match_keys_but_head_dim():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=r"k and v must have the same shape but for v's head dim"):
        selection_attention(q, k, torch.randn(1, 1, 9, 16), _selection(1, 1, 8, 8, 4, 2), backend="torch")
    with pytest.raises(ValueError, match=r"q has head_dim 16 and k has 8"):
        selection_attention(q, k[..., :8], k, _selection(1, 1, 8, 8, 4, 2), backend="torch")
