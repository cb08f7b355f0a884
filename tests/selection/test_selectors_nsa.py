"""``nn.selectors.nsa`` and ``nn.NativeSparseAttention`` against the transcription of fla's NSA
(``tests/selection/transcribed/nsa.py``): the selected blocks are a valid top-k of fla's scores
(tie-aware; fla's own set where there is no tie), the selected branch equals ``naive_nsa_selection``,
the layer equals ``nsa_layer_reference`` (``parallel_nsa``'s power-of-two rounding included) in output
and gradients (fp32, 1e-5 relative) on every backend, a fla state_dict loads, decode rows
(bottom-right) select as in prefill."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_io_attn import selection_attention
from sparse_io_attn.nn import NativeSparseAttention, selectors

from .selector_checks import assert_valid_topk, chosen_mask, close, with_backends
from .test_correctness import SELECTION_BACKENDS, _cpu_kernel_present, device_of  # noqa: F401 (autouse fixture)
from .transcribed import nsa as fla


def _qk(B, T, HQ, H, D=16, dtype=torch.float32):
    """fla's layout ``[B, T, H, D]`` and ours ``[B, H, T, D]`` of the same tensors."""
    q, k = torch.randn(B, T, HQ, D, dtype=dtype), torch.randn(B, T, H, D, dtype=dtype)
    return q, k, q.transpose(1, 2), k.transpose(1, 2)


def fla_scores(q, k, BS, scale):
    """float64, independent of both implementations: per (b, t, KV head) the group mean of the softmax
    over complete blocks of ``scale * q . mean_pool(k)``, forced blocks (0, own, own - 1) at 1.0, and
    the blocks a row may keep (complete or forced). q, k in fla's layout."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    TC = math.ceil(T / BS)
    k_cmp = fla.mean_pooling(k.double(), BS)                                      # [B, TC, H, D]
    logits = torch.einsum("bthd,bchd->bthc", q.double(), k_cmp.repeat_interleave(HQ // H, 2)) * scale
    t, c = torch.arange(T)[:, None], torch.arange(TC)[None, :]
    complete = (c + 1) * BS - 1 <= t
    probs = torch.nan_to_num(logits.masked_fill(~complete[None, :, None], -math.inf).softmax(-1), nan=0.0)
    scores = probs.view(B, T, H, HQ // H, TC).mean(3)
    forced = (c == t // BS) | (c == 0) | (c == t // BS - 1)
    return torch.where(forced[None, :, None], 1.0, scores), (complete | forced)[None, :, None]


TOPK_CASES = [
    pytest.param(2, 45, 4, 2, 5, 4, torch.float32, id="gqa-T45-bs5-S4-ragged"),
    pytest.param(1, 40, 2, 2, 4, 16, torch.float32, id="mha-S16-beyond-the-blocks"),
    pytest.param(1, 37, 4, 1, 4, 6, torch.bfloat16, id="mqa-bf16-scores-in-input-dtype"),
    pytest.param(1, 30, 4, 2, 4, 2, torch.float32, id="S2-fewer-slots-than-forced-blocks"),
    pytest.param(1, 24, 2, 1, 4, 1, torch.float32, id="S1"),
]


@pytest.mark.parametrize("B,T,HQ,H,BS,S,dtype", TOPK_CASES)
def test_nsa_topk_is_a_topk_of_flas_scores(B, T, HQ, H, BS, S, dtype):
    q, k, qo, ko = _qk(B, T, HQ, H, dtype=dtype)
    scale = q.shape[-1] ** -0.5
    sel = selectors.nsa(BS, S)(qo, ko)
    assert sel.indices.shape == (B, H, T, S) and sel.block_size == BS
    ref = fla.naive_nsa_topk(q, fla.mean_pooling(k, BS), S, BS, scale)               # [B, T, H, S]
    scores, allowed = fla_scores(q, k, BS, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2                                # bf16: fla scores in bf16
    TC = math.ceil(T / BS)
    ours = chosen_mask(sel.indices.transpose(1, 2), TC)
    assert_valid_topk(ours, scores, allowed, S, tol=tol, what="ours")
    assert_valid_topk(chosen_mask(ref, TC), scores, allowed, S, tol=tol, what="fla")
    rows = sel.indices.transpose(1, 2)
    valid = rows >= 0
    assert torch.equal(valid, valid.cummin(-1).values), "-1 padding after the chosen blocks"
    if S >= 3 and dtype == torch.float32:                                         # no tie: fla's very set
        assert torch.equal(ours, chosen_mask(ref, TC))


def test_forced_blocks_tie_to_the_most_recent():
    """S < 3 forced blocks (all score 1.0): the own block first, then the one before it, then block 0
    (fla's torch.topk order among them is unspecified)."""
    _, _, qo, ko = _qk(1, 24, 2, 1)
    for S, want in ((1, lambda o: {o}), (2, lambda o: {o, o - 1} if o else {0})):
        idx = selectors.nsa(4, S)(qo, ko).indices[0, 0]
        for t in range(24):
            assert set(idx[t].tolist()) - {-1} == want(t // 4), (S, t)


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
@pytest.mark.parametrize("B,T,HQ,H,BS,S", [pytest.param(1, 45, 4, 2, 5, 4, id="gqa-ragged"),
                                            pytest.param(2, 32, 2, 2, 8, 3, id="mha-B2")])
def test_selected_branch_matches_naive_nsa_selection(backend, B, T, HQ, H, BS, S):
    q, k, qo, ko = _qk(B, T, HQ, H)
    v = torch.randn_like(k)
    sel = selectors.nsa(BS, S)(qo, ko)
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = fla.naive_nsa_selection(*leaves, sel.indices.transpose(1, 2), BS)
    ref = (ref.detach(), *torch.autograd.grad(ref, leaves, do))
    dev = device_of(backend)
    mine = [t.transpose(1, 2).to(dev).requires_grad_() for t in (q, k, v)]
    out = selection_attention(*mine, sel.to(dev), causal=True, backend=backend)
    got = (out.detach(), *torch.autograd.grad(out, mine, do.transpose(1, 2).to(dev)))
    got = [g.transpose(1, 2) for g in got]
    assert not close(got, ref), close(got, ref)


def test_decode_rows_select_as_in_prefill():
    _, _, qo, ko = _qk(1, 50, 4, 2)
    full = selectors.nsa(4, 5)(qo, ko)
    for n in (1, 7):
        dec = selectors.nsa(4, 5)(qo[:, :, -n:], ko)
        assert torch.equal(chosen_mask(dec.indices, 13), chosen_mask(full.indices[:, :, -n:], 13))


# ------------------------------------------------------------------------------------------ layer
def _layer_and_reference(T, E, HQ, H, D, BS, S, window, backend, B=2, bias=False):
    layer = NativeSparseAttention(E, HQ, H, head_dim=D, block_size=BS, num_blocks=S, window=window, qkv_bias=bias,
                                  backend=backend, layout_block_size=16)
    cfg = dict(num_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS, block_counts=S, window_size=window,
               check_group_size=False)
    return layer, cfg, torch.randn(B, T, E)


LAYER_CASES = [
    pytest.param(45, 32, 4, 2, 16, 4, 3, 6, id="gqa-T45-ragged-bs4-S3-w6"),
    pytest.param(40, 32, 2, 1, 16, 8, 12, 100, id="S12-rounded-to-16-window-over-T"),
    pytest.param(33, 32, 2, 2, 16, 4, 4, 0, id="mha-no-window-branch"),
    pytest.param(6, 32, 2, 1, 16, 8, 4, 4, id="T<block-no-complete-block"),
]


@pytest.mark.parametrize("backend,T,E,HQ,H,D,BS,S,window", with_backends(LAYER_CASES, SELECTION_BACKENDS))
def test_layer_matches_fla_layer_reference(backend, T, E, HQ, H, D, BS, S, window):
    layer, cfg, x = _layer_and_reference(T, E, HQ, H, D, BS, S, window, backend)
    dev = device_of(backend)
    layer = layer.to(dev)
    x = x.to(dev).requires_grad_()
    out, sel = layer(x, return_selection=True)
    do = torch.randn_like(out)
    params = [x] + list(layer.parameters())
    got = (out, *torch.autograd.grad(out, params, do))
    sd = {n: p.detach().cpu().requires_grad_() for n, p in layer.state_dict().items()}
    xr = x.detach().cpu().requires_grad_()
    ref, idx = fla.nsa_layer_reference_from_state_dict(xr, sd, return_block_indices=True, **cfg)
    ref = (ref, *torch.autograd.grad(ref, [xr] + [sd[n] for n, _ in layer.named_parameters()], do.cpu()))
    names = ["out", "dx"] + [f"d{n}" for n, _ in layer.named_parameters()]
    errs = {n: close([g], [r]) for n, g, r in zip(names, got, ref)}
    assert not any(errs.values()), errs
    assert layer.selected_blocks == 1 << (S - 1).bit_length()
    TC = math.ceil(T / BS)
    assert torch.equal(chosen_mask(sel.indices.cpu().transpose(1, 2), TC), chosen_mask(idx, TC))


def test_a_fla_state_dict_loads():
    """fla's parameter names (q/k/v/g/o_proj, q/k/v biases with qkv_bias; no rotary buffer)."""
    E, HQ, H, D = 32, 4, 2, 8
    fla_sd = {"q_proj.weight": torch.randn(HQ * D, E) / 6, "k_proj.weight": torch.randn(H * D, E) / 6,
              "v_proj.weight": torch.randn(H * D, E) / 6, "g_proj.weight": torch.randn(3 * HQ, E) / 6,
              "o_proj.weight": torch.randn(E, HQ * D) / 6, "q_proj.bias": torch.randn(HQ * D) / 6,
              "k_proj.bias": torch.randn(H * D) / 6, "v_proj.bias": torch.randn(H * D) / 6}
    layer = NativeSparseAttention(E, HQ, H, head_dim=D, block_size=4, num_blocks=4, window=8, qkv_bias=True,
                                  backend="torch", layout_block_size=16)
    layer.load_state_dict(fla_sd, strict=True)
    x = torch.randn(1, 30, E)
    ref = fla.nsa_layer_reference_from_state_dict(x, fla_sd, num_heads=HQ, num_kv_heads=H, head_dim=D, block_size=4,
                                                  block_counts=4, window_size=8, check_group_size=False)
    assert not close([layer(x)], [ref])


def test_layer_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        NativeSparseAttention(32, 4, 3)
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        NativeSparseAttention(32, 4, 2, window=-1)
    with pytest.raises(ValueError, match="head_dim must be even"):
        NativeSparseAttention(30, 2, 1, head_dim=15)
    with pytest.raises(ValueError, match=r"\[batch, seqlen, 32\]"):
        NativeSparseAttention(32, 4, 2)(torch.randn(2, 5, 16))
    assert "selects 16" in repr(NativeSparseAttention(32, 4, 2, num_blocks=12))
