"""Hugging Face integration with a data-dependent selection: ``config.sparse_attention =
"moba:block=...,top_k=..."`` against `sdpa` under the element mask the selector chooses from the
same queries and keys (prefill, padded batches, generation), and the spec's errors."""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.nn import selectors

NAME = sia_hf.register()
VOCAB = 97
SPEC = "moba:block=8,top_k=2"


def _config(**kw):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)


def _moba_reference(module, query, key, value, attention_mask, **kwargs):
    """`sdpa` under the selection's element mask: the selector on the same q/k (float64 scores do not
    change the choice here), bottom-right causal, the model's own mask."""
    q, kv = query.shape[2], key.shape[2]
    layout = selectors.moba(8, 2, causal="bottom_right")(query, key)
    group = query.shape[1] // key.shape[1]
    mask = layout.to_dense_mask().repeat_interleave(group, 1)          # [B, Hq, q, kv]
    i = torch.arange(kv - q, kv)[:, None]
    mask = mask & (torch.arange(kv)[None, :] <= i)
    if attention_mask is not None:
        mask = mask & attention_mask
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


REF = "sdpa_moba_reference"
AttentionInterface.register(REF, _moba_reference)
AttentionMaskInterface.register(REF, sdpa_mask)


def _pair():
    cfg = _config()
    cfg.sparse_attention = SPEC
    sp = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    ref = AutoModelForCausalLM.from_config(_config(), attn_implementation=REF)
    ref.load_state_dict(sp.state_dict())
    return ref.eval(), sp.eval()


def test_moba_spec_matches_reference_logits_and_grads():
    torch.manual_seed(0)
    ref, sp = _pair()
    ids = torch.randint(0, VOCAB, (2, 45))      # ragged: 45 tokens in blocks of 8
    outs = []
    for model in (ref, sp):
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert rel_err(outs[1][0], outs[0][0]) < 1e-5
    for name, g in outs[0][1].items():
        assert rel_err(outs[1][1][name], g) < 1e-4, name
    # without an element mask the selection is the layout: no static layout was built beside it
    cached = [key for m in sp.modules() for key in getattr(m, "_sparse_io_attn_layouts", {})]
    assert cached and all(key[0] == "selector" for key in cached), cached


def test_moba_spec_with_padding_and_generation():
    torch.manual_seed(1)
    ref, sp = _pair()
    ids = torch.randint(0, VOCAB, (2, 30))
    am = torch.ones(2, 30, dtype=torch.long)
    am[1, 22:] = 0                                   # right padding: the mask path intersects
    with torch.no_grad():
        a = sp(ids, attention_mask=am).logits
        b = ref(ids, attention_mask=am).logits
    assert rel_err(a[am.bool()], b[am.bool()]) < 1e-5
    prompt = ids[:1, :20]
    with torch.no_grad():
        got = sp.generate(prompt, max_new_tokens=6, do_sample=False)
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_selector_specs_and_errors():
    sel = selectors.from_spec("moba:64,8")
    assert (sel.block_size, sel.top_k) == (64, 8)
    assert selectors.from_spec(" moba : k=4, block=32").top_k == 4
    assert selectors.is_spec("moba:block=64,top_k=8") and not selectors.is_spec("sliding_window:64")
    for bad, match in (("moba:block=64", "misses"), ("moba:block=x,top_k=2", "must be an int"),
                       ("moba:block=64,top_k=2,z=1", "unexpected"), ("moba:block=0,top_k=2", "positive")):
        with pytest.raises(ValueError, match=match):
            selectors.from_spec(bad)
    cfg = _config()
    cfg.sparse_attention = "moba:block=8"
    with pytest.raises(ValueError, match="config.sparse_attention: .*misses"):
        sia_hf.layer_pattern(cfg, 0)
    cfg.sparse_attention = [SPEC, "sliding_window:16"]
    pat = sia_hf.layer_pattern(cfg, 0)
    assert pat.selector is not None and pat.is_dense and pat.block_size == (8, 8)
    assert sia_hf.layer_pattern(cfg, 1).selector is None
