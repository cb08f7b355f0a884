"""Packed variable-length batches (``cu_seqlens``) on ``selection_attention``, the selectors and
``NativeSparseAttention``, backends ``cpu`` (both kernel families) and ``torch`` (Triton:
``test_triton_varlen.py``): against the float64
reference of the same local selection (each sequence expanded on its own), against separate calls per
sequence, and against the transcribed peers (MoBA's ``moba_attn_varlen_naive``, fla's varlen
``naive_nsa_topk`` + ``naive_nsa_selection`` and its NSA layer). Edge cases: a sequence shorter than a
block, an empty sequence, sequence boundaries inside a block, ragged last blocks, GQA and G in
{1, Hkv, Hq}, both causal alignments, queries and keys of different lengths (decode), flash-attention's
``[total, H, D]`` layout, sinks and a V head dim of its own."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import no_host_sync
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.nn import NativeSparseAttention, selectors
from sparse_io_attn.nn.nsa import NSAAttention
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference
from sparse_io_attn.selection.varlen import varlen_of

from .selector_checks import close
from .test_correctness import _cpu_kernel_present  # noqa: F401 (autouse fixture)
from .transcribed import moba as moba_ref
from .transcribed import nsa as fla

BACKENDS = ["torch", "cpu-key", "cpu-query"]


@pytest.fixture
def backend(request, monkeypatch):
    """``cpu-key`` / ``cpu-query``: backend ``cpu`` with its kernel family forced."""
    name = request.param
    if name.startswith("cpu"):
        from sparse_io_attn._cpu import build
        if not build.is_available():
            pytest.skip(f"the C++ kernels cannot be built here: {build.unavailable_reason()}")
        monkeypatch.setenv("SPARSE_IO_ATTN_SELECTION_FAMILY", name[4:])
        return "cpu"
    return name


def offsets(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def local_selection(lead, lens_q, lens_k, K, bs):
    """Random local blocks of each token's sequence, a quarter of the slots empty."""
    cu = offsets(lens_q)
    T = int(cu[-1])
    seq = torch.searchsorted(cu[1:].long(), torch.arange(T), right=True)
    nb = torch.tensor([math.ceil(n / bs) for n in lens_k])
    idx = (torch.rand(*lead, T, K) * nb[seq][:, None]).long()
    return Selection(torch.where(torch.rand(idx.shape) < 0.25, -1, idx), bs)


def run(q, k, v, do, sel, backend, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sinks = kwargs.pop("sinks", None)
    s = None if sinks is None else sinks.clone().requires_grad_()
    out, lse = selection_attention(*leaves, sel, sinks=s, return_lse=True, backend=backend, **kwargs)
    out.backward(do)
    return (out.detach(), lse, *(t.grad for t in leaves), *(() if s is None else (s.grad,)))


def check(got, ref, tol=2e-5):
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(ref[1]))
    fin = torch.isfinite(ref[1])
    for i, (g, r) in enumerate(zip(got, ref)):
        assert not torch.isnan(g).any()
        err = rel_err(g[fin], r[fin]) if i == 1 else rel_err(g, r)
        assert err <= tol, f"tensor {i}: {err:.2e}"


# (lens_q, lens_k or None, Hq, Hkv, G, D, Dv, block, K, causal)
CASES = [
    pytest.param([37, 50, 9], None, 4, 2, 2, 16, 16, 4, 5, True, id="gqa-Ghkv-bs4-ragged-causal"),
    pytest.param([16, 33, 0, 20], None, 4, 2, 4, 16, 24, 16, 3, "bottom_right", id="Ghq-bs16-empty-seq-Dv24"),
    pytest.param([3, 40, 13], None, 2, 1, 1, 16, 16, 16, 2, True, id="mqa-G1-seq-shorter-than-block"),
    pytest.param([1, 1, 1], [40, 17, 3], 4, 2, 2, 16, 16, 4, 6, "bottom_right", id="decode-one-query-each"),
    pytest.param([5, 12], [9, 30], 2, 2, 2, 16, 16, 8, 3, False, id="not-causal-q-k-lengths-differ"),
    pytest.param([30, 19], None, 2, 1, 1, 16, 16, 1, 12, True, id="single-tokens"),
]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,G,D,Dv,bs,K,causal", CASES)
def test_matches_float64_reference(backend, lens_q, lens_k, Hq, Hkv, G, D, Dv, bs, K, causal):
    lens_k = lens_k or lens_q
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    T, Tk = int(cu_q[-1]), int(cu_k[-1])
    sel = local_selection((G,), lens_q, lens_k, K, bs)
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, Tk, D), torch.randn(1, Hkv, Tk, Dv)
    do, sinks = torch.randn(1, Hq, T, Dv), torch.randn(Hq)
    cu = cu_q if lens_k == lens_q else (cu_q, cu_k)
    for s in (None, sinks):
        got = run(q, k, v, do, sel, backend, causal=causal, cu_seqlens=cu, sinks=s)
        check(got, selection_reference(q, k, v, sel, causal=causal, do=do, sinks=s, cu_seqlens=cu))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_packed_equals_one_call_per_sequence(backend):
    lens, Hq, Hkv, D, bs = [23, 41, 8], 4, 2, 16, 8
    cu = offsets(lens)
    sel = local_selection((Hkv,), lens, lens, 4, bs)
    q, k, v, do = (torch.randn(1, h, int(cu[-1]), D) for h in (Hq, Hkv, Hkv, Hq))
    packed = run(q, k, v, do, sel, backend, causal=True, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = run(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], do[:, :, a:b], Selection(sel.indices[:, a:b], bs), backend,
                  causal=True)
        for x, y in zip(packed, one):
            torch.testing.assert_close(x[..., a:b, :] if x.dim() == 4 else x[..., a:b], y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpu-key"], indirect=True)
def test_flash_attention_layout(backend):
    """``[total, H, D]`` inputs give ``[total, Hq, Dv]`` out and ``[Hq, total]`` lse, as the packed call."""
    lens, bs = [20, 12], 4
    cu = offsets(lens)
    sel = local_selection((2,), lens, lens, 3, bs)
    q, k, v = torch.randn(32, 2, 16), torch.randn(32, 2, 16), torch.randn(32, 2, 8)
    out, lse = selection_attention(q, k, v, sel, cu_seqlens=cu, causal=True, return_lse=True, backend=backend)
    ref, ref_lse = selection_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), sel, cu_seqlens=cu,
                                       causal=True, return_lse=True, backend=backend)
    assert out.shape == (32, 2, 8) and lse.shape == (2, 32)
    assert torch.equal(out, ref[0].transpose(0, 1)) and torch.equal(lse, ref_lse[0])


def test_plan_builds_without_host_sync():
    """With unchecked offsets the packed plan is tensor operations of fixed shapes."""
    lens, bs = [13, 0, 29], 4
    cu = offsets(lens)
    sel = local_selection((2,), lens, lens, 3, bs)
    vl = varlen_of(cu, 42, 42, True, torch.device("cpu"), check=False)
    with no_host_sync():
        plan = plan_selection(sel, 42, causal_offset=0, varlen=vl)
        plan.keys()
    assert plan.table.shape == (2 * (42 // bs + 3) + 42,)


# ---------------------------------------------------------------------------------- transcribed peers
@pytest.mark.parametrize("backend", ["torch", "cpu-key"], indirect=True)
@pytest.mark.parametrize("chunk,topk", [(8, 3), (5, 2)])
def test_moba_varlen_equals_moba_attn_varlen_naive(backend, chunk, topk):
    """MoBA's own varlen reference (chunks restart per sequence) against the moba selector + selection
    attention with the same cu_seqlens (fp32 vs the float64 reference on the same values)."""
    lens, H, D = [37, 50, 9], 3, 16
    cu = offsets(lens)
    q, k, v = (torch.randn(int(cu[-1]), H, D) for _ in range(3))
    ref = moba_ref.moba_attn_varlen_naive(*(t.double() for t in (q, k, v)), cu.long(), max(lens), chunk, topk,
                                          compute_dtype=torch.float64)
    qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
    sel = selectors.moba(chunk, topk)(qb, kb, cu_seqlens=cu)
    out = selection_attention(qb, kb, vb, sel, causal=True, cu_seqlens=cu, backend=backend)
    assert rel_err(out[0].transpose(0, 1), ref) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "cpu-query"], indirect=True)
def test_nsa_varlen_equals_fla_naive_nsa(backend):
    """fla's varlen naive_nsa_topk (blocks and compressed keys per sequence) chooses what the nsa
    selector chooses per token (as sets), and naive_nsa_selection over those blocks equals
    selection attention with the same cu_seqlens, output and gradients."""
    lens, HQ, H, D, BS, S = [45, 20, 3, 33], 4, 2, 16, 4, 3
    cu = offsets(lens)
    T = int(cu[-1])
    q, k, v = torch.randn(1, T, HQ, D), torch.randn(1, T, H, D), torch.randn(1, T, H, D)
    sel = selectors.nsa(BS, S)(q.transpose(1, 2), k.transpose(1, 2), cu_seqlens=cu)
    k_cmp = fla.mean_pooling(k, BS, cu.long())
    idx = fla.naive_nsa_topk(q, k_cmp, S, BS, D ** -0.5, cu_seqlens=cu.long())
    width = max(math.ceil(n / BS) for n in lens)
    as_set = lambda x: [set(r.tolist()) - {-1} for r in x.reshape(-1, x.shape[-1])]  # noqa: E731
    assert as_set(sel.indices.transpose(1, 2)) == as_set(idx) and width > 0
    do = torch.randn(1, T, HQ, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = fla.naive_nsa_selection(*leaves, idx, BS, cu_seqlens=cu.long())
    ref = (ref.detach(), *torch.autograd.grad(ref, leaves, do))
    mine = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    out = selection_attention(*mine, sel, causal=True, cu_seqlens=cu, backend=backend)
    got = [g.transpose(1, 2) for g in (out.detach(), *torch.autograd.grad(out, mine, do.transpose(1, 2)))]
    assert not close(got, ref), close(got, ref)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("lens,window", [([45, 20, 3], 6), ([33, 40], 100), ([17, 2, 33], 0)],
                         ids=["gqa-w6", "S12-window-over-T", "no-window"])
def test_nsa_layer_varlen_matches_fla_layer(backend, lens, window):
    if backend == "cpu":
        from sparse_io_attn._cpu import build
        if not build.is_available():
            pytest.skip(build.unavailable_reason())
    E, HQ, H, D, BS, S = 32, 4, 2, 16, 4, 3
    cu = offsets(lens)
    layer = NativeSparseAttention(E, HQ, H, head_dim=D, block_size=BS, num_blocks=S, window=window, backend=backend,
                                  layout_block_size=16)
    x = torch.randn(1, int(cu[-1]), E, requires_grad=True)
    out = layer(x, cu_seqlens=cu)
    do = torch.randn_like(out)
    params = [x] + list(layer.parameters())
    got = (out, *torch.autograd.grad(out, params, do))
    sd = {n: p.detach().requires_grad_() for n, p in layer.state_dict().items()}
    xr = x.detach().requires_grad_()
    ref = fla.nsa_layer_reference_from_state_dict(xr, sd, cu_seqlens=cu.long(), num_heads=HQ, num_kv_heads=H,
                                                  head_dim=D, block_size=BS, block_counts=S, window_size=window,
                                                  check_group_size=False)
    ref = (ref, *torch.autograd.grad(ref, [xr] + [sd[n] for n, _ in layer.named_parameters()], do))
    assert not close(list(got), list(ref)), close(list(got), list(ref))
    alone = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)


def test_nsa_attention_packed_equals_each_sequence_and_refuses_a_cache():
    """``NSAAttention(..., cu_seqlens=)`` (the layer's packed path) equals one call per sequence, its
    ``sm_scale`` reaching every branch; a decode state or a KV cache with ``cu_seqlens`` is refused."""
    attn = NSAAttention(4, 3, 6, backend="torch")
    cu = offsets([13, 6, 20])
    T = int(cu[-1])
    q, k, v, g = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8), torch.rand(1, T, 4, 3)
    out, sel = attn(q, k, v, g, cu_seqlens=cu, sm_scale=0.3, return_selection=True)
    assert sel.indices.shape[-2] == T
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    alone = torch.cat([attn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], g[:, a:b], sm_scale=0.3) for a, b in spans], 1)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)
    assert rel_err(attn(q, k, v, g, cu_seqlens=cu), out) > 1e-3          # the scale changed every branch
    with pytest.raises(NotImplementedError, match="state= with cu_seqlens="):
        attn(q, k, v, g, state=attn.init_state(), cu_seqlens=cu)
    layer = NativeSparseAttention(32, 4, 2, head_dim=8, block_size=4, num_blocks=3, window=6, backend="torch")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="a KV cache with cu_seqlens"):
        layer(torch.randn(1, T, 32), cache=layer.init_cache(), cu_seqlens=cu)


def test_selectors_choose_per_sequence():
    """MoBA, NSA and the lightning indexer on packed sequences choose, row for row, the blocks (keys)
    they choose on each sequence alone (as sets: the packed call may pad differently)."""
    lens = [37, 50, 9, 64]
    cu = offsets(lens)
    T = int(cu[-1])
    q, k = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16)
    iq, ik, w = torch.randn(1, 3, T, 8), torch.randn(1, T, 8), torch.rand(1, 3, T)
    sets = lambda x: [set(r.tolist()) - {-1} for r in x.reshape(-1, x.shape[-1])]  # noqa: E731
    calls = [(lambda a, b, **kw: selectors.moba(8, 3)(q[:, :, a:b], k[:, :, a:b], **kw),
              lambda **kw: selectors.moba(8, 3)(q, k, **kw)),
             (lambda a, b, **kw: selectors.nsa(5, 3)(q[:, :, a:b], k[:, :, a:b], **kw),
              lambda **kw: selectors.nsa(5, 3)(q, k, **kw)),
             (lambda a, b, **kw: selectors.lightning_topk(iq[:, :, a:b], ik[:, a:b], w[:, :, a:b], 6, **kw),
              lambda **kw: selectors.lightning_topk(iq, ik, w, 6, **kw))]
    for one, packed in calls:
        got = packed(cu_seqlens=cu).indices
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert sets(one(a, b).indices) == sets(got[..., a:b, :])


# ----------------------------------------------------------------------------------------- bad input
def _call(**kw):
    lens = kw.pop("lens", [5, 7])
    q = kw.pop("q", torch.randn(1, 2, 12, 8))
    sel = kw.pop("sel", local_selection((1,), lens, lens, 2, 4))
    return selection_attention(q, q, q, sel, causal=True, backend=kw.pop("backend", "torch"), **kw)


@pytest.mark.parametrize("kw,err,match", [
    pytest.param({"cu_seqlens": torch.tensor([0.0, 5.0, 12.0])}, TypeError, "int32/int64 tensor", id="float"),
    pytest.param({"cu_seqlens": torch.tensor([1, 5, 12])}, ValueError, "must start at 0", id="not-from-0"),
    pytest.param({"cu_seqlens": torch.tensor([0, 5, 11])}, ValueError, "end at the packed length 12", id="short"),
    pytest.param({"cu_seqlens": torch.tensor([0, 7, 5, 12])}, ValueError, "decreasing", id="decreasing"),
    pytest.param({"cu_seqlens": torch.tensor([0, 5, 12]), "max_seqlen": 6}, ValueError, "max_seqlen is 6",
                 id="max-seqlen"),
    pytest.param({"cu_seqlens": torch.tensor([0, 12]), "q": torch.randn(2, 2, 12, 8)}, ValueError,
                 "q \\[1, Hq, total, D\\]", id="batch-2"),
    pytest.param({"cu_seqlens": torch.tensor([0, 5, 12]), "sel": Selection(torch.full((1, 12, 1), 2), 4)},
                 ValueError, "past the sequence of query token 0", id="block-past-its-sequence"),
    pytest.param({"cu_seqlens": (torch.tensor([0, 5, 12]), torch.tensor([0, 12]))}, ValueError,
                 "as many sequences", id="pair-mismatch"),
])
def test_bad_input(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)
