"""The selector's decode state on the Hugging Face KV cache (``integrations/transformers/decode_state.py``):
greedy ``generate()`` with the cache, whose steps select from the per-chunk state, equals greedy
decoding recomputed by full prefill passes without a cache (MoBA: a decode row selects as the same
row in prefill), for a batch of 2; speculative multi-token steps and a cropped cache (MoBA, and NSA's
state of ``"nsa:"``); beam search moves the states; pooled top-k with the state equals pooled top-k
re-pooling the cache; a step reads no cached key."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import greedy_by_prefill, init_state_calls, tiny_llama

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers import decode_state
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.nsa import NSAAttention

VOCAB = 97
#: an NSA model ("nsa:", NSA's gated branches: its state on the cache holds compressed keys and values)
NSA = "nsa:block=4,num_blocks=2,window=5"


GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _generate(model, ids, **kw):
    out = model.generate(ids, **GEN, **kw)
    return out.sequences, torch.stack(out.logits, 1), getattr(out, "past_key_values", None)


def _without_state():
    """Every call over the whole cache, no state."""
    return mock.patch.object(decode_state, "state_on_cache", lambda *a: None)


def test_moba_generate_with_state_is_greedy_prefill_decoding():
    model = tiny_llama("moba:block=8,top_k=3")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))   # 13 + 10: ragged
    with torch.no_grad():
        _generate(model, ids[:, :4])                                  # installs the cache hooks
        calls, patch = init_state_calls(selectors.MoBASelector)
        with patch:
            seq, logits, cache = _generate(model, ids)
        want_seq, want_logits = greedy_by_prefill(model, ids, 10)
    assert torch.equal(seq, want_seq)
    assert rel_err(logits, want_logits) < 1e-5
    assert calls and not any(calls)                                   # prefill built every state, no rebuild
    states = getattr(cache, decode_state.STATES_ATTR)
    assert sorted(layer for layer, _ in states) == [0, 1]
    for state in states.values():                                     # the last token is never fed back
        assert state.length == 13 + 10 - 1 and state.num_blocks == 22 // 8
        assert state.numel() <= 2 * 2 * (22 // 8 + 8) * 16


@pytest.mark.parametrize("spec", ["moba:block=4,top_k=2", NSA])
def test_speculative_steps_and_a_cropped_cache_continue_the_state(spec):
    """1..16 new tokens per call over the cache (speculative verification), and ``crop`` (assisted
    decoding) dropping the states, give the rows of a full prefill."""
    model = tiny_llama(spec, seed=1)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :2])                                             # installs the cache hooks
        want = model(ids, use_cache=False).logits
        out = model(ids[:, :9], use_cache=True)
        cache, t = out.past_key_values, 9
        for n in (1, 3, 16, 5):
            got = model(ids[:, t:t + n], cache=cache, use_cache=True).logits
            assert rel_err(got, want[:, t:t + n]) < 1e-5, (t, n)
            t += n
        assert all(s.length == t for s in getattr(cache, decode_state.STATES_ATTR).values())
        cache.crop(-6)
        assert not getattr(cache, decode_state.STATES_ATTR)           # dropped: rebuilt on the next call
        t -= 6
        got = model(ids[:, t:t + 4], cache=cache, use_cache=True).logits
        assert rel_err(got, want[:, t:t + 4]) < 1e-5


def test_pooled_generate_with_state_is_pooled_over_the_whole_cache():
    """pooled_topk's query blocks are a call's rows (a decode step is not the prefill's choice), so
    the check is against the same selector re-pooling every cached key at every step."""
    model = tiny_llama("pooled_topk:block=8,top_k=2", seed=2)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _generate(model, ids[:, :4])
        seq, logits, cache = _generate(model, ids)
        assert len(getattr(cache, decode_state.STATES_ATTR)) == 2
        with _without_state():
            want_seq, want_logits, cache = _generate(model, ids)
    assert not getattr(cache, decode_state.STATES_ATTR, None)
    assert torch.equal(seq, want_seq) and rel_err(logits, want_logits) < 1e-6


@pytest.mark.parametrize("spec", ["moba:block=4,top_k=3", "pooled_topk:block=4,top_k=2"])
def test_a_step_reads_only_the_new_keys(spec):
    """The cached part of ``key`` is NaN: the step's selection is still the full selector's."""
    model = tiny_llama(spec)
    attn = model.model.layers[0].self_attn
    selector, _ = sia_hf.layouts.module_selector(attn, "bottom_right")
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 23, 16, generator=g), torch.randn(2, 2, 23, 16, generator=g)

    class Cache:                                                      # a cache passed in the attention kwargs
        pass
    cache = Cache()
    decode_state.select_with_state(attn, selector, q[:, :, :14], k[:, :, :14], {"cache": cache})
    for a, b in ((14, 15), (15, 18), (18, 23)):
        poisoned = k[:, :, :b].clone()
        poisoned[:, :, :a] = float("nan")
        got = decode_state.select_with_state(attn, selector, q[:, :, a:b], poisoned, {"cache": cache})
        want = selector(q[:, :, a:b], k[:, :, :b])
        if isinstance(want, selectors.Selection):
            assert torch.equal(got.indices, want.indices), (a, b)
        else:
            assert torch.equal(got.to_dense_mask(), want.to_dense_mask()), (a, b)
    state, = getattr(cache, decode_state.STATES_ATTR).values()
    assert state.length == 23
    # a state that does not continue this cache (another length) is rebuilt from the keys
    got = decode_state.select_with_state(attn, selector, q[:, :, 20:21], k[:, :, :21], {"cache": cache})
    want = selector(q[:, :, 20:21], k[:, :, :21])
    assert state is not getattr(cache, decode_state.STATES_ATTR)[(0, repr(selector))]
    assert torch.equal(got.to_dense_mask() if hasattr(got, "to_dense_mask") else got.indices,
                       want.to_dense_mask() if hasattr(want, "to_dense_mask") else want.indices)


@pytest.mark.parametrize("spec,owner", [("moba:block=4,top_k=2", selectors.MoBASelector), (NSA, NSAAttention)])
def test_beam_search_moves_the_states_with_the_cache(spec, owner):
    """``reorder_cache`` (beam search) reorders the states' batch rows: beam search with the state
    equals beam search re-selecting over the whole cache at every step."""
    model = tiny_llama(spec, seed=4)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    beam = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=3)
    with torch.no_grad():
        model(ids[:, :2])                                             # installs the cache hooks
        calls, patch = init_state_calls(owner)
        with patch:
            got = model.generate(ids, **beam)
        with _without_state():
            want = model.generate(ids, **beam)
    assert torch.equal(got, want)
    assert calls and not any(calls)                                   # no rebuild: the states were reordered


def test_crop_zero_keeps_the_states():
    model = tiny_llama("moba:block=4,top_k=2")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids[:, :2])
        cache = model(ids, use_cache=True).past_key_values
    cache.crop(0)
    assert len(getattr(cache, decode_state.STATES_ATTR)) == 2
    cache.reset()
    assert not getattr(cache, decode_state.STATES_ATTR)


def test_a_cache_that_takes_no_state_selects_over_the_whole_cache():
    model = tiny_llama("moba:block=4,top_k=2")
    attn = model.model.layers[0].self_attn
    selector, _ = sia_hf.layouts.module_selector(attn, "bottom_right")

    class SlotCache:                                                  # no __dict__, no weak references
        __slots__ = ()
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    assert decode_state.select_with_state(attn, selector, q, k, {"cache": SlotCache()}) is None
    # no cache in the kwargs: the first call installs the pre-hook and selects over the whole cache
    assert not attn._forward_pre_hooks
    assert decode_state.select_with_state(attn, selector, q, k, {}) is None and len(attn._forward_pre_hooks) == 1
    model(torch.zeros(1, 3, dtype=torch.long), use_cache=False)      # a forward without a cache: still none
    assert decode_state.select_with_state(attn, selector, q, k, {}) is None and len(attn._forward_pre_hooks) == 1
