"""``nn.selectors.moba`` (exact MoBA) against the transcription of MoonshotAI/MoBA
(``tests/selection/transcribed/moba.py``): ``selection_attention`` over the selector's choice equals
``moba_attn_varlen_naive`` (and the efficient path) in outputs and q/k/v gradients (fp32, 1e-5
relative) on every backend; the chosen chunks are a valid top-k of MoBA's own gate (tie-aware), for
GQA, ragged lengths, bf16 gates, exact ties and decode rows (bottom-right, Nq < Nk)."""
from __future__ import annotations

import pytest
import torch

from sparse_io_attn import selection_attention
from sparse_io_attn.nn import selectors

from .selector_checks import assert_valid_topk, chosen_mask, close, with_backends
from .test_correctness import SELECTION_BACKENDS, _cpu_kernel_present, device_of  # noqa: F401 (autouse fixture)
from .transcribed import moba


def _inputs(B, Hq, Hkv, N, D=16, dtype=torch.float32):
    return [torch.randn(B, h, N, D, dtype=dtype) for h in (Hq, Hkv, Hkv)]


def _packed(x, G):
    """[B, H, N, D] -> MoBA's packed [B * N, H * G, D] (K/V repeated per query head, as moba/wrapper.py)."""
    B, H, N, D = x.shape
    return x.repeat_interleave(G, 1).permute(0, 2, 1, 3).reshape(B * N, H * G, D)


def moba_reference(q, k, v, do, chunk, top_k):
    """``moba_attn_varlen_naive`` over the batch as one varlen pack: ``(out, dq, dk, dv)`` in our layout."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    B, Hq, N, D = q.shape
    G = Hq // k.shape[1]
    cu = torch.arange(B + 1, dtype=torch.int32) * N
    o = moba.moba_attn_varlen_naive(_packed(q, 1), _packed(k, G), _packed(v, G), cu, N, chunk, top_k)
    o = o.view(B, N, Hq, D).permute(0, 2, 1, 3)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def ours(q, k, v, do, chunk, top_k, backend):
    dev = device_of(backend)
    q, k, v = (t.detach().to(dev).requires_grad_() for t in (q, k, v))
    sel = selectors.moba(chunk, top_k)(q, k)
    o = selection_attention(q, k, v, sel, causal=True, backend=backend)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do.to(dev))), sel


CASES = [
    pytest.param(1, 4, 2, 37, 8, 3, id="gqa-N37-chunk8-top3-ragged"),
    pytest.param(2, 2, 2, 50, 5, 2, id="mha-B2-N50-chunk5-top2"),
    pytest.param(1, 2, 1, 40, 8, 4, id="mqa-N40-chunk8-top4"),
    pytest.param(1, 2, 2, 29, 6, 1, id="top1-own-chunk-only"),
    pytest.param(1, 4, 2, 20, 8, 9, id="top-k-beyond-the-chunks"),
    pytest.param(1, 2, 1, 9, 16, 3, id="one-ragged-chunk"),
]


@pytest.mark.parametrize("backend,B,Hq,Hkv,N,chunk,top_k", with_backends(CASES, SELECTION_BACKENDS, triton_cases=2))
def test_moba_matches_moba_attn_varlen_naive(backend, B, Hq, Hkv, N, chunk, top_k):
    q, k, v = _inputs(B, Hq, Hkv, N)
    do = torch.randn_like(q)
    got, sel = ours(q, k, v, do, chunk, top_k, backend)
    ref = moba_reference(q, k, v, do, chunk, top_k)
    assert not close(got, ref), close(got, ref)
    assert sel.indices.shape == (B, Hq, N, min(top_k, N // chunk + 1)) and sel.block_size == chunk


@pytest.mark.filterwarnings("ignore:index_reduce")
@pytest.mark.parametrize("top_k", [2, 3])
def test_moba_matches_the_efficient_path(top_k):
    """moba_attn_varlen (MoBA's production path; forward only: the transcription's fp32 merge buffer is
    updated in place, which autograd cannot differentiate; its own backward is a custom kernel)."""
    q, k, v = _inputs(2, 4, 2, 44)
    sel = selectors.moba(8, top_k)(q, k)
    out = selection_attention(q, k, v, sel, causal=True, backend="torch")
    cu = torch.arange(3, dtype=torch.int32) * 44
    ref = moba.moba_attn_varlen(_packed(q, 1), _packed(k, 2), _packed(v, 2), cu, 44, 8, top_k)
    assert not close([out], [ref.view(2, 44, 4, 16).permute(0, 2, 1, 3)])


def _check_against_gate(sel, q, k, chunk, top_k, tol=1e-5):
    """The chosen chunks per (batch, query head, token): the own chunk, and a valid top-(top_k - 1) of
    MoBA's masked gate (moba_naive_selection: the same statements as moba_attn_varlen_naive)."""
    B, Hq, N, _ = q.shape
    G = Hq // k.shape[1]
    ref = moba.moba_naive_selection(_packed(q, 1), _packed(k, G), torch.arange(B + 1) * N, chunk, top_k)
    nkb = -(-N // chunk)
    chosen = chosen_mask(sel.indices, nkb)                                      # [B, Hq, N, nkb]
    own = torch.arange(N) // chunk
    assert chosen[..., torch.arange(N), own].all(), "the own chunk is always selected"
    ties = 0
    for b, r in enumerate(ref):
        gate = r["gate"]                                                        # [Hq, N, nkb], +inf own, -inf others
        past = torch.isfinite(gate)
        past_chosen = chosen[b] & ~(gate == torch.inf)
        ties += int(assert_valid_topk(past_chosen, gate, past, top_k - 1, tol=tol, what=f"batch {b}").sum())
        # MoBA's own choice is valid under the same rule (its tie-break among equal gates is its own)
        assert_valid_topk(r["attended"] & past, gate, past, top_k - 1, tol=tol, what=f"reference batch {b}")
    return ties


@pytest.mark.parametrize("B,Hq,Hkv,N,chunk,top_k", CASES)
def test_moba_chooses_a_topk_of_mobas_gate(B, Hq, Hkv, N, chunk, top_k):
    q, k, _ = _inputs(B, Hq, Hkv, N)
    _check_against_gate(selectors.moba(chunk, top_k)(q, k), q, k, chunk, top_k)


def test_moba_gate_is_unscaled_fp32_over_chunk_means_in_ks_dtype():
    """bf16 inputs: the chunk mean is taken in bf16 (then cast), the product in fp32, as MoBA; the
    gate equals the transcription's and the choice is its top-k."""
    q, k, _ = _inputs(1, 4, 2, 48, dtype=torch.bfloat16)
    sel = selectors.moba(8, 3)
    gate = sel.gate(q, k)
    (ref,) = moba.moba_naive_selection(_packed(q, 1), _packed(k, 2), torch.tensor([0, 48]), 8, 3)
    finite = torch.isfinite(ref["gate"][:, :, :gate.shape[-1]])
    assert gate.dtype == torch.float32
    assert torch.equal(torch.isfinite(gate[0]), finite)
    torch.testing.assert_close(gate[0][finite], ref["gate"][:, :, :gate.shape[-1]][finite], rtol=1e-6, atol=1e-6)
    fp32_mean = q.float()[0, 0, -1] @ k.float()[0, 0, :8].mean(0)
    assert gate[0, 0, -1, 0] != fp32_mean          # not the float32 mean: MoBA averages in k's dtype
    chosen = chosen_mask(sel(q, k).indices, 6)[0]
    past = torch.isfinite(ref["gate"])
    assert_valid_topk(chosen & past, ref["gate"], past, 2, tol=0.0)


def test_ties_go_to_the_more_recent_chunk_and_stay_valid():
    """Chunks 0-3 hold the same keys: equal gates. The selector keeps the higher chunk indices; MoBA's
    torch.topk may keep others, and both are valid top-k choices."""
    q, k, v = _inputs(1, 2, 2, 48)
    k[:, :, 8:32] = k[:, :, :8].repeat(1, 1, 3, 1)
    sel = selectors.moba(8, 3)(q, k)
    gate = selectors.moba(8, 3).gate(q, k)[0, :, 40]                              # token 40: chunk 5, past 0..4
    assert (gate[:, :4] == gate[:, :1]).all()
    for h in range(2):
        want = {5, 4, 3} if gate[h, 4] > gate[h, 0] else {5, 3, 2}                 # ties: the later chunks
        assert set(sel.indices[0, h, 40].tolist()) == want
    assert _check_against_gate(sel, q, k, 8, 3, tol=0.0) > 0                      # ties were met


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_decode_rows_select_and_attend_as_in_prefill(backend):
    """The last rows as decode queries (bottom-right, Nq < Nk): the same chunks and outputs as the same
    rows of the whole prefill (a row's selection depends only on the keys before it). MoBA's own
    wrapper runs dense attention for decode steps instead (documented deviation)."""
    q, k, v = _inputs(1, 4, 2, 45)
    dev = device_of(backend)
    q, k, v = q.to(dev), k.to(dev), v.to(dev)
    full = selectors.moba(8, 3)(q, k)
    out_full = selection_attention(q, k, v, full, causal=True, backend=backend)
    for n in (1, 3, 12):
        dec = selectors.moba(8, 3, causal="bottom_right")(q[:, :, -n:], k)
        assert torch.equal(chosen_mask(dec.indices, 6), chosen_mask(full.indices[:, :, -n:], 6))
        out = selection_attention(q[:, :, -n:], k, v, dec, causal="bottom_right", backend=backend)
        assert not close([out], [out_full[:, :, -n:]])


def test_moba_refuses_what_it_does_not_define():
    with pytest.raises(ValueError, match="causal by definition"):
        selectors.moba(8, 2, causal=False)
    with pytest.raises(ValueError, match="chunk_size"):
        selectors.moba(0, 2)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        selectors.moba(8, 2)(torch.randn(1, 3, 16, 8), torch.randn(1, 2, 16, 8))
    assert repr(selectors.moba(8, 2)) == "moba(chunk_size=8, top_k=2, causal=True)"
