"""NSA in a Transformers model (``integrations/transformers/nsa.py``): ``"nsa:block=..,num_blocks=..,window=.."``
with NSA's gates (``add_nsa_gates``) is fla's gated three-branch attention on the model's q/k/v; greedy
``generate()``, whose steps go through the NSA state on the ``Cache`` (no rebuild, no selection over
the whole cache), equals greedy decoding by full prefill passes without a cache; a training forward
(cache on) computes without the state and gets the prefill's gradients; ``"nsa_selection:..."`` (the
selection branch alone) decodes as its prefill too. Speculative steps, crop and beam search with the
NSA state: ``test_transformers_decode_state.py``."""
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

NSA = "nsa:block=4,num_blocks=3,window=6"
GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _ids(B, T, seed):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_generate_with_the_nsa_state_is_greedy_prefill_decoding():
    model = tiny_llama(NSA)
    ids = _ids(2, 13, 0)                                              # 13 + 10 tokens: blocks of 4 completed
    no_rescan = mock.patch.object(selectors.NSASelector, "__call__", side_effect=AssertionError("whole cache"))
    calls, rebuilds = init_state_calls(NSAAttention)
    with torch.no_grad():
        with rebuilds, no_rescan:
            out = model.generate(ids, **GEN)
        want_seq, want_logits = greedy_by_prefill(model, ids, 10)
    assert torch.equal(out.sequences, want_seq)
    assert rel_err(torch.stack(out.logits, 1), want_logits) < 1e-5
    assert calls and not any(calls)                                   # the prefill built every state
    states = getattr(out.past_key_values, decode_state.STATES_ATTR)
    assert sorted(layer for layer, _ in states) == [0, 1]
    for state in states.values():                                     # the last token is never fed back
        assert state.length == 22 and state.keys.num_blocks == 5
        assert state.numel() == 2 * 2 * 2 * (5 + 2) * 16             # keys and values: 5 blocks + a tail of 2


def test_a_training_forward_with_a_cache_gets_the_prefill_gradients():
    """Llama's forward makes a cache by default: the NSA state (detached) is not used where gradients
    flow, so the compressed branch's keys and values and the gates get their gradients."""
    model = tiny_llama(NSA, seed=3)
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
    model = tiny_llama("nsa_selection:block=4,num_blocks=3", seed=4, gates=False)
    ids = _ids(2, 13, 4)
    with torch.no_grad():
        model(ids[:, :2])                                             # installs the cache hooks
        out = model.generate(ids, **GEN)
        want_seq, want_logits = greedy_by_prefill(model, ids, 10)
    assert torch.equal(out.sequences, want_seq)
    assert rel_err(torch.stack(out.logits, 1), want_logits) < 1e-5
    assert len(getattr(out.past_key_values, decode_state.STATES_ATTR)) == 2
    pat = sia_hf.layer_pattern(model.config, 0)
    assert isinstance(pat.selector, selectors.NSASelector) and pat.block_size == (4, 4)


def test_nsa_errors():
    model = tiny_llama(NSA, gates=False)
    ids = _ids(2, 6, 5)
    with pytest.raises(ValueError, match="add_nsa_gates"):
        model(ids)
    sia_hf.add_nsa_gates(model)
    with pytest.raises(NotImplementedError, match="element mask"):   # a hole: not a sequence, not padding
        model(ids, attention_mask=torch.tensor([[1] * 6, [1, 0] + [1] * 4]))
    with pytest.raises(ValueError, match="no attention module of this model runs 'nsa:"):
        sia_hf.add_nsa_gates(tiny_llama("moba:block=4,top_k=2", gates=False))
    cfg = model.config
    for spec, match in (("nsa:block=4,num_blocks=3", "misses"), ("nsa:block=4,num_blocks=3,window=-1", "window"),
                        ("nsa_selection:block=4", "misses")):
        cfg.sparse_attention = spec
        with pytest.raises(ValueError, match=f"config.sparse_attention: .*{match}"):
            sia_hf.layer_pattern(cfg, 0)
    cfg.sparse_attention = NSAAttention(4, 3, 6)
    assert sia_hf.layer_pattern(cfg, 1).selector is cfg.sparse_attention


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_computes_each_sequence_as_alone(side):
    """``"nsa:"`` under a padding mask: one packed call (compression blocks, selection and window restart
    at each sequence's first token), each sequence's logits those of the sequence run alone."""
    model = tiny_llama(NSA, seed=6)
    lengths, T = (13, 9), 13
    seqs = [_ids(1, n, 10 + i) for i, n in enumerate(lengths)]
    ids, mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for b, (seq, n) in enumerate(zip(seqs, lengths)):
        cols = slice(T - n, T) if side == "left" else slice(0, n)
        ids[b, cols], mask[b, cols] = seq[0], 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        for b, (seq, n) in enumerate(zip(seqs, lengths)):
            want = model(seq, use_cache=False).logits[0]
            cols = slice(T - n, T) if side == "left" else slice(0, n)
            assert rel_err(got[b, cols], want) < 1e-5, (b, rel_err(got[b, cols], want))


def test_a_padded_batch_on_triton_runs_packed():
    """``"nsa:"`` under a padding mask on backend 'triton' (the interpreter here): the packed call (its
    selection branch with cu_seqlens on the Triton kernels) computes what backend 'torch' computes."""
    ids, mask = _ids(2, 9, 11), torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])
    logits = []
    for backend in ("triton", "torch"):
        model = tiny_llama(NSA, seed=7)             # (the same weights; a model resolves its pattern once)
        model.config.sparse_attention = {"pattern": NSA, "backend": backend}
        with torch.no_grad(), mock.patch.object(NSAAttention, "packed", autospec=True,
                                                side_effect=NSAAttention.packed) as packed:
            logits.append(model(ids, attention_mask=mask, use_cache=False).logits)
        assert packed.called and all(c.kwargs["backend"] == backend for c in packed.call_args_list)
    keep = mask.bool()
    assert rel_err(logits[0][keep], logits[1][keep]) < 1e-5

