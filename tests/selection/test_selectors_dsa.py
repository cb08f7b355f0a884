"""DeepSeek Sparse Attention against the transcriptions of DeepSeek-V3.2-Exp's ``Indexer`` and MLA
prefill and of FlashMLA's ``ref_sparse_attn_fwd`` (``tests/selection/transcribed/dsa.py``):
``nn.LightningIndexer``'s scores and tie-aware top-k, its selection through ``selection_attention``
against MLA's masked prefill, decode rows against prefill, and ``selection_from_flashmla`` +
``selection_attention`` against FlashMLA's reference (invalid entries, ``topk_length``, empty rows;
causality explicit: FlashMLA's reference has none), outputs and gradients in fp32."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparse_io_attn import selection_attention
from sparse_io_attn.layout import selection_from_flashmla
from sparse_io_attn.nn import LightningIndexer, selectors
from sparse_io_attn.selection.reference import selection_reference

from .selector_checks import assert_valid_topk, chosen_mask, close
from .test_correctness import SELECTION_BACKENDS, _cpu_kernel_present, device_of  # noqa: F401 (autouse fixture)
from .transcribed import dsa


def _indexer(dim=24, q_lora=12, heads=4, head_dim=16, rope=8, top_k=5, interleaved=False):
    ix = LightningIndexer(dim, heads, head_dim, top_k, q_lora_rank=q_lora, rope_head_dim=rope,
                          rope_interleaved=interleaved)
    with torch.no_grad():                         # a LayerNorm that is not the identity
        ix.k_norm.weight.add_(0.1 * torch.randn(head_dim))
        ix.k_norm.bias.add_(0.1 * torch.randn(head_dim))
    return ix


def _v32(ix, x, qr, fc, mask, **kw):
    """The transcribed V3.2 Indexer.forward with ix's weights: ``(topk_indices, index_score)``."""
    return dsa.indexer_forward(x, qr, ix.wq_b.weight, ix.wk.weight, ix.k_norm.weight, ix.k_norm.bias,
                               ix.weights_proj.weight, fc, mask, n_heads=ix.num_heads, head_dim=ix.head_dim,
                               rope_head_dim=ix.rope_head_dim, index_topk=ix.top_k,
                               rope_interleaved=ix.rope_interleaved, return_index_score=True, **kw)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox-fixed-8631a813", "interleaved-3b99a535"])
@pytest.mark.parametrize("T,top_k", [(13, 5), (9, 16)])
def test_indexer_scores_and_topk_match_v32(interleaved, T, top_k):
    ix = _indexer(top_k=top_k, interleaved=interleaved)
    B = 2
    x, qr = torch.randn(B, T, 24), torch.randn(B, T, 12)
    fc = dsa.precompute_freqs_cis(8, T, original_seq_len=4096)
    mask = torch.full((T, T), -math.inf).triu_(1)
    idx, score = _v32(ix, x, qr, fc, mask)
    mine = ix.index_scores(x, qr, freqs_cis=fc)
    live = torch.isfinite(score)
    torch.testing.assert_close(mine[live], score[live], rtol=1e-5, atol=1e-6)
    sel = ix(x, qr, freqs_cis=fc)
    assert sel.indices.shape == (B, 1, T, min(top_k, T)) and sel.block_size == 1
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ours = chosen_mask(sel.indices[:, 0], T)
    tied = assert_valid_topk(ours, score, causal, top_k, what="ours")     # ReLU makes exact 0-score ties
    v32 = chosen_mask(torch.where(idx <= torch.arange(T)[:, None], idx, -1), T)   # MLA's causal mask removes the rest
    assert_valid_topk(v32, score, causal, top_k, what="V3.2")
    assert torch.equal(ours[~tied], v32[~tied]) and (~tied).sum() > T       # V3.2's own set wherever it is unique


def test_indexer_decode_with_past_keys_equals_prefill_rows():
    ix = _indexer(top_k=6)
    T, P = 17, 12
    x, qr = torch.randn(1, T, 24), torch.randn(1, T, 12)
    full = ix(x, qr)
    past = ix.keys(x[:, :P])
    dec = ix(x[:, P:], qr[:, P:], past_keys=past)
    assert torch.equal(chosen_mask(dec.indices, T), chosen_mask(full.indices[:, :, P:], T))
    torch.testing.assert_close(ix.index_scores(x[:, P:], qr[:, P:], past_keys=past), ix.index_scores(x, qr)[:, P:])


def test_ties_go_to_the_most_recent_key():
    w = torch.ones(1, 1, 6)
    q, k = torch.ones(1, 1, 6, 4), torch.ones(1, 6, 4)              # every score equal
    idx = selectors.lightning_topk(q, k, w, 3).indices[0, 0]
    assert idx.tolist() == [[0, -1, -1], [1, 0, -1], [2, 1, 0], [3, 2, 1], [4, 3, 2], [5, 4, 3]]


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_indexer_selection_through_selection_attention_equals_mla_prefill(backend):
    """V3.2's prefill: dense fp32 scores + the index mask (0 on the top-k) + the causal mask, one
    softmax, shared by every head == selection_attention(causal=True) over the indexer's Selection."""
    ix = _indexer(top_k=4)
    s, h, d = 11, 2, 16
    x, qr = torch.randn(1, s, 24), torch.randn(1, s, 12)
    q, k, v = (torch.randn(1, s, h, d) for _ in range(3))
    topk, _ = _v32(ix, x, qr, dsa.precompute_freqs_cis(8, s, original_seq_len=4096),
                   torch.full((s, s), -math.inf).triu_(1))
    scale = dsa.mla_softmax_scale(qk_head_dim=d, max_seq_len=s)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dsa.mla_prefill_sparse_attention(*leaves, topk, torch.full((s, s), -math.inf).triu_(1), scale)
    do = torch.randn_like(ref)
    ref = (ref.detach(), *torch.autograd.grad(ref, leaves, do))
    dev = device_of(backend)
    sel = ix(x, qr, freqs_cis=dsa.precompute_freqs_cis(8, s, original_seq_len=4096)).to(dev)
    mine = [t.transpose(1, 2).to(dev).requires_grad_() for t in (q, k, v)]
    out = selection_attention(*mine, sel, causal=True, sm_scale=scale, backend=backend)
    got = [g.transpose(1, 2) for g in (out.detach(), *torch.autograd.grad(out, mine, do.transpose(1, 2).to(dev)))]
    assert not close(got, ref), close(got, ref)


# --------------------------------------------------------------------------------------- FlashMLA
def _flashmla_problem(s_q=6, s_kv=11, h_q=3, d_qk=24, d_v=16):
    q, kv = torch.randn(s_q, h_q, d_qk), torch.randn(s_kv, 1, d_qk)
    idx = torch.tensor([[3, -1, 5, 7], [2, 9, 0, 1], [-5, 7, 100, 0], [1, 2, 3, 4], [10, 11, -123456, 2147483647],
                        [0, 1, 2, 3]], dtype=torch.int32)[:, None]
    topk_length = torch.tensor([4, 4, 4, 0, 4, 2], dtype=torch.int32)
    return q, kv, idx, topk_length, d_v


def _ours_flashmla(q, kv, sel, d_v, scale, backend, causal=False, sinks=None):
    """FlashMLA's tensors through selection_attention: q [1, h_q, s_q, d_qk], K = kv, V = kv[..., :d_v]
    (V's own head dim; the Triton kernels, which take equal head dims only, get it zero-padded to d_qk
    and the output sliced back)."""
    dev = device_of(backend)
    qq = q.transpose(0, 1)[None].to(dev).requires_grad_()
    kvv = kv.to(dev).requires_grad_()
    K = kvv.transpose(0, 1)[None]
    V = kvv[..., :d_v] if backend != "triton" else F.pad(kvv[..., :d_v], (0, kv.shape[-1] - d_v))
    out, lse = selection_attention(qq, K, V.transpose(0, 1)[None], sel.to(dev), causal=causal, sm_scale=scale,
                                   sinks=sinks, return_lse=True, backend=backend)
    return out[0].transpose(0, 1)[..., :d_v], lse[0].transpose(0, 1), qq, kvv


def _gathered_attention(q, kv, idx, topk_length, d_v, scale):
    """What ref_sparse_attn_fwd computes, written differentiably (its lse is edited in place, so
    autograd cannot run through it): per query a softmax over its valid gathered keys, 0 if none."""
    s_q, topk = idx.shape[0], idx.shape[-1]
    ind = idx[:, 0].long()
    valid = (ind >= 0) & (ind < kv.shape[0]) & (torch.arange(topk)[None] < topk_length[:, None])
    g = kv[ind.clamp(0, kv.shape[0] - 1), 0]                                        # [s_q, topk, d_qk]
    logits = torch.einsum("shd,std->sht", q, g) * scale
    p = torch.nan_to_num(logits.masked_fill(~valid[:, None], -math.inf).softmax(-1), nan=0.0)
    return torch.einsum("sht,std->shd", p, g[..., :d_v])


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_flashmla_indices_through_selection_attention_equal_ref_sparse_attn_fwd(backend):
    q, kv, idx, topk_length, d_v = _flashmla_problem()
    _, ref, _, ref_lse = dsa.ref_sparse_attn_fwd(q, kv, idx, 0.3, d_v, topk_length=topk_length)
    sel = selection_from_flashmla(idx, kv.shape[0], topk_length=topk_length)
    out, lse, qq, kvv = _ours_flashmla(q, kv, sel, d_v, 0.3, backend)
    assert not close([out], [ref])
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    dense = _gathered_attention(qr, kvr, idx, topk_length, d_v, 0.3)
    assert not close([dense], [ref])                                                 # the same function as FlashMLA's
    do = torch.randn_like(ref)
    g_ref = torch.autograd.grad(dense, (qr, kvr), do)
    g = torch.autograd.grad(out, (qq, kvv), do.to(out.device))
    assert not close([out, g[0][0].transpose(0, 1), g[1]], [ref, *g_ref])
    live = torch.isfinite(ref_lse)                                   # FlashMLA: +inf on empty rows, ours -inf
    torch.testing.assert_close(lse.cpu()[live], ref_lse[live], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse.cpu()[~live]).all() and (out.cpu()[3] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_flashmla_sink_and_mla_head_dims_equal_ref_sparse_attn_fwd(backend):
    """FlashMLA's reference with ``attn_sink`` at MLA's head dims (d_qk 576, d_v 512): the output equals
    ``ref_sparse_attn_fwd``'s (the sink multiplies it by exp(lse) / (exp(lse) + exp(sink))), our lse is
    FlashMLA's merged with the sink (FlashMLA returns it without; a row with no valid index: out 0,
    our lse the sink, FlashMLA's +inf); gradients, the sink's included, against the float64 reference."""
    s_q, s_kv, h_q = 6, 40, 4
    q, kv = torch.randn(s_q, h_q, 576), torch.randn(s_kv, 1, 576)
    idx = torch.stack([torch.randperm(s_kv + 6)[:8] - 3 for _ in range(s_q)])[:, None].to(torch.int32)  # some invalid
    topk_length = torch.tensor([8, 5, 0, 8, 3, 8], dtype=torch.int32)  # row 2: no valid slot
    sink = torch.randn(h_q)
    _, ref, _, ref_lse = dsa.ref_sparse_attn_fwd(q, kv, idx, 576 ** -0.5, 512, attn_sink=sink, topk_length=topk_length)
    sel = selection_from_flashmla(idx, s_kv, topk_length=topk_length)
    sinks = sink.clone().requires_grad_()
    out, lse, qq, kvv = _ours_flashmla(q, kv, sel, 512, 576 ** -0.5, backend, sinks=sinks)
    assert out.shape == (s_q, h_q, 512) and not close([out], [ref])
    live = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[live], torch.logaddexp(ref_lse, sink)[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[~live], sink.expand(s_q, h_q)[~live], rtol=1e-6, atol=1e-6)   # via base 2
    assert (out[~live] == 0).all()
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (qq, kvv, sinks), do)
    K = kv.transpose(0, 1)[None]
    want = selection_reference(q.transpose(0, 1)[None], K, K[..., :512], sel, sm_scale=576 ** -0.5,
                               do=do.transpose(0, 1)[None], sinks=sink)
    dkv = want[3] + F.pad(want[4], (0, 64))                          # K and V are views of one kv tensor
    assert not close([got[0], got[1].transpose(0, 1)[None], got[2]], [want[2], dkv, want[5]])


def test_causality_made_explicit_with_the_indexers_future_slots():
    """V3.2's top-k over all keys holds future slots when t + 1 < index_topk; FlashMLA needs them set
    to -1 (its reference has no causal mask). selection_attention(causal=True) over the raw top-k
    equals FlashMLA's reference over the masked indices, and causal=False does not."""
    s, h, d = 10, 2, 16
    score = torch.randn(1, s, s) + torch.full((s, s), -math.inf).triu_(1)
    topk = score.topk(4, dim=-1)[1]                                  # rows t < 3 include future keys
    q, kv = torch.randn(s, h, d), torch.randn(s, 1, d)
    _, ref, _, _ = dsa.ref_sparse_attn_fwd(q, kv, dsa.indexer_topk_to_flashmla_indices(topk), 0.25, d)
    raw = selection_from_flashmla(topk[0].to(torch.int32)[:, None], s)
    out, *_ = _ours_flashmla(q, kv, raw, d, 0.25, "torch", causal=True)
    assert not close([out], [ref])
    out_nc, *_ = _ours_flashmla(q, kv, raw, d, 0.25, "torch", causal=False)
    assert close([out_nc], [ref])


def test_flashmla_converter_refuses_repeats_and_bad_shapes():
    idx = torch.tensor([[[1, 2, 1, -1]], [[0, 3, 3, 3]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="counts it twice"):
        selection_from_flashmla(idx, 5)
    sel = selection_from_flashmla(idx, 5, check=False)
    assert sel.indices.shape == (1, 2, 4) and sel.block_size == 1
    with pytest.raises(ValueError, match=r"\[s_q, h_kv, topk\]"):
        selection_from_flashmla(idx[:, 0], 5)
    with pytest.raises(ValueError, match=r"topk_length must have shape \[s_q\]"):
        selection_from_flashmla(idx, 5, topk_length=torch.ones(3, dtype=torch.int32))
    # a repeat past topk_length, or of an invalid entry, is no repeat
    selection_from_flashmla(torch.tensor([[[1, 2, 1]], [[-1, -1, 9]]]), 5, topk_length=torch.tensor([2, 3]))
