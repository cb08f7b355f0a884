"""A V head dim of its own (``Dv != D``) on backend ``triton`` (the interpreter, fp32), for both attention
ops and every kernel: the block-sparse forward, dQ, dK/dV and decode (one split and split-K with the merge);
the selection query-major, key-major and element-masked families (forward and backward) and its decode.
Against the float64 references (with and without sinks), on fresh random inputs: GQA, lengths not a
multiple of the block, rows without a key, both causal alignments, Dv < D and Dv > D at head dims that are
not powers of two, and MLA's 576 / 512 (DeepSeek Sparse Attention, FlashMLA's shapes). The bytes the
kernels count equal the traffic models' with ``head_dim_v`` exactly. (Every block-sparse dK/dV candidate
at a V head dim of its own: tests/block_sparse/test_triton_block_sparse.py.)"""
from __future__ import annotations

import pytest
import torch

from _attention.test_op_extensions import _check, _mask, _reference, _run, _selection
from helpers import make_layout
from sparse_io_attn import block_sparse_attention, selection_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.block_sparse import traffic as bs_traffic
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import traffic as sel_traffic
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.tiles import FAMILY_ENV

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors: run under Triton's interpreter")

# (op, forced selection family): every Triton kernel family of both ops; decode calls (Nq <= 16) run the
# ops' decode kernels whatever the family
FAMILIES = [pytest.param("block_sparse", None, id="block_sparse"), pytest.param("selection", "query", id="sel-query"),
            pytest.param("selection", "key", id="sel-key"), pytest.param("selection", "masked", id="sel-masked")]
OPS = FAMILIES[:2]
EMPTY = tuple(range(16, 32))     # a query block without keys
# (B, Hq, Hkv, Nq, Nk, D, Dv, block, causal, empty rows, sinks)
PREFILL = [
    pytest.param(2, 4, 2, 37, 53, 24, 40, 16, False, (), False, id="gqa-D24-Dv40"),
    pytest.param(1, 2, 2, 48, 48, 48, 16, 16, True, EMPTY, True, id="causal-D48-Dv16-empty-rows-sinks"),
    pytest.param(1, 4, 1, 40, 70, 16, 24, 16, "bottom_right", (), True, id="mqa-bottom-right-D16-Dv24-sinks"),
]
DECODE = [
    pytest.param(1, 4, 2, 3, 61, 48, 16, 16, "bottom_right", (), True, id="decode-Nq3-D48-Dv16-sinks"),
    pytest.param(1, 4, 2, 3, 61, 24, 40, 16, "bottom_right", (), False, id="decode-Nq3-D24-Dv40"),
    pytest.param(1, 2, 1, 1, 1100, 16, 40, 16, "bottom_right", (), True, id="decode-split-K-D16-Dv40-sinks"),
]


def _inputs(B, Hq, Hkv, Nq, Nk, D, Dv):
    return torch.randn(B, Hq, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, Hkv, Nk, Dv), torch.randn(B, Hq, Nq, Dv)


def _long_mask(op, B, Hq, Hkv, Nq, Nk, bs, empty_rows):
    """The cases' masks; a decode against 1100 keys keeps enough of them to be split (merged)."""
    if Nk < 1000:
        return _mask(op, B, Hq, Hkv, Nq, Nk, bs, empty_rows)
    if op == "block_sparse":
        return make_layout(B, Hq, Nq, Nk, bs, density=1.0)
    return _selection(B, Hkv, Nq, Nk, bs, 60)


CASES = [pytest.param(*f.values, *c.values, id=f"{c.id}-{f.id}") for c in PREFILL for f in FAMILIES] + \
    [pytest.param(*f.values, *c.values, id=f"{c.id}-{f.id}") for c in DECODE for f in OPS]


@pytest.mark.parametrize("op,family,B,Hq,Hkv,Nq,Nk,D,Dv,bs,causal,empty_rows,with_sinks", CASES)
def test_triton_value_dim_matches_float64(monkeypatch, op, family, B, Hq, Hkv, Nq, Nk, D, Dv, bs, causal, empty_rows,
                                          with_sinks):
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    mask = _long_mask(op, B, Hq, Hkv, Nq, Nk, bs, empty_rows)
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, D, Dv)
    sinks = None
    if with_sinks:
        sinks = torch.randn(Hq) * 2
        sinks[-1] = float("-inf")             # a head without a sink
    got = _run(op, q, k, v, do, mask, causal, "triton", sinks)
    _check(got, _reference(op, q, k, v, do, mask, causal, sinks))
    assert got[0].shape == (B, Hq, Nq, Dv) and got[2].shape == q.shape and got[4].shape == v.shape


@pytest.mark.parametrize("op,family", OPS)
@pytest.mark.parametrize("Nq", [20, 2], ids=["prefill", "decode"])
def test_triton_mla_576_512(monkeypatch, op, family, Nq):
    """DeepSeek Sparse Attention on MLA: q/k rows of 576 (latent 512 + rope 64), v rows of 512."""
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    B, Hq, Hkv, Nk, bs = 1, 2, 1, 40, 16
    mask = _mask(op, B, Hq, Hkv, Nq, Nk, bs)
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, 576, 512)
    got = _run(op, q, k, v, do, mask, "bottom_right", "triton")
    _check(got, _reference(op, q, k, v, do, mask, "bottom_right"))


# (B, Hq, Hkv, Nq, Nk, D, Dv, block, causal): prefill, decode with one split, decode split-K
COUNT_PREFILL = [
    pytest.param(1, 4, 2, 45, 70, 24, 40, 16, True, id="prefill-D24-Dv40"),
    pytest.param(2, 2, 1, 37, 53, 48, 16, 16, "bottom_right", id="prefill-D48-Dv16"),
]
COUNT_DECODE = [
    pytest.param(1, 4, 2, 3, 61, 40, 24, 16, "bottom_right", id="decode-D40-Dv24"),
    pytest.param(1, 2, 1, 1, 1100, 16, 40, 16, "bottom_right", id="decode-split-K-D16-Dv40"),
]
COUNT_CASES = [pytest.param(*f.values, *c.values, id=f"{c.id}-{f.id}") for c in COUNT_PREFILL for f in FAMILIES] + \
    [pytest.param(*f.values, *c.values, id=f"{c.id}-{f.id}") for c in COUNT_DECODE for f in OPS]


@pytest.mark.parametrize("op,family,B,Hq,Hkv,Nq,Nk,D,Dv,bs,causal", COUNT_CASES)
def test_counted_equals_predicted_with_value_dim(monkeypatch, op, family, B, Hq, Hkv, Nq, Nk, D, Dv, bs, causal):
    """Q/K/dQ/dK bytes at D, V/O/dO/dV and the fp32 partial rows at Dv: the counters equal the models."""
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    mask = _long_mask(op, B, Hq, Hkv, Nq, Nk, bs, ())
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, D, Dv)
    with IOCounter() as fwd_io:
        out = _run_forward(op, q, k, v, mask, causal)
    with IOCounter() as bwd_io:
        out.backward(do)
    if op == "block_sparse":
        args = (mask, B, Hq, Hkv, D, torch.float32)
        want_fwd = bs_traffic.block_sparse_forward(*args, causal=causal, head_dim_v=Dv)
        want_bwd = bs_traffic.block_sparse_backward(*args, causal=causal, head_dim_v=Dv)
    else:
        plan = plan_selection(mask, Nk, causal_offset=causal_offset(causal, Nq, Nk))
        args = (plan, B, Hq, Hkv, D, torch.float32)
        want_fwd = sel_traffic.selection_forward(*args, head_dim_v=Dv)
        want_bwd = sel_traffic.selection_backward(*args, head_dim_v=Dv)
    assert fwd_io.report == want_fwd, f"{fwd_io.report}\n{want_fwd}"
    assert (Nk > 1000) == any(n.endswith("decode_merge") for n in fwd_io.report.kernels)   # split-K: merged
    assert bwd_io.report == want_bwd, f"{bwd_io.report}\n{want_bwd}"
    assert fwd_io.report.total_bytes != (bs_traffic.block_sparse_forward(*args, causal=causal) if op == "block_sparse"
                                         else sel_traffic.selection_forward(*args)).total_bytes


def _run_forward(op, q, k, v, mask, causal):
    leaves = [t.requires_grad_() for t in (q, k, v)]
    fn = selection_attention if op == "selection" else block_sparse_attention
    return fn(*leaves, mask, causal=causal, backend="triton")


@pytest.mark.parametrize("op,family", FAMILIES)
def test_fp16_training_step_counted_equals_predicted(monkeypatch, op, family):
    """A 16-bit training step at D 24 / Dv 40 (the fp16 dots of the interpreter are a GPU's): the forward
    writes the output's rounding residual (Dv wide), the preprocess reads it, and the counters equal the
    models of a training step (``traffic.block_sparse`` / ``traffic.selection`` with ``head_dim_v``)."""
    if family is not None:
        monkeypatch.setenv(FAMILY_ENV, family)
    B, Hq, Hkv, Nq, Nk, D, Dv, bs = 1, 4, 2, 37, 53, 24, 40, 16
    mask = _long_mask(op, B, Hq, Hkv, Nq, Nk, bs, ())
    q, k, v, do = (t.half() for t in _inputs(B, Hq, Hkv, Nq, Nk, D, Dv))
    with IOCounter() as io:
        out = _run_forward(op, q, k, v, mask, True)
        out.backward(do)
    if op == "block_sparse":
        want = bs_traffic.block_sparse(mask, B, Hq, Hkv, D, torch.float16, causal=True, head_dim_v=Dv)
        fwd, pre = "attn_fwd", "attn_bwd_preprocess"
    else:
        plan = plan_selection(mask, Nk, causal_offset=causal_offset(True, Nq, Nk))
        want = sel_traffic.selection(plan, B, Hq, Hkv, D, torch.float16, head_dim_v=Dv)
        fwd = {"query": "selection_fwd", "key": "selection_key_merge", "masked": "selection_masked_fwd"}[family]
        pre = "selection_bwd_preprocess"
    assert io.report == want, f"{io.report}\n{want}"
    assert io.report.kernels[fwd].writes["residual"] == io.report.kernels[pre].reads["residual"] == B * Hq * Nq * Dv * 2
