"""Decode-time selector state (``init_state`` / ``step``): a prefill of a prefix through ``step`` and
then decode steps of 1 or 3 tokens choose, row for row and as sets, what the selector chooses for the
same positions in one prefill over the whole sequence (MoBA, NSA, DSA's lightning indexer); pooled
top-k, whose query blocks are a call's rows, chooses what the full selector chooses for the same
call. The state stays O(key blocks x D) and a step reads no cached key."""
from __future__ import annotations

import math

import pytest
import torch

from selection.selector_checks import chosen_mask
from sparse_io_attn.nn import LightningIndexer, selectors
from sparse_io_attn.nn.selector_state import BlockKeyState, IndexKeyState


def _qk(B, Hq, Hkv, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).to(dtype))


def _decode(sel, q, k, prefix, chunk):
    """``[(start, stop, selection)]``: ``step`` over the prefix, then ``chunk`` tokens at a time."""
    state, out, T = sel.init_state(), [], q.shape[2]
    bounds = [0, prefix] + list(range(prefix + chunk, T, chunk)) + [T]
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            out.append((a, b, sel.step(q[:, :, a:b], k[:, :, a:b], state)))
            assert state.length == b
    return state, out


CASES = [  # B, Hq, Hkv, T, D, block, top_k, prefix
    pytest.param(2, 4, 2, 45, 16, 8, 3, 13, id="gqa-batch2-ragged"),
    pytest.param(1, 2, 2, 37, 8, 4, 4, 1, id="mha-from-one-token"),
    pytest.param(2, 6, 1, 29, 8, 5, 2, 10, id="mqa-prefix-on-boundary"),
    pytest.param(1, 4, 2, 20, 8, 8, 1, 7, id="own-chunk-only"),
]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,T,D,block,top_k,prefix", CASES)
def test_moba_decode_selects_as_prefill(B, Hq, Hkv, T, D, block, top_k, prefix, chunk):
    sel = selectors.moba(block, top_k)
    q, k = _qk(B, Hq, Hkv, T, D, torch.float64, seed=T + chunk)
    width = math.ceil(T / block)
    want = chosen_mask(sel(q, k).indices, width)                                  # [B, Hq, T, width]
    state, steps = _decode(sel, q, k, prefix, chunk)
    for a, b, got in steps:
        assert got.indices.shape == (B, Hq, b - a, min(top_k, b // block + 1)) and got.block_size == block
        assert torch.equal(chosen_mask(got.indices, width), want[:, :, a:b]), (a, b)
    assert state.num_blocks == T // block and state.tail.shape[2] == T % block
    assert state.numel() <= B * Hkv * (T // block + block) * D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moba_decode_in_the_models_dtype(dtype):
    """Chunk means in k's dtype (as MoBA) are the prefill's to the bit, so a bfloat16 cache decodes as
    its prefill too."""
    sel = selectors.moba(8, 3)
    q, k = _qk(2, 4, 2, 41, 16, dtype, seed=5)
    want = chosen_mask(sel(q, k).indices, 6)
    state, steps = _decode(sel, q, k, 9, 1)
    for a, b, got in steps:
        assert torch.equal(chosen_mask(got.indices, 6), want[:, :, a:b]), (a, b)
    assert torch.equal(state.summaries, k[:, :, :40].unflatten(2, (5, 8)).mean(3).float())


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,T,D,block,top_k,prefix", CASES)
def test_nsa_decode_selects_as_prefill(B, Hq, Hkv, T, D, block, top_k, prefix, chunk):
    sel = selectors.nsa(block, top_k + 1)
    q, k = _qk(B, Hq, Hkv, T, D, torch.float64, seed=2 * T + chunk)
    width = math.ceil(T / block)
    want = chosen_mask(sel(q, k).indices, width)                                  # [B, Hkv, T, width]
    state, steps = _decode(sel, q, k, prefix, chunk)
    for a, b, got in steps:
        assert got.indices.shape == (B, Hkv, b - a, top_k + 1)
        assert torch.equal(chosen_mask(got.indices, width), want[:, :, a:b]), (a, b)
    assert state.num_blocks == T // block and state.summaries.dtype == k.dtype
    assert state.numel() <= B * Hkv * (T // block + block) * D


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,T,D,block,top_k,prefix", CASES)
def test_pooled_decode_selects_as_the_full_selector_on_the_same_rows(B, Hq, Hkv, T, D, block, top_k, prefix, chunk):
    sel = selectors.pooled_topk(block, top_k)
    full = sel.with_causal("bottom_right")
    q, k = _qk(B, Hq, Hkv, T, D, torch.float64, seed=3 * T + chunk)
    state, steps = _decode(sel, q, k, prefix, chunk)
    for a, b, got in steps:
        want = full(q[:, :, a:b], k[:, :, :b])
        assert torch.equal(got.to_dense_mask(), want.to_dense_mask()), (a, b)
    assert torch.equal(steps[0][2].to_dense_mask(), sel(q[:, :, :prefix], k[:, :, :prefix]).to_dense_mask())
    assert state.numel() <= B * Hkv * (T // block + block) * D


@pytest.mark.parametrize("chunk", [1, 3])
def test_lightning_indexer_decode_selects_as_prefill(chunk):
    torch.manual_seed(0)
    idx = LightningIndexer(32, 4, 16, top_k=6, rope_head_dim=8).double()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    want = chosen_mask(idx(x).indices, 23)                                       # [B, 1, T, 23]
    state, prefix = idx.init_state(), 5
    bounds = [0, prefix] + list(range(prefix + chunk, 23, chunk)) + [23]
    for a, b in zip(bounds, bounds[1:]):
        got = idx.step(x[:, a:b], state)
        assert state.length == b and got.indices.shape == (2, 1, b - a, min(6, b))
        assert torch.equal(chosen_mask(got.indices, 23), want[:, :, a:b]), (a, b)
    assert torch.allclose(state.keys, idx.keys(x), rtol=0, atol=1e-6)       # RoPE in float32, per call
    with pytest.raises(TypeError, match="init_state"):
        idx.step(x[:, :1], selectors.moba(4, 2).init_state())
    with pytest.raises(ValueError, match="continuing the state's batch"):
        idx.step(x[:1, :1], state)


def test_a_step_reads_no_cached_key():
    """The state keeps its own copies: poisoning the caller's key tensor after a step (as a cache
    that is reallocated or reused) changes nothing, and a step is given only the new keys."""
    for sel in (selectors.moba(4, 3), selectors.nsa(4, 3), selectors.pooled_topk(4, 2)):
        q, k = _qk(2, 4, 2, 19, 8, torch.float64, seed=1)
        want = [s for _, _, s in _decode(sel, q, k, 6, 1)[1]]
        kk = k.clone()
        state = sel.init_state()
        got = []
        for t in range(19):
            a, b = (0, 6) if t == 0 else (t + 5, t + 6)
            if a >= 19:
                break
            got.append(sel.step(q[:, :, a:b], kk[:, :, a:b], state))
            kk[:, :, :b] = float("nan")                                          # the "cache" so far
        for g, w in zip(got, want):
            g, w = (g.to_dense_mask(), w.to_dense_mask()) if hasattr(g, "to_dense_mask") else (g.indices, w.indices)
            assert torch.equal(g, w), repr(sel)


def test_step_errors():
    sel = selectors.moba(4, 2)
    q, k = _qk(1, 2, 1, 8, 8, torch.float32, seed=0)
    state = sel.init_state()
    with pytest.raises(ValueError, match="as many of each"):
        sel.step(q, k[:, :, :3], state)
    with pytest.raises(ValueError, match="belongs to nsa"):
        sel.step(q, k, selectors.nsa(4, 2).init_state())
    with pytest.raises(ValueError, match="belongs to IndexKeyState"):
        sel.step(q, k, IndexKeyState())
    sel.step(q, k, state)
    with pytest.raises(ValueError, match="do not continue"):
        sel.step(q.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), state)
    with pytest.raises(ValueError, match="causal=False"):
        selectors.pooled_topk(4, 2, causal=False).step(q, k, selectors.pooled_topk(4, 2).init_state())
    assert isinstance(state, BlockKeyState) and state.length == 8 and "length=8" in repr(state)
    state.reset()
    assert state.length == 0 and state.numel() == 0


# (selector that steps, selector whose init_state() made the state, what differs)
MISMATCHES = [
    pytest.param(selectors.moba(32, 2), selectors.moba(16, 2), "chunk_size=16", id="moba-chunk-size"),
    pytest.param(selectors.moba(16, 3), selectors.moba(16, 2), "top_k=2", id="moba-top-k"),
    pytest.param(selectors.nsa(32, 2), selectors.nsa(16, 2), "block_size=16", id="nsa-block"),
    pytest.param(selectors.nsa(16, 4), selectors.nsa(16, 2), "num_blocks=2", id="nsa-num-blocks"),
    pytest.param(selectors.nsa(16, 2, sm_scale=0.5), selectors.nsa(16, 2), "sm_scale=None", id="nsa-sm-scale"),
    pytest.param(selectors.pooled_topk(32, 2), selectors.pooled_topk(16, 2), "block_size=16", id="pooled-block"),
    pytest.param(selectors.pooled_topk(16, 3), selectors.pooled_topk(16, 2), "top_k=2", id="pooled-top-k"),
]


@pytest.mark.parametrize("keys", [0, 40], ids=["empty-state", "filled-state"])
@pytest.mark.parametrize("sel,maker,got", MISMATCHES)
def test_a_state_of_other_parameters_is_refused(sel, maker, got, keys):
    """A state carries its selector's kind and parameters: a step of a selector with another block
    size, top-k or scale raises ValueError naming the expected selector, the state's and the fix,
    and leaves the state as it was (a 16-key chunk mean is never read as a 32-key one)."""
    q, k = _qk(1, 4, 2, keys + 1, 8, torch.float32, seed=keys)
    state = maker.init_state(k[:, :, :keys]) if keys else maker.init_state()
    before = (state.length, None if state.summaries is None else state.summaries.clone())
    kind = repr(sel).split("(")[0]
    with pytest.raises(ValueError, match=rf"{kind}\.step: expected a state made by {kind}\(.*\) \(this selector\), "
                                         rf"got one that belongs to {kind}\(.*{got}.*\); make the state with this "
                                         rf"selector's init_state\(\)"):
        sel.step(q[:, :, keys:], k[:, :, keys:], state)
    assert state.length == before[0]
    assert before[1] is None or torch.equal(state.summaries, before[1])
    sel.step(q[:, :, keys:], k[:, :, keys:], sel.init_state(k[:, :, :keys]) if keys else sel.init_state())


@pytest.mark.parametrize("sel", [selectors.moba(4, 2), selectors.nsa(4, 2), selectors.pooled_topk(4, 2)],
                         ids=["moba", "nsa", "pooled_topk"])
@pytest.mark.parametrize("change", ["batch", "heads", "head_dim", "dtype", "device"])
def test_keys_that_do_not_continue_the_state_are_refused(sel, change):
    """After its first keys a state holds one cache geometry: new keys of another batch, KV head
    count, head dim, dtype or device raise ValueError naming the state's [B, Hkv, n, D], dtype and
    device, what was given and the fix (a new init_state())."""
    q, k = _qk(2, 4, 2, 9, 8, torch.float32, seed=3)
    state = sel.init_state(k[:, :, :8])
    q1, k1 = q[:, :, 8:], k[:, :, 8:]
    q1, k1 = {"batch": lambda: (q1[:1], k1[:1]), "heads": lambda: (q1, k1[:, :1]),
              "head_dim": lambda: (q1[..., :4], k1[..., :4]), "dtype": lambda: (q1.double(), k1.double()),
              "device": lambda: (q1.to("meta"), k1.to("meta"))}[change]()
    with pytest.raises(ValueError, match=r"do not continue the state's cache: expected \[B=2, Hkv=2, n, D=8\] "
                                         r"torch.float32 on cpu; .*needs a new init_state\(\)"):
        sel.step(q1, k1, state)
    assert state.length == 8


def test_q_and_k_on_different_devices_are_refused():
    q, k = _qk(1, 2, 1, 8, 8, torch.float32, seed=0)
    for sel in (selectors.moba(4, 2), selectors.nsa(4, 2), selectors.pooled_topk(4, 2)):
        with pytest.raises(ValueError, match="on one device, got q on cpu and k on meta"):
            sel(q, k.to("meta"))


@pytest.mark.parametrize("prefix", [0, 7, 8, 9])
def test_a_state_from_cached_keys_continues_as_one_built_by_steps(prefix):
    """``init_state(keys)`` (a cache filled without the state) holds what steps over those keys hold."""
    q, k = _qk(2, 4, 2, 21, 8, torch.float64, seed=prefix)
    for sel in (selectors.moba(4, 3), selectors.nsa(4, 3), selectors.pooled_topk(4, 2)):
        built = _decode(sel, q, k, max(prefix, 1), 1)[0]
        state = sel.init_state(k[:, :, :prefix]) if prefix else sel.init_state()
        for t in range(prefix, 21):
            sel.step(q[:, :, t:t + 1], k[:, :, t:t + 1], state)
        assert state.length == built.length == 21
        assert torch.equal(state.summaries, built.summaries) and torch.equal(state.tail, built.tail), repr(sel)
