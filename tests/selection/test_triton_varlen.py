"""Packed variable-length batches (``cu_seqlens``) on the Triton selection backend: every kernel family
(query-major, key-major, element-masked) and the decode kernels (one split and several), forward and
backward against the float64 reference of the same local selection, with counted == predicted bytes
(exact integers) for each. Edge cases: no causality, top-left and bottom-right, a pair (cu_seqlens_q,
cu_seqlens_k) of different lengths, sequences not a multiple of the block and shorter than one, a
zero-length sequence, GQA, selections shared by heads, rows with no block, sinks; blocks smaller
than the query-major key step (several blocks per step) and larger (several steps, several dK/dV key
tiles per block). The MoBA and NSA selectors' packed selections on Triton equal the C++ backend.
Interpreter cases stay tiny."""
import math

import pytest
import torch

from helpers import check_close
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.nn import selectors
from sparse_io_attn.selection import tiles
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference
from sparse_io_attn.selection.triton import launch
from sparse_io_attn.selection.varlen import varlen_of

DEVICE = "cpu" if INTERPRET else "cuda"


def offsets(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def local_selection(G, lens_q, lens_k, K, bs, empty=()) -> Selection:
    """Random local blocks of each token's sequence (a quarter of the slots empty, slot 1 repeating slot
    0), the rows ``empty`` without any."""
    cu = offsets(lens_q).cpu()
    T = int(cu[-1])
    seq = torch.searchsorted(cu[1:].long(), torch.arange(T), right=True)
    nb = torch.tensor([math.ceil(n / bs) for n in lens_k])
    idx = (torch.rand(G, T, K) * nb[seq][:, None]).long()
    idx = torch.where(torch.rand(idx.shape) < 0.25, -1, idx)
    if K > 1:
        idx[..., 1] = idx[..., 0]
    for t in empty:
        idx[:, t] = -1
    return Selection(idx.to(DEVICE), bs)


def packed_plan(sel, lens_q, lens_k, causal):
    cu = offsets(lens_q) if lens_k is None else (offsets(lens_q), offsets(lens_k))
    Nq, Nk = sum(lens_q), sum(lens_k or lens_q)
    vl = varlen_of(cu, Nq, Nk, causal, torch.device(DEVICE))
    return plan_selection(sel, Nk, causal_offset=None if vl.causal is None else 0, varlen=vl), cu


def run_counted(q, k, v, do, plan, family, sinks=None, decode=False, split_keys=None):
    """Forward (``decode``: the decode kernels, ``split_keys`` passed on) + backward of ``family`` through the
    launcher, each counted: ``(outputs, fwd report, bwd report)``."""
    scale = q.shape[-1] ** -0.5
    extra = {} if split_keys is None else {"split_keys": split_keys}
    with IOCounter() as fwd_io:
        out, lse, stats = launch.forward(q, k, v, plan, sm_scale=scale, decode=decode, family_name=family,
                                         sinks=sinks, **extra)
    with IOCounter() as bwd_io:
        dq, dk, dv = launch.backward(do, q, k, v, out, stats, plan, sm_scale=scale, family_name=family)
    return (out, lse, dq, dk, dv), fwd_io.report, bwd_io.report


CASES = [  # (lens_q, lens_k or None, Hq, Hkv, G, D, block, K, causal)
    pytest.param([13, 0, 22], None, 4, 2, 2, 16, 4, 5, True, id="gqa-Ghkv-bs4-empty-seq-top_left"),
    pytest.param([9, 30], [20, 41], 4, 2, 4, 16, 16, 3, "bottom_right", id="Ghq-bs16-q-k-differ-bottom_right"),
    pytest.param([30, 7], None, 2, 1, 1, 16, 32, 2, False, id="mqa-G1-bs32-seq-shorter-than-block-no-causal"),
    pytest.param([5, 17], [150, 60], 2, 2, 2, 16, 100, 2, "bottom_right", id="bs100-key-tiles-ragged"),
    pytest.param([12, 14], None, 2, 2, 2, 16, 1, 6, True, id="tokens-bs1-mha"),
]


@pytest.mark.parametrize("family", ["query", "key", "masked"])
@pytest.mark.parametrize("lens_q, lens_k, Hq, Hkv, G, D, bs, K, causal", CASES)
def test_family_matches_float64_and_counts_equal_the_model(lens_q, lens_k, Hq, Hkv, G, D, bs, K, causal, family):
    torch.manual_seed(0)
    Nq, Nk = sum(lens_q), sum(lens_k or lens_q)
    sel = local_selection(G, lens_q, lens_k or lens_q, K, bs, empty=(Nq // 2,))
    plan, cu = packed_plan(sel, lens_q, lens_k, causal)
    q, do = (torch.randn(1, Hq, Nq, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(1, Hkv, Nk, D, device=DEVICE) for _ in range(2))
    got, fwd, bwd = run_counted(q, k, v, do, plan, family)
    check_close(got, selection_reference(q, k, v, sel, causal=causal, do=do, cu_seqlens=cu))
    assert torch.isneginf(got[1][:, :, Nq // 2]).all() and (got[2][:, :, Nq // 2] == 0).all()
    args = (plan, 1, Hq, Hkv, D, torch.float32)
    want_fwd = traffic.selection_forward(*args, decode=False, family_name=family)
    want_bwd = traffic.selection_backward(*args, family_name=family)
    assert fwd == want_fwd, f"{fwd.table()}\n{want_fwd.table()}"
    assert bwd == want_bwd, f"{bwd.table()}\n{want_bwd.table()}"


def test_the_cases_reach_several_blocks_per_step_and_several_steps_per_block():
    """The query-major family's key steps at the cases' blocks (fp32, D 16): blocks of 4 gathered several per
    step, blocks of 100 in several steps (and dK/dV key tiles)."""
    steps = {bs: tiles.key_step(bs, tiles.kernel_configs("fwd", bs, 16, torch.float32)[0].block_n) for bs in (4, 100)}
    assert steps[4][1] > 1 and steps[100][2] > 1, steps
    assert tiles.family_tiles("key", 100, 16, torch.float32, 1).key_tiles > 1


@pytest.mark.parametrize("split_keys", [None, 8], ids=["one-split", "splits"])
@pytest.mark.parametrize("lens_q, lens_k, bs, causal", [
    ([1, 0, 2, 1], [40, 3, 17, 25], 4, "bottom_right"),
    ([3, 5], [30, 50], 16, False),
    ([6, 2], None, 32, True),
])
def test_decode_matches_float64_and_counts_equal_the_model(lens_q, lens_k, bs, causal, split_keys):
    torch.manual_seed(1)
    Hq, Hkv, G, D = 4, 2, 2, 16
    Nq, Nk = sum(lens_q), sum(lens_k or lens_q)
    sel = local_selection(G, lens_q, lens_k or lens_q, 10, bs)
    plan, cu = packed_plan(sel, lens_q, lens_k, causal)
    q, do = (torch.randn(1, Hq, Nq, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(1, Hkv, Nk, D, device=DEVICE) for _ in range(2))
    got, fwd, _ = run_counted(q, k, v, do, plan, None, decode=True, split_keys=split_keys)
    check_close(got, selection_reference(q, k, v, sel, causal=causal, do=do, cu_seqlens=cu))
    extra = {} if split_keys is None else {"split_keys": split_keys}
    want = traffic.selection_decode_forward(plan, 1, Hq, Hkv, D, torch.float32, **extra)
    assert fwd == want, f"{fwd.table()}\n{want.table()}"
    assert ("selection_decode_merge" in want.kernels) == (split_keys is not None)


@pytest.mark.parametrize("family", ["query", "key", "masked"])
def test_sinks(family):
    torch.manual_seed(2)
    lens, Hq, Hkv, D, bs = [19, 0, 14], 4, 2, 16, 8
    Nq = sum(lens)
    sel = local_selection(2, lens, lens, 3, bs, empty=(3,))
    plan, cu = packed_plan(sel, lens, None, True)
    q, k, v, do = (torch.randn(1, h, Nq, D, device=DEVICE) for h in (Hq, Hkv, Hkv, Hq))
    sinks = torch.randn(Hq, device=DEVICE)
    got, *_ = run_counted(q, k, v, do, plan, family, sinks=sinks)
    check_close(got, selection_reference(q, k, v, sel, causal=True, do=do, sinks=sinks, cu_seqlens=cu))


def _grads(q, k, v, do, sel, backend, monkeypatch, family=None, **kw):
    monkeypatch.setenv(tiles.FAMILY_ENV, family or "auto")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = selection_attention(*leaves, sel, backend=backend, **kw)
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


@pytest.mark.parametrize("family", ["query", "key", "masked"])
@pytest.mark.parametrize("selector", ["moba", "nsa"])
def test_selectors_on_packed_sequences_equal_cpu(selector, family, monkeypatch):
    """MoBA's and NSA's selectors given ``cu_seqlens`` choose local blocks; selection attention on Triton
    with those equals the C++ backend (output and gradients)."""
    from sparse_io_attn._cpu import build
    if not build.is_available():
        pytest.skip(f"the C++ kernels cannot be built here: {build.unavailable_reason()}")
    torch.manual_seed(3)
    lens, Hq, Hkv, D = [37, 21, 0, 9], 4, 2, 16
    cu = offsets(lens)
    T = sum(lens)
    q, do = (torch.randn(1, Hq, T, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(1, Hkv, T, D, device=DEVICE) for _ in range(2))
    sel = selectors.moba(8, 3)(q, k, cu_seqlens=cu) if selector == "moba" else selectors.nsa(5, 3)(q, k, cu_seqlens=cu)
    got = _grads(q, k, v, do, sel, "triton", monkeypatch, family, causal=True, cu_seqlens=cu)
    want = _grads(*(t.cpu() for t in (q, k, v, do)), Selection(sel.indices.cpu(), sel.block_size), "cpu",
                  monkeypatch, causal=True, cu_seqlens=cu.cpu())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=2e-5, atol=2e-6)


def test_nsa_attention_packed_on_triton_equals_torch():
    """``NSAAttention(..., cu_seqlens=)`` (compression, selection and window branches of packed sequences)
    on backend 'triton' equals backend 'torch', output and gradients."""
    from sparse_io_attn.nn.nsa import NSAAttention
    torch.manual_seed(4)
    cu = offsets([13, 0, 6, 20])
    T = int(cu[-1])
    q, k, v = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
    g, do = torch.rand(1, T, 4, 3), torch.randn(1, T, 4, 16)
    got = []
    for backend in ("triton", "torch"):
        leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
        out = NSAAttention(4, 3, 6, backend=backend)(*leaves, g.to(DEVICE), cu_seqlens=cu)
        got.append((out.detach(), *torch.autograd.grad(out, leaves, do.to(DEVICE))))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("family", ["query", "key", "masked"])
def test_value_dim_of_its_own_through_the_op(family, monkeypatch):
    """Packed sequences with a V head dim other than Q/K's and sinks, through ``selection_attention`` (the
    op's autograd: the sinks' gradient too), equal to the float64 reference."""
    torch.manual_seed(5)
    lens_q, lens_k, bs = [11, 0, 17], [20, 9, 30], 8
    cu = (offsets(lens_q), offsets(lens_k))
    T, Tk = sum(lens_q), sum(lens_k)
    sel = local_selection(2, lens_q, lens_k, 3, bs, empty=(4,))
    q, do = torch.randn(1, 4, T, 16, device=DEVICE), torch.randn(1, 4, T, 24, device=DEVICE)
    k, v = torch.randn(1, 2, Tk, 16, device=DEVICE), torch.randn(1, 2, Tk, 24, device=DEVICE)
    sinks = torch.randn(4, device=DEVICE)
    monkeypatch.setenv(tiles.FAMILY_ENV, family)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = selection_attention(*leaves[:3], sel, sinks=leaves[3], causal="bottom_right", cu_seqlens=cu,
                                   backend="triton", return_lse=True)
    got = (out.detach(), lse, *torch.autograd.grad(out, leaves, do))
    ref = selection_reference(q, k, v, sel, causal="bottom_right", do=do, sinks=sinks, cu_seqlens=cu)
    check_close(got[:5], ref[:5])
    torch.testing.assert_close(got[5], ref[5].to(torch.float32), rtol=1e-4, atol=1e-5)
