"""NSA in a Transformers model (``integrations/transformers/nsa.py``): ``"nsa:block=..,num_blocks=..,window=.."``
with NSA's gates (``add_nsa_gates``) is fla's gated three-branch attention on the model's q/k/v; greedy
``generate()``, whose steps go through the NSA state on the ``Cache``, equals greedy decoding by full
prefill passes without a cache; speculative steps and a cropped cache give the prefill's rows; beam
search moves the states; a training forward (cache on) computes without the state and gets the
prefill's gradients; ``"nsa_selection:..."`` (the selection branch alone) decodes as its prefill too."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers import decode_state, nsa as hf_nsa
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.nsa import NSAAttention

NAME = sia_hf.register()
VOCAB = 97
NSA = "nsa:block=4,num_blocks=3,window=6"
GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _model(spec, seed=0, gates=True):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.sparse_attention = {"pattern": spec, "backend": "torch"}
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).eval()
    if gates:
        assert sia_hf.add_nsa_gates(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        with torch.no_grad():
            for layer in model.model.layers:          # trained-looking gates, not every gate 1/2
                layer.self_attn.g_proj.weight.normal_(0, 0.5)
    return model


def _ids(B, T, seed):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _no_cache_greedy(model, ids, steps):
    """Greedy decoding by a full prefill forward (no cache) per new token: ``(sequences, raw logits)``;
    like ``generate(min_new_tokens=steps)`` it never picks the end-of-sequence token."""
    logits, eos = [], model.generation_config.eos_token_id
    for _ in range(steps):
        last = model(ids, use_cache=False).logits[:, -1]
        logits.append(last)
        ids = torch.cat([ids, last.index_fill(-1, torch.tensor([eos]), -torch.inf).argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(logits, 1)


def _rebuilds():
    """Counts ``NSAAttention.init_state`` calls that absorb cached keys (a rebuild, O(Nk x D))."""
    calls = []
    real = NSAAttention.init_state

    def counting(self, keys=None, values=None):
        calls.append(keys is not None)
        return real(self, keys, values)
    return calls, mock.patch.object(NSAAttention, "init_state", counting)


def test_generate_with_the_nsa_state_is_greedy_prefill_decoding():
    model = _model(NSA)
    ids = _ids(2, 13, 0)                                              # 13 + 10 tokens: blocks of 4 completed
    no_rescan = mock.patch.object(selectors.NSASelector, "__call__", side_effect=AssertionError("whole cache"))
    with torch.no_grad():
        calls, patch = _rebuilds()
        with patch, no_rescan:
            out = model.generate(ids, **GEN)
        want_seq, want_logits = _no_cache_greedy(model, ids, 10)
    assert torch.equal(out.sequences, want_seq)
    assert rel_err(torch.stack(out.logits, 1), want_logits) < 1e-5
    assert calls and not any(calls)                                   # the prefill built every state
    states = getattr(out.past_key_values, decode_state.STATES_ATTR)
    assert sorted(layer for layer, _ in states) == [0, 1]
    for state in states.values():                                     # the last token is never fed back
        assert state.length == 22 and state.keys.num_blocks == 5
        assert state.numel() == 2 * 2 * 2 * (5 + 2) * 16             # keys and values: 5 blocks + a tail of 2


def test_speculative_steps_and_a_cropped_cache_give_the_prefill_rows():
    model = _model("nsa:block=4,num_blocks=2,window=5", seed=1)
    ids = _ids(2, 40, 1)
    with torch.no_grad():
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


def test_beam_search_moves_the_nsa_states():
    model = _model(NSA, seed=2)
    ids = _ids(2, 11, 2)
    beam = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=3)
    with torch.no_grad():
        calls, patch = _rebuilds()
        with patch:
            got = model.generate(ids, **beam)
        with mock.patch.object(hf_nsa, "_state", lambda *a: None):   # every call over the whole cache
            want = model.generate(ids, **beam)
    assert torch.equal(got, want)
    assert calls and not any(calls)


def test_a_training_forward_with_a_cache_gets_the_prefill_gradients():
    """Llama's forward makes a cache by default: the NSA state (detached) is not used where gradients
    flow, so the compressed branch's keys and values and the gates get their gradients."""
    model = _model(NSA, seed=3)
    ids = _ids(1, 19, 3)
    grads = []
    for use_cache in (True, False):
        model.zero_grad()
        model(ids, use_cache=use_cache).logits.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(*grads))
    assert model.model.layers[0].self_attn.g_proj.weight.grad.abs().sum() > 0


def test_nsa_selection_spec_decodes_as_its_prefill():
    """NSA's selection branch alone as the attention function (no weights), through the selector's
    state on the cache."""
    model = _model("nsa_selection:block=4,num_blocks=3", seed=4, gates=False)
    ids = _ids(2, 13, 4)
    with torch.no_grad():
        model(ids[:, :2])                                             # installs the cache hooks
        out = model.generate(ids, **GEN)
        want_seq, want_logits = _no_cache_greedy(model, ids, 10)
    assert torch.equal(out.sequences, want_seq)
    assert rel_err(torch.stack(out.logits, 1), want_logits) < 1e-5
    assert len(getattr(out.past_key_values, decode_state.STATES_ATTR)) == 2
    pat = sia_hf.layer_pattern(model.config, 0)
    assert isinstance(pat.selector, selectors.NSASelector) and pat.block_size == (4, 4)


def test_nsa_errors():
    model = _model(NSA, gates=False)
    ids = _ids(2, 6, 5)
    with pytest.raises(ValueError, match="add_nsa_gates"):
        model(ids)
    sia_hf.add_nsa_gates(model)
    with pytest.raises(NotImplementedError, match="element mask"):
        model(ids, attention_mask=torch.tensor([[1] * 6, [0, 0] + [1] * 4]))
    with pytest.raises(ValueError, match="no attention module of this model runs 'nsa:"):
        sia_hf.add_nsa_gates(_model("moba:block=4,top_k=2", gates=False))
    cfg = model.config
    for spec, match in (("nsa:block=4,num_blocks=3", "misses"), ("nsa:block=4,num_blocks=3,window=-1", "window"),
                        ("nsa_selection:block=4", "misses")):
        cfg.sparse_attention = spec
        with pytest.raises(ValueError, match=f"config.sparse_attention: .*{match}"):
            sia_hf.layer_pattern(cfg, 0)
    cfg.sparse_attention = NSAAttention(4, 3, 6)
    assert sia_hf.layer_pattern(cfg, 1).selector is cfg.sparse_attention
