"""Self-consistency of the transcribed reference implementations (tests/selection/transcribed):
each one against an independent dense/masked formulation in float64, plus the semantic rules
recorded in docs/notes/reference_semantics.md."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from selection.transcribed import dsa, moba, nsa

f64 = torch.float64


def _masked_attn(q, k, v, allow, scale):
    """q [S, H, D], k/v [T, H, D], allow [H, S, T] (or [S, T]) -> [S, H, D], float64."""
    s = torch.einsum("shd,thd->hst", q, k) * scale
    return torch.einsum("hst,thd->shd", s.masked_fill(~allow, float("-inf")).softmax(-1), v)


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


# ------------------------------------------------------------------------------------------ MoBA
def _moba_inputs(lens=(37, 50, 9), H=3, D=8, requires_grad=False):
    S = sum(lens)
    q, k, v = (torch.randn(S, H, D, dtype=f64, requires_grad=requires_grad) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lens)


def _moba_dense_from_selection(q, k, v, cu, chunk, sel):
    outs = []
    for b in range(len(cu) - 1):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        att = sel[b]["attended"]  # [H, S, N]
        allow = att.repeat_interleave(chunk, -1)[..., : s1 - s0] & _causal(s1 - s0)
        outs.append(_masked_attn(q[s0:s1], k[s0:s1], v[s0:s1], allow, q.shape[-1] ** -0.5))
    return torch.cat(outs)


@pytest.mark.parametrize("chunk,topk", [(8, 3), (5, 2), (16, 4)])
def test_moba_naive_equals_dense_softmax_over_its_own_selection(chunk, topk):
    q, k, v, cu, L = _moba_inputs()
    o = moba.moba_attn_varlen_naive(q, k, v, cu, L, chunk, topk, compute_dtype=f64)
    sel = moba.moba_naive_selection(q, k, cu, chunk, topk, compute_dtype=f64)
    torch.testing.assert_close(o, _moba_dense_from_selection(q, k, v, cu, chunk, sel), rtol=1e-12, atol=1e-12)


def test_moba_selection_rules():
    chunk, topk = 8, 3
    q, k, v, cu, L = _moba_inputs(lens=(50,), H=2)
    (sel,) = moba.moba_naive_selection(q, k, cu, chunk, topk, compute_dtype=f64)
    H, S, N = sel["attended"].shape
    kmean = torch.stack([k[n * chunk:(n + 1) * chunk].mean(0) for n in range(N)])  # [N, H, D] (last one ragged)
    for h in range(H):
        for s in range(S):
            chosen = sel["attended"][h, s].nonzero().flatten().tolist()
            own = s // chunk
            past = [n for n in range(N) if (n + 1) * chunk <= s]  # chunks that END before s
            assert own in chosen and set(chosen) - {own} <= set(past)
            assert len(chosen) == min(topk, len(past) + 1)  # the own chunk counts toward top_k
            gate = {n: float(q[s, h] @ kmean[n, h]) for n in past}  # unscaled q . mean(k)
            for n in past:
                assert sel["gate"][h, s, n].item() == pytest.approx(gate[n], rel=1e-12)
            picked = [gate[n] for n in chosen if n != own]
            others = [gate[n] for n in past if n not in chosen]
            assert not picked or not others or min(picked) >= max(others)
            assert sel["gate"][h, s, own] == float("inf")


@pytest.mark.parametrize("chunk,topk", [(8, 2), (8, 3), (6, 4)])
def test_moba_efficient_matches_naive(chunk, topk):
    q, k, v, cu, L = _moba_inputs(lens=(29, 9, 16), H=2)
    o_naive = moba.moba_attn_varlen_naive(q, k, v, cu, L, chunk, topk, compute_dtype=f64)
    o_eff = moba.moba_attn_varlen(q, k, v, cu, L, chunk, topk)
    torch.testing.assert_close(o_eff, o_naive, rtol=1e-5, atol=1e-5)  # float32 merge buffer in the original


def test_moba_topk_1_naive_is_own_chunk_but_efficient_is_full_causal():
    chunk = 8
    q, k, v, cu, L = _moba_inputs(lens=(30, 20))
    o_naive = moba.moba_attn_varlen_naive(q, k, v, cu, L, chunk, 1, compute_dtype=f64)
    o_eff = moba.moba_attn_varlen(q, k, v, cu, L, chunk, 1)
    own, full = [], []
    for b in range(len(cu) - 1):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        i = torch.arange(s1 - s0)
        same = (i[:, None] // chunk) == (i[None, :] // chunk)
        own.append(_masked_attn(q[s0:s1], k[s0:s1], v[s0:s1], same & _causal(s1 - s0), 8 ** -0.5))
        full.append(_masked_attn(q[s0:s1], k[s0:s1], v[s0:s1], _causal(s1 - s0), 8 ** -0.5))
    torch.testing.assert_close(o_naive, torch.cat(own), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o_eff, torch.cat(full), rtol=1e-5, atol=1e-5)


def test_moba_naive_gate_carries_no_gradient():
    chunk, topk = 8, 2
    q, k, v, cu, L = _moba_inputs(lens=(40,), requires_grad=True)
    do = torch.randn_like(q)
    moba.moba_attn_varlen_naive(q, k, v, cu, L, chunk, topk, compute_dtype=f64).backward(do)
    g_naive = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.no_grad():
        sel = moba.moba_naive_selection(q, k, cu, chunk, topk, compute_dtype=f64)
    _moba_dense_from_selection(q, k, v, cu, chunk, sel).backward(do)
    for a, t in zip(g_naive, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------- NSA
def test_mean_pooling_averages_ragged_last_block_over_its_tokens():
    x = torch.randn(2, 11, 3, 4, dtype=f64)
    m = nsa.mean_pooling(x, 4)
    torch.testing.assert_close(m[:, 2], x[:, 8:11].mean(1))
    torch.testing.assert_close(m[:, 1], x[:, 4:8].mean(1))
    cu = torch.tensor([0, 5, 11])
    mv = nsa.mean_pooling(x[:1], 4, cu)
    assert mv.shape[1] == 2 + 2
    torch.testing.assert_close(mv[0, 1], x[0, 4:5].mean(0))
    torch.testing.assert_close(mv[0, 2], x[0, 5:9].mean(0))


def _nsa_qkv(B=2, T=29, HQ=4, H=2, D=8):
    return (torch.randn(B, T, HQ, D, dtype=f64), torch.randn(B, T, H, D, dtype=f64),
            torch.randn(B, T, H, D, dtype=f64))


def _dense_gqa(q, k, v, allow, scale):
    """q [B, T, HQ, D], k/v [B, T, H, D], allow [T, T] or [B, T, HQ, T] -> [B, T, HQ, D]."""
    G = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bqhd,bkhd->bqhk", q, k) * scale
    if allow.dim() == 2:
        allow = allow[None, :, None, :]
    return torch.einsum("bqhk,bkhd->bqhd", s.masked_fill(~allow, float("-inf")).softmax(-1), v)


def test_nsa_selection_with_every_block_equals_causal_attention():
    q, k, v = _nsa_qkv()
    BS, T = 8, q.shape[1]
    TC = -(-T // BS)
    idx = torch.arange(TC).expand(2, T, 2, TC).clone()
    o = nsa.naive_nsa_selection(q, k, v, idx, BS, compute_dtype=f64)
    torch.testing.assert_close(o, _dense_gqa(q, k, v, _causal(T), 8 ** -0.5))


def test_nsa_selection_gathers_so_a_repeated_block_counts_twice():
    q, k, v = _nsa_qkv(B=1)
    BS, T = 8, q.shape[1]
    idx = torch.tensor([0, 0, 1, 2, 3]).expand(1, T, 2, 5)
    o = nsa.naive_nsa_selection(q, k, v, idx, BS, compute_dtype=f64)
    # block 0 twice == its keys' logits + log 2
    G = 2
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bqhd,bkhd->bqhk", q, kk) * 8 ** -0.5
    s[..., :BS] += math.log(2)
    s = s.masked_fill(~_causal(T)[None, :, None, :], float("-inf"))
    torch.testing.assert_close(o, torch.einsum("bqhk,bkhd->bqhd", s.softmax(-1), vv))


def test_nsa_compression_is_dense_attention_over_complete_mean_blocks():
    q, k, v = _nsa_qkv()
    BS, T = 6, q.shape[1]
    k_cmp, v_cmp = nsa.mean_pooling(k, BS), nsa.mean_pooling(v, BS)
    o, lse = nsa.naive_nsa_compression(q, k_cmp, v_cmp, BS, 0.3, compute_dtype=f64)
    TC = k_cmp.shape[1]
    allow = ((torch.arange(TC)[None, :] + 1) * BS - 1) <= torch.arange(T)[:, None]  # [T, TC]
    ref = torch.zeros_like(o)
    live = allow.any(1)
    G = 2
    s = torch.einsum("bqhd,bchd->bqhc", q, k_cmp.repeat_interleave(G, 2)) * 0.3
    p = s.masked_fill(~allow[None, :, None, :], float("-inf"))[:, live].softmax(-1)
    ref[:, live] = torch.einsum("bqhc,bchd->bqhd", p, v_cmp.repeat_interleave(G, 2))
    torch.testing.assert_close(o, ref)
    assert (o[:, : BS - 1] == 0).all() and torch.isneginf(lse[:, : BS - 1]).all() and torch.isfinite(lse[:, BS - 1:]).all()


def test_nsa_topk_rules():
    B, T, HQ, H, D, BS, S = 1, 45, 4, 2, 8, 5, 4
    q, k, _ = _nsa_qkv(B, T, HQ, H, D)
    k_cmp = nsa.mean_pooling(k, BS)
    scale = D ** -0.5
    idx = nsa.naive_nsa_topk(q, k_cmp, S, BS, scale)
    TC, G = k_cmp.shape[1], HQ // H
    assert idx.shape == (B, T, H, S)
    for t in range(T):
        own = t // BS
        complete = [c for c in range(TC) if (c + 1) * BS - 1 <= t]
        forced = {0, own} | ({own - 1} if own >= 1 else set())
        for h in range(H):
            row = idx[0, t, h].tolist()
            chosen = [c for c in row if c >= 0]
            assert row == chosen + [-1] * (S - len(chosen))  # -1 padding at the end
            assert len(chosen) == len(set(chosen)) == min(S, len(set(complete) | forced))
            assert forced <= set(chosen) or len(forced) > S
            # the others: top by the group-mean softmax over complete blocks (scaled logits)
            if complete:
                logit = torch.einsum("gd,cd->gc", q[0, t, h * G:(h + 1) * G], k_cmp[0, complete, h]) * scale
                score = dict(zip(complete, logit.softmax(-1).mean(0).tolist()))
                picked = [score[c] for c in chosen if c not in forced]
                rest = [score[c] for c in complete if c not in chosen and c not in forced]
                assert not picked or not rest or min(picked) >= max(rest)
    assert idx[0, : BS, :, 0].eq(0).all() and idx[0, : BS, :, 1:].eq(-1).all()  # t < BS: block 0 only


def test_parallel_reference_rounds_block_counts_up_to_a_power_of_two():
    q, k, v = _nsa_qkv(B=1, T=48, HQ=4, H=2)
    g = torch.rand(1, 48, 4, dtype=f64)
    _, idx = nsa.parallel_nsa_reference(q, k, v, g, g, None, block_counts=3, block_size=4,
                                        return_block_indices=True, compute_dtype=f64, check_group_size=False)
    assert idx.shape[-1] == 4 and (idx[0, -1] >= 0).all()
    _, idx = nsa.naive_nsa(q, k, v, g, g, None, block_counts=3, block_size=4, return_block_indices=True,
                           compute_dtype=f64, check_group_size=False)
    assert idx.shape[-1] == 3


def test_nsa_varlen_matches_per_sequence():
    q, k, v = _nsa_qkv(B=1, T=40, HQ=4, H=2)
    g = [torch.rand(1, 40, 4, dtype=f64) for _ in range(3)]
    cu = torch.tensor([0, 17, 40])
    kw = dict(block_counts=4, block_size=4, window_size=6, compute_dtype=f64, check_group_size=False)
    o = nsa.naive_nsa(q, k, v, *g, cu_seqlens=cu, **kw)
    for s0, s1 in ((0, 17), (17, 40)):
        part = nsa.naive_nsa(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], *(x[:, s0:s1] for x in g), **kw)
        torch.testing.assert_close(o[:, s0:s1], part)


def test_swa_stand_in_reads_the_last_window_keys():
    q, k, v = _nsa_qkv()
    T, w = q.shape[1], 5
    i = torch.arange(T)
    allow = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - w + 1)
    torch.testing.assert_close(nsa.flash_attn_swa_torch(q, k, v, w), _dense_gqa(q, k, v, allow, 8 ** -0.5))


def test_fla_rotary_is_relative_and_restarts_per_sequence():
    q, k = torch.randn(1, 20, 2, 8, dtype=f64), torch.randn(1, 20, 1, 8, dtype=f64)
    q0, k0 = q[:, :1].expand(1, 20, 2, 8), k[:, :1].expand(1, 20, 1, 8)
    rq, rk = nsa.fla_rotary(q0, k0)
    dots = torch.einsum("hd,thd->th", rq[0, 7], rk[0, :8].expand(8, 2, 8))  # offsets 7..0
    dots2 = torch.einsum("hd,thd->th", rq[0, 15], rk[0, 8:16].expand(8, 2, 8))
    torch.testing.assert_close(dots, dots2, rtol=1e-6, atol=1e-6)  # fla builds cos/sin in float32
    cu = torch.tensor([0, 6, 20])
    rqv, _ = nsa.fla_rotary(q, k, cu_seqlens=cu)
    torch.testing.assert_close(rqv[:, 6:], nsa.fla_rotary(q[:, 6:], k[:, 6:])[0])
    # NeoX halves: rotating pair (x_i, x_{i+4}) by angle t * base^(-2i/8)
    t, i = 3, 1
    ang = t * 10000.0 ** (-2 * i / 8)
    x = q[0, t, 0]
    y = rqv[0, t, 0]
    torch.testing.assert_close(y[i], x[i] * math.cos(ang) - x[i + 4] * math.sin(ang), rtol=1e-6, atol=1e-6)


def test_nsa_layer_with_full_coverage_is_gated_causal_plus_compression():
    torch.manual_seed(0)
    B, T, hidden, HQ, H, D, BS = 1, 24, 16, 16, 1, 8, 4
    x = torch.randn(B, T, hidden, dtype=f64)
    W = {"q_proj.weight": torch.randn(HQ * D, hidden, dtype=f64) / 4,
         "k_proj.weight": torch.randn(H * D, hidden, dtype=f64) / 4,
         "v_proj.weight": torch.randn(H * D, hidden, dtype=f64) / 4,
         "g_proj.weight": torch.randn(HQ * 3, hidden, dtype=f64) / 4,
         "o_proj.weight": torch.randn(hidden, HQ * D, dtype=f64) / 4}
    cfg = dict(num_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS, block_counts=8, window_size=T,
               compute_dtype=f64)
    out, idx = nsa.nsa_layer_reference_from_state_dict(x, W, return_block_indices=True, **cfg)
    # independent composition: every block selected and window >= T, so slc == swa == causal attention
    q = (x @ W["q_proj.weight"].T).unflatten(-1, (HQ, D))
    k = (x @ W["k_proj.weight"].T).unflatten(-1, (H, D))
    v = (x @ W["v_proj.weight"].T).unflatten(-1, (H, D))
    g = (x @ W["g_proj.weight"].T).unflatten(-1, (HQ, 3)).sigmoid()
    q, k = nsa.fla_rotary(q, k)
    causal = _dense_gqa(q, k, v, _causal(T), D ** -0.5)
    o_cmp, _ = nsa.naive_nsa_compression(q, nsa.mean_pooling(k, BS), nsa.mean_pooling(v, BS), BS, D ** -0.5,
                                         compute_dtype=f64)
    o = causal * (g[..., 1:2] + g[..., 2:3]) + o_cmp * g[..., 0:1]
    torch.testing.assert_close(out, o.reshape(B, T, -1) @ W["o_proj.weight"].T)
    assert idx.shape[-1] == 8 and ((idx >= 0).sum(-1)[0, :, 0] == torch.arange(T) // BS + 1).all()


# ------------------------------------------------------------------------------------------- DSA
def _indexer_weights(dim=24, q_lora=12, n_heads=4, head_dim=16, rope=8):
    return dict(wq_b=torch.randn(n_heads * head_dim, q_lora, dtype=f64) / 3,
                wk=torch.randn(head_dim, dim, dtype=f64) / 3,
                k_norm_weight=1 + 0.1 * torch.randn(head_dim, dtype=f64),
                k_norm_bias=0.1 * torch.randn(head_dim, dtype=f64),
                weights_proj=torch.randn(n_heads, dim, dtype=f64) / 3), dict(n_heads=n_heads, head_dim=head_dim,
                                                                              rope_head_dim=rope)


def test_indexer_score_formula_and_hadamard_invariance():
    T, dim, q_lora = 13, 24, 12
    W, cfg = _indexer_weights(dim, q_lora)
    x, qr = torch.randn(1, T, dim, dtype=f64), torch.randn(1, T, q_lora, dtype=f64)
    fc = dsa.precompute_freqs_cis(8, T, original_seq_len=4096)
    mask = torch.full((T, T), float("-inf"), dtype=f64).triu_(1)
    kw = dict(index_topk=5, compute_dtype=f64, return_index_score=True, **cfg)
    idx, score = dsa.indexer_forward(x, qr, *W.values(), fc, mask, **kw)
    _, score_h = dsa.indexer_forward(x, qr, *W.values(), fc, mask, hadamard=True, **kw)
    torch.testing.assert_close(score_h, score)  # the Hadamard rotation does not change q . k
    # independent: I[t, s] = sum_j w[t, j] * n_heads^-0.5 * head_dim^-0.5 * relu(q_j[t] . k[s])
    q = (qr @ W["wq_b"].T).view(1, T, 4, 16)
    k = F.layer_norm(x @ W["wk"].T, (16,), W["k_norm_weight"], W["k_norm_bias"], 1e-6)
    q = torch.cat([dsa.apply_rotary_emb(q[..., :8], fc, False, f64), q[..., 8:]], -1)
    k = torch.cat([dsa.apply_rotary_emb(k[..., None, :8], fc, False, f64)[..., 0, :], k[..., 8:]], -1)
    w = (x @ W["weights_proj"].T) * 4 ** -0.5 * 16 ** -0.5
    ref = torch.einsum("bth,bths->bts", w, torch.einsum("bthd,bsd->bths", q, k).relu()) + mask
    torch.testing.assert_close(score, ref)
    # the kept set per query: top min(index_topk, t + 1) among s <= t (future slots are -inf)
    for t in range(T):
        kept = {s for s in idx[0, t].tolist() if s <= t}
        assert len(kept) == min(5, t + 1)
        assert min(ref[0, t, list(kept)]) >= max([ref[0, t, s].item() for s in range(t + 1) if s not in kept],
                                                  default=-math.inf)


def test_indexer_rope_layouts():
    x = torch.randn(1, 6, 2, 8, dtype=f64)
    fc = dsa.precompute_freqs_cis(8, 6, original_seq_len=4096)
    neox = dsa.apply_rotary_emb(x, fc, interleaved=False, compute_dtype=f64)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # (x_i, x_{i+4}) -> adjacent pairs
    inter = dsa.apply_rotary_emb(x[..., perm], fc, interleaved=True, compute_dtype=f64)
    torch.testing.assert_close(neox[..., perm], inter)
    ang = fc.angle()[:, None, :].to(f64)  # [s, 1, 4]
    x1, x2 = x[..., :4], x[..., 4:]
    torch.testing.assert_close(neox, torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1))


def test_mla_prefill_with_every_key_selected_is_dense_causal():
    b, s, h, d = 1, 9, 3, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=f64) for _ in range(3))
    mask = torch.full((s, s), float("-inf")).triu_(1)
    topk = torch.arange(s).expand(b, s, s)
    o = dsa.mla_prefill_sparse_attention(q, k, v, topk, mask, 0.4)
    torch.testing.assert_close(o[0].to(torch.float32), _masked_attn(q[0], k[0], v[0], _causal(s), 0.4).to(torch.float32))


def test_flashmla_ref_all_valid_equals_dense_over_the_indexed_keys():
    s_q, s_kv, h_q, d_qk, d_v, topk = 5, 11, 3, 12, 8, 4
    q, kv = torch.randn(s_q, h_q, d_qk, dtype=f64), torch.randn(s_kv, 1, d_qk, dtype=f64)
    idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).to(torch.int32)[:, None]
    _, out, max_logits, lse = dsa.ref_sparse_attn_fwd(q, kv, idx, 0.5, d_v, compute_dtype=f64)
    for i in range(s_q):
        kk = kv[idx[i, 0].long(), 0]  # [topk, d_qk]
        logits = q[i] @ kk.T * 0.5
        torch.testing.assert_close(out[i], logits.softmax(-1) @ kk[:, :d_v])
        torch.testing.assert_close(lse[i], logits.logsumexp(-1))
        torch.testing.assert_close(max_logits[i], logits.max(-1).values)


def test_flashmla_ref_invalid_entries_topk_length_empty_rows_and_sink():
    s_q, s_kv, h_q, d_qk, d_v = 4, 7, 2, 8, 6
    q, kv = torch.randn(s_q, h_q, d_qk, dtype=f64), torch.randn(s_kv, 1, d_qk, dtype=f64)
    idx = torch.tensor([[3, -1, 5, 7], [2, 2, 0, 1], [-5, 7, 100, 0], [1, 2, 3, 4]], dtype=torch.int32)[:, None]
    topk_length = torch.tensor([4, 4, 4, 0], dtype=torch.int32)
    sink = torch.tensor([0.3, float("-inf")], dtype=torch.float32)
    _, out, mx, lse = dsa.ref_sparse_attn_fwd(q, kv, idx, 0.5, d_v, attn_sink=sink, topk_length=topk_length,
                                              compute_dtype=f64)
    valid = {0: [3, 5], 1: [2, 2, 0, 1], 2: [0]}  # -1 / <0 / >= s_kv dropped; a repeated index counts twice
    for i, keys in valid.items():
        kk = kv[torch.tensor(keys), 0]
        logits = q[i] @ kk.T * 0.5
        l0 = logits.logsumexp(-1)
        o = logits.softmax(-1) @ kk[:, :d_v]
        factor = torch.exp(l0) / (torch.exp(l0) + torch.exp(sink.to(f64)))  # sink: output only
        torch.testing.assert_close(out[i], o * factor[:, None])
        torch.testing.assert_close(lse[i], l0)
    assert (out[3] == 0).all() and torch.isposinf(lse[3]).all() and torch.isneginf(mx[3]).all()


def test_indexer_topk_through_flashmla_ref_equals_mla_prefill():
    """V3.2's prefill sparse MLA (per-head K/V = the shared latent) == FlashMLA's reference fed the
    indexer's top-k with future slots set to -1."""
    s, h, d_qk, d_v, index_topk = 10, 2, 12, 8, 4
    q, kv = torch.randn(1, s, h, d_qk, dtype=f64), torch.randn(s, 1, d_qk, dtype=f64)
    score = torch.randn(1, s, s, dtype=f64) + torch.full((s, s), float("-inf"), dtype=f64).triu_(1)
    topk = score.topk(min(index_topk, s), dim=-1)[1]
    mask = torch.full((s, s), float("-inf")).triu_(1)
    k = kv[None].expand(1, s, h, d_qk)
    o_mla = dsa.mla_prefill_sparse_attention(q, k, k[..., :d_v], topk, mask, 0.3)
    _, o_ref, _, _ = dsa.ref_sparse_attn_fwd(q[0], kv, dsa.indexer_topk_to_flashmla_indices(topk), 0.3, d_v,
                                             compute_dtype=f64)
    torch.testing.assert_close(o_mla[0], o_ref, rtol=1e-6, atol=1e-6)  # MLA's scores are float32
