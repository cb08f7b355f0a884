"""The selector's decode state on the Hugging Face KV cache (``integrations/transformers/decode_state.py``):
greedy ``generate()`` with the cache, whose steps select from the per-chunk state, equals greedy
decoding recomputed by full prefill passes without a cache (MoBA: a decode row selects as the same
row in prefill), for a batch of 2; speculative multi-token steps and a cropped cache; pooled top-k
with the state equals pooled top-k re-pooling the cache; a step reads no cached key."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers import decode_state, interface
from sparse_io_attn.nn import selectors

NAME = sia_hf.register()
VOCAB = 97


def _model(spec, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.sparse_attention = {"pattern": spec, "backend": "torch"}
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).eval()


GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _generate(model, ids, **kw):
    out = model.generate(ids, **GEN, **kw)
    return out.sequences, torch.stack(out.logits, 1), getattr(out, "past_key_values", None)


def _no_cache_greedy(model, ids, steps):
    """Greedy decoding by a full prefill forward (no cache) per new token: ``(sequences, logits)``."""
    logits = []
    for _ in range(steps):
        last = model(ids, use_cache=False).logits[:, -1]
        logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(logits, 1)


def _init_state_calls():
    """Counts ``MoBASelector.init_state`` calls that absorb cached keys (a rebuild, O(Nk x D))."""
    calls = []
    real = selectors.MoBASelector.init_state

    def counting(self, keys=None):
        calls.append(keys is not None)
        return real(self, keys)
    return calls, mock.patch.object(selectors.MoBASelector, "init_state", counting)


def test_moba_generate_with_state_is_greedy_prefill_decoding():
    model = _model("moba:block=8,top_k=3")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))   # 13 + 10: ragged
    with torch.no_grad():
        _generate(model, ids[:, :4])                                  # installs the cache hooks
        calls, patch = _init_state_calls()
        with patch:
            seq, logits, cache = _generate(model, ids)
        want_seq, want_logits = _no_cache_greedy(model, ids, 10)
    assert torch.equal(seq, want_seq)
    assert rel_err(logits, want_logits) < 1e-5
    assert calls and not any(calls)                                   # prefill built every state, no rebuild
    states = getattr(cache, decode_state.STATES_ATTR)
    assert sorted(layer for layer, _ in states) == [0, 1]
    for state in states.values():                                     # the last token is never fed back
        assert state.length == 13 + 10 - 1 and state.num_blocks == 22 // 8
        assert state.numel() <= 2 * 2 * (22 // 8 + 8) * 16


def test_speculative_steps_and_a_cropped_cache_continue_the_state():
    """1..16 new tokens per call over the cache (speculative verification), and ``crop`` (assisted
    decoding) dropping the states, give the rows of a full prefill."""
    model = _model("moba:block=4,top_k=2", seed=1)
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
    model = _model("pooled_topk:block=8,top_k=2", seed=2)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _generate(model, ids[:, :4])
        seq, logits, cache = _generate(model, ids)
        assert len(getattr(cache, decode_state.STATES_ATTR)) == 2
        with mock.patch.object(interface, "select_with_state", lambda *a: None):
            want_seq, want_logits, cache = _generate(model, ids)
    assert not getattr(cache, decode_state.STATES_ATTR, None)
    assert torch.equal(seq, want_seq) and rel_err(logits, want_logits) < 1e-6


@pytest.mark.parametrize("spec", ["moba:block=4,top_k=3", "pooled_topk:block=4,top_k=2"])
def test_a_step_reads_only_the_new_keys(spec):
    """The cached part of ``key`` is NaN: the step's selection is still the full selector's."""
    model = _model(spec)
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


def test_beam_search_moves_the_states_with_the_cache():
    """``reorder_cache`` (beam search) reorders the states' batch rows: beam search with the state
    equals beam search re-selecting over the whole cache at every step."""
    model = _model("moba:block=4,top_k=2", seed=4)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    beam = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=3)
    with torch.no_grad():
        model(ids[:, :2])                                             # installs the cache hooks
        calls, patch = _init_state_calls()
        with patch:
            got = model.generate(ids, **beam)
        with mock.patch.object(interface, "select_with_state", lambda *a: None):
            want = model.generate(ids, **beam)
    assert torch.equal(got, want)
    assert calls and not any(calls)                                   # no rebuild: the states were reordered


def test_crop_zero_keeps_the_states():
    model = _model("moba:block=4,top_k=2")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids[:, :2])
        cache = model(ids, use_cache=True).past_key_values
    cache.crop(0)
    assert len(getattr(cache, decode_state.STATES_ATTR)) == 2
    cache.reset()
    assert not getattr(cache, decode_state.STATES_ATTR)


def test_a_cache_that_takes_no_state_selects_over_the_whole_cache():
    model = _model("moba:block=4,top_k=2")
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
