"""Hugging Face integration with data-dependent selections.

``config.sparse_attention = "moba:block=...,top_k=..."`` runs exact MoBA: against MoBA's own prefill
(the transcribed ``moba_attn_varlen_naive`` with K/V repeated per query head, as ``moba/wrapper.py``)
registered as an attention implementation; padded (left and right) and packed batches against the
same model run on each sequence alone (MoBA's varlen semantics: chunks restart per sequence);
generation with the KV cache (decode rows, bottom-right) against generation that re-runs MoBA's
prefill at every step. ``"pooled_topk:..."`` (the former ``"moba:..."`` selector) against ``sdpa``
under the element mask the selector chooses; padded, packed and static-cache calls against the same
sequence alone (in float64, and against the float64 reference), generation with a static cache or a
left-padded batch against each prompt's generation alone. And the specs' errors."""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from selection.transcribed import moba
from sparse_io_attn import BlockSparseLayout, Selection, block_sparse_attention
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers.layouts import remember_mask, selection_layout_with_mask
from sparse_io_attn.selection.reference import selection_reference
from sparse_io_attn.nn import selectors

NAME = sia_hf.register()
VOCAB = 97
POOLED = "pooled_topk:block=8,top_k=2"
MOBA = "moba:block=8,top_k=3"
MOBA_TORCH = {"pattern": MOBA, "backend": "torch"}   # selection_attention's torch backend (any machine)


def _config(**kw):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)


def _pooled_reference(module, query, key, value, attention_mask, **kwargs):
    """`sdpa` under the pooled selection's element mask: the selector on the same q/k, bottom-right
    causal, the model's own mask."""
    q, kv = query.shape[2], key.shape[2]
    layout = selectors.pooled_topk(8, 2, causal="bottom_right")(query, key)
    group = query.shape[1] // key.shape[1]
    mask = layout.to_dense_mask().repeat_interleave(group, 1)          # [B, Hq, q, kv]
    i = torch.arange(kv - q, kv)[:, None]
    mask = mask & (torch.arange(kv)[None, :] <= i)
    if attention_mask is not None:
        mask = mask & attention_mask
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


def _moba_prefill_reference(module, query, key, value, attention_mask, **kwargs):
    """MoBA's own prefill: moba/wrapper.py repeats K/V to the query heads and calls the kernel per
    sequence (here the transcribed moba_attn_varlen_naive); no mask, q_len == kv_len only."""
    assert attention_mask is None and query.shape[2] == key.shape[2], "MoBA's reference runs unpadded prefill"
    B, Hq, N, D = query.shape
    pack = lambda t: t.repeat_interleave(Hq // t.shape[1], 1).permute(0, 2, 1, 3).reshape(B * N, Hq, D)  # noqa: E731
    cu = torch.arange(B + 1, dtype=torch.int32) * N
    o = moba.moba_attn_varlen_naive(pack(query), pack(key), pack(value), cu, N, 8, 3)
    return o.view(B, N, Hq, D), None


AttentionInterface.register("sdpa_pooled_reference", _pooled_reference)
AttentionMaskInterface.register("sdpa_pooled_reference", sdpa_mask)
AttentionInterface.register("moba_prefill_reference", _moba_prefill_reference)
AttentionMaskInterface.register("moba_prefill_reference", lambda *args, **kwargs: None)


def _pair(spec, reference):
    cfg = _config()
    cfg.sparse_attention = spec
    sp = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    ref = AutoModelForCausalLM.from_config(_config(), attn_implementation=reference)
    ref.load_state_dict(sp.state_dict())
    return ref.eval(), sp.eval()


def _logits_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kw).logits
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------- exact MoBA
def test_moba_spec_is_mobas_prefill():
    torch.manual_seed(0)
    ref, sp = _pair(MOBA_TORCH, "moba_prefill_reference")
    ids = torch.randint(0, VOCAB, (2, 45))      # ragged: 45 tokens in chunks of 8
    (a, ga), (b, gb) = _logits_and_grads(sp, ids), _logits_and_grads(ref, ids)
    assert rel_err(a, b) < 1e-5
    for name, g in gb.items():
        assert rel_err(ga[name], g) < 1e-4, name
    cached = [key for m in sp.modules() for key in getattr(m, "_sparse_io_attn_layouts", {})]
    assert cached and all(key[0] == "selector" for key in cached), cached       # no layout built beside it


def test_moba_spec_with_left_and_right_padding_is_moba_of_each_sequence():
    """Padded rows: each sequence's chunks start at its first token (MoBA of the unpadded sequence)."""
    torch.manual_seed(1)
    ref, sp = _pair(MOBA_TORCH, "moba_prefill_reference")
    ids = torch.randint(0, VOCAB, (2, 30))
    am = torch.ones(2, 30, dtype=torch.long)
    am[0, :5] = 0                                    # left padding
    am[1, 22:] = 0                                   # right padding
    with torch.no_grad():
        got = sp(ids, attention_mask=am).logits
        for b in range(2):
            keep = am[b].bool()
            want = ref(ids[b:b + 1, keep]).logits[0]
            assert rel_err(got[b, keep], want) < 1e-4, b   # RoPE at shifted positions: rounding only


def test_moba_spec_with_padding_on_triton_runs_the_packed_call(monkeypatch):
    """The Triton kernels take cu_seqlens: a padded batch on backend 'triton' (the interpreter here) runs the
    packed call, as the torch backend does, and computes what the torch backend computes."""
    from sparse_io_attn.integrations.transformers import interface
    packed_backends = []
    packed_call = interface._packed_call
    monkeypatch.setattr(interface, "_packed_call",          # (selector, packed, q, k, v, scaling, backend, sinks)
                        lambda *a: packed_backends.append(a[6]) or packed_call(*a))
    torch.manual_seed(4)
    models = []
    moba16 = "moba:block=16,top_k=2"                  # the Triton block-sparse kernels' tiles: blocks of 16+
    for spec in ({"pattern": moba16, "backend": "triton"}, {"pattern": moba16, "backend": "torch"}):
        cfg = _config()
        cfg.sparse_attention = spec
        models.append(AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).eval())
    sp, ref = models
    ref.load_state_dict(sp.state_dict())
    ids = torch.randint(0, VOCAB, (2, 40))
    am = torch.ones(2, 40, dtype=torch.long)
    am[0, :3] = 0
    with torch.no_grad():
        got, want = sp(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    keep = am.bool()
    assert rel_err(got[keep], want[keep]) < 1e-5
    layers = len(packed_backends) // 2
    assert layers and packed_backends == ["triton"] * layers + ["torch"] * layers


def test_moba_spec_with_packed_sequences_is_mobas_varlen():
    """position_ids restarting at 0 (packing: no attention_mask, no cache): MoBA's cu_seqlens semantics."""
    torch.manual_seed(2)
    ref, sp = _pair(MOBA_TORCH, "moba_prefill_reference")
    lens = (17, 23)
    ids = torch.randint(0, VOCAB, (1, sum(lens)))
    pid = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        got = sp(ids, position_ids=pid, use_cache=False).logits[0]
        want = torch.cat([ref(ids[:, :17]).logits[0], ref(ids[:, 17:]).logits[0]])
    assert rel_err(got, want) < 1e-5


def test_moba_spec_generates_as_mobas_prefill_at_every_step():
    """Decode rows (bottom-right, over the KV cache) select as the same rows in prefill: greedy
    generation with the cache equals generation that re-runs MoBA's prefill at every step, also for a
    left-padded batch (the padded path, per sequence)."""
    torch.manual_seed(3)
    ref, sp = _pair(MOBA_TORCH, "moba_prefill_reference")
    prompts = [torch.randint(0, VOCAB, (1, n)) for n in (20, 13)]
    with torch.no_grad():
        gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)      # no early end of sequence
        want = [ref.generate(p, use_cache=False, **gen) for p in prompts]
        assert torch.equal(sp.generate(prompts[0], **gen), want[0])
        batch = torch.zeros(2, 20, dtype=torch.long)
        am = torch.zeros(2, 20, dtype=torch.long)
        for b, p in enumerate(prompts):
            batch[b, 20 - p.shape[1]:], am[b, 20 - p.shape[1]:] = p[0], 1
        got = sp.generate(batch, attention_mask=am, pad_token_id=0, **gen)
    for b, p in enumerate(prompts):
        assert torch.equal(got[b, 20:], want[b][0, p.shape[1]:]), b


def test_masks_without_per_sequence_meaning_are_refused():
    sel = selectors.moba(4, 2, causal="bottom_right")
    q, k = torch.randn(1, 2, 12, 8), torch.randn(1, 1, 12, 8)
    i = torch.arange(12)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)          # a model's own sliding window
    with pytest.raises(NotImplementedError, match="not one sequence"):
        selection_layout_with_mask(sel, window[None, None], q, k, (4, 4))
    with pytest.raises(NotImplementedError, match="after its own position"):
        selection_layout_with_mask(sel, torch.ones(1, 1, 12, 12, dtype=torch.bool), q, k, (4, 4))
    cfg = _config()
    cfg.sparse_attention = MOBA
    attn = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).model.layers[0].self_attn
    with pytest.raises(ValueError, match="causal by definition"):
        sia_hf.layouts.module_selector(attn, False)


# ------------------------------------------------------------------ any selector under an element mask
def _masked_case(case: str):
    """``(allowed bool [B, 1, q, kv], q, q_offset, sequences [(b, r0, r1, a, end)], window)``: a model's
    element mask and the sequences in it (query rows ``r0:r1`` of batch element ``b`` over keys
    ``a:end``); ``window`` a sliding window the mask adds (or ``None``)."""
    kv, window, pads = 26, None, (0, 0)
    if case == "static-cache":          # 15 queries at positions 0..14, 26 preallocated slots
        q, q_offset, lens = 15, 0, (15, 15)
    elif case == "decode":              # 2 new tokens at positions 24, 25 over a left-padded cache
        q, q_offset, lens, pads = 2, 24, (26, 26), (5, 0)
    else:
        q, q_offset, lens = kv, 0, ((21, 26) if case == "right-padded" else (26, 26))
        pads = (5, 0) if case in ("left-padded", "window") else pads
        window = 7 if case == "window" else None
    i = torch.arange(q)[:, None] + q_offset
    j = torch.arange(kv)[None, :]
    allowed = torch.stack([(j <= i) & (j >= pads[b]) & (j < lens[b]) for b in range(2)])[:, None]
    if window is not None:
        allowed &= j > i - window
    if case == "packed":                # documents [0, 11) and [11, 26) of row 0
        doc = (torch.arange(kv) >= 11).long()
        allowed[0, 0] &= doc[:, None] == doc[None, :]
        seqs = [(0, 0, 11, 0, 11), (0, 11, 26, 11, 26), (1, 0, 26, 0, 26)]
    else:
        seqs = [(b, max(pads[b] - q_offset, 0), min(lens[b], i[-1, 0] + 1) - q_offset, pads[b],
                 min(lens[b], i[-1, 0] + 1)) for b in range(2)]
    return allowed, q, q_offset, seqs, window


def _alone_reference(sel, q, k, v, window):
    """float64 output of ``sel``'s choice on one sequence alone (bottom-right, no mask; within
    ``window`` if given)."""
    chosen = sel(q, k)
    if isinstance(chosen, Selection):
        return selection_reference(q, k, v, chosen, causal="bottom_right")[0]
    if window is not None:
        i = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2]
        j = torch.arange(k.shape[2])[None, :]
        chosen = chosen & BlockSparseLayout.from_dense_mask(j > i - window, chosen.block_size)
    return attention_reference(q, k, v, chosen, causal="bottom_right")[0]


@pytest.mark.parametrize("kind", ["pooled_topk", "moba"])
@pytest.mark.parametrize("case", ["left-padded", "right-padded", "packed", "static-cache", "decode", "window"])
def test_selectors_under_a_mask_choose_from_each_sequence_alone(kind, case):
    """The selection under a padded, packed, static-cache, decode-over-a-padded-cache or windowed mask,
    run by the attention, gives each sequence's rows the float64 output of the selector run on that
    sequence alone (its rows, its written keys); rows in no sequence (right padding's pad rows, a
    static cache's absent rows) output 0. A per-token selector under a window is refused."""
    sel = selectors.pooled_topk(4, 2, causal="bottom_right") if kind == "pooled_topk" else \
        selectors.moba(4, 3, causal="bottom_right")
    allowed, nq, q_offset, seqs, window = _masked_case(case)
    q, k, v = torch.randn(2, 4, nq, 8), torch.randn(2, 2, 26, 8), torch.randn(2, 2, 26, 8)
    mask = remember_mask(allowed.clone(), q_offset, 0, False)     # where the queries sit, as the model's mask
    if window is not None and sel.per_token:
        with pytest.raises(NotImplementedError, match="not one sequence"):
            selection_layout_with_mask(sel, mask, q, k, (4, 4))
        return
    layout = selection_layout_with_mask(sel, mask, q, k, (4, 4))
    got = block_sparse_attention(q, k, v, layout, causal=False, backend="torch")
    covered = torch.zeros(2, nq, dtype=torch.bool)
    for b, r0, r1, a, end in seqs:
        want = _alone_reference(sel, q[b:b + 1, :, r0:r1], k[b:b + 1, :, a:end], v[b:b + 1, :, a:end], window)
        assert rel_err(got[b:b + 1, :, r0:r1], want) < 1e-5, (b, r0, r1)
        covered[b, r0:r1] = True
    assert torch.equal(got.permute(0, 2, 1, 3)[~covered], torch.zeros_like(got.permute(0, 2, 1, 3)[~covered]))


# ------------------------------------------------------------------------------------ pooled top-k
def test_pooled_spec_matches_reference_logits_and_grads():
    torch.manual_seed(0)
    ref, sp = _pair(POOLED, "sdpa_pooled_reference")
    ids = torch.randint(0, VOCAB, (2, 45))
    (a, ga), (b, gb) = _logits_and_grads(sp, ids), _logits_and_grads(ref, ids)
    assert rel_err(a, b) < 1e-5
    for name, g in gb.items():
        assert rel_err(ga[name], g) < 1e-4, name


def _alone(model, ids):
    with torch.no_grad():
        return model(ids).logits[0]


# each sequence's real tokens are not a multiple of the block (8), so padding would enter its blocks
@pytest.mark.parametrize("case", ["left-padded", "right-padded", "packed", "static-cache"])
def test_pooled_spec_chooses_from_each_sequence_alone(case):
    """Left and right padding, two documents packed in one row (restarting position_ids) and a
    static cache (a 21-token prefill in 40 slots): every real token's logits equal the same
    sequence run alone without padding, packing or cache, and equal the float64 reference on that
    sequence alone (pad tokens, a neighbour document or unwritten cache slots never enter the
    selector's block means)."""
    torch.manual_seed(7)
    ref, sp = _pair(POOLED, "sdpa_pooled_reference")
    ref.double()
    a, b = torch.randint(0, VOCAB, (1, 21)), torch.randint(0, VOCAB, (1, 13))
    pad = torch.zeros(1, 6, dtype=torch.long)
    with torch.no_grad():
        if case == "left-padded":
            ids, am = torch.cat([pad, a], 1), torch.cat([torch.zeros(1, 6), torch.ones(1, 21)], 1).long()
            got = [sp(ids, attention_mask=am).logits[0, 6:]]
        elif case == "right-padded":
            ids, am = torch.cat([a, pad], 1), torch.cat([torch.ones(1, 21), torch.zeros(1, 6)], 1).long()
            got = [sp(ids, attention_mask=am).logits[0, :21]]
        elif case == "packed":
            pid = torch.cat([torch.arange(21), torch.arange(13)])[None]
            out = sp(torch.cat([a, b], 1), position_ids=pid, use_cache=False).logits[0]
            got = [out[:21], out[21:]]
        else:
            cache = StaticCache(config=sp.config, max_cache_len=40)
            got = [sp(a, cache=cache).logits[0]]
    for g, seq in zip(got, (a, b)):
        assert rel_err(g, _alone(sp, seq)) < 1e-5           # RoPE at shifted positions: rounding only
        assert rel_err(g.double(), _alone(ref, seq)) < 1e-5


def test_pooled_spec_generates_as_each_prompt_alone_with_static_cache_and_left_padding():
    """Greedy generate() with a static cache equals generate() with the dynamic cache (its decode steps
    select over the written slots only), and a left-padded batch generates what each prompt
    generates alone."""
    torch.manual_seed(5)
    _, sp = _pair(POOLED, "sdpa_pooled_reference")
    prompts = [torch.randint(0, VOCAB, (1, n)) for n in (19, 12)]
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True,
               output_logits=True)
    with torch.no_grad():
        alone = [sp.generate(p, **gen) for p in prompts]
        static = sp.generate(prompts[0], cache_implementation="static", **gen)
        assert torch.equal(static.sequences, alone[0].sequences)
        assert rel_err(torch.stack(static.logits, 1), torch.stack(alone[0].logits, 1)) < 1e-5
        batch, am = torch.zeros(2, 19, dtype=torch.long), torch.zeros(2, 19, dtype=torch.long)
        for r, p in enumerate(prompts):
            batch[r, 19 - p.shape[1]:], am[r, 19 - p.shape[1]:] = p[0], 1
        padded = sp.generate(batch, attention_mask=am, pad_token_id=0, **gen)
    for r, p in enumerate(prompts):
        assert torch.equal(padded.sequences[r, 19:], alone[r].sequences[0, p.shape[1]:]), r
        assert rel_err(torch.stack(padded.logits, 1)[r], torch.stack(alone[r].logits, 1)[0]) < 1e-5, r


def test_selector_specs_and_errors():
    sel = selectors.from_spec("moba:64,8")
    assert isinstance(sel, selectors.MoBASelector) and (sel.chunk_size, sel.top_k) == (64, 8)
    assert selectors.from_spec(" moba : k=4, block=32").top_k == 4
    pooled = selectors.from_spec("pooled_topk:block=16,top_k=2")
    assert isinstance(pooled, selectors.PooledTopKSelector) and (pooled.block_size, pooled.top_k) == (16, 2)
    assert selectors.is_spec("moba:block=64,top_k=8") and selectors.is_spec("pooled_topk:8,2")
    assert not selectors.is_spec("sliding_window:64")
    for bad, match in (("moba:block=64", "misses"), ("moba:block=x,top_k=2", "must be an int"),
                       ("moba:block=64,top_k=2,z=1", "unexpected"), ("moba:block=0,top_k=2", "positive"),
                       ("nsa:64,16", "unknown selector")):
        with pytest.raises(ValueError, match=match):
            selectors.from_spec(bad)
    cfg = _config()
    cfg.sparse_attention = "moba:block=8"
    with pytest.raises(ValueError, match="config.sparse_attention: .*misses"):
        sia_hf.layer_pattern(cfg, 0)
    cfg.sparse_attention = [MOBA, "sliding_window:16"]
    pat = sia_hf.layer_pattern(cfg, 0)
    assert pat.selector is not None and pat.is_dense and pat.block_size == (8, 8)
    assert sia_hf.layer_pattern(cfg, 1).selector is None
