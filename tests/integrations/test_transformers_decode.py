"""Decoding with a KV cache through the Hugging Face integration (issue 38): greedy ``generate()``
equals ``sdpa`` (dense) and equals greedy decoding recomputed by full prefills (sparse patterns), and
each decode step builds its metadata from the rows it decodes, never the square pattern."""
from __future__ import annotations

import pytest
import torch
from helpers import greedy_by_prefill
from transformers import AutoModelForCausalLM, LlamaConfig

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers import layouts as hf_layouts

NAME = sia_hf.register()
VOCAB = 101
NEW = 12           # tokens generated


def _model(sparse_attention=None, attn_implementation=NAME, state=None):
    """A tiny random Llama (2 layers, GQA 4/2) in fp32 eval mode, with weights large enough that the
    greedy choice is not a near-tie (Transformers' default 0.02 gives top logits within 1e-6 of each
    other, where fp32 rounding picks the token), and no EOS token (``min_new_tokens`` would mask it
    out of generate()'s choice but not out of the recomputed one)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, eos_token_id=None)   # no end of sequence: NEW tokens, none masked
    if sparse_attention is not None:
        cfg.sparse_attention = sparse_attention
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def _greedy(model, ids):
    """``generate()`` with the default dynamic cache: (tokens, logits of each new token [B, NEW, V])."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    assert out.sequences.shape == (ids.shape[0], ids.shape[1] + NEW)
    return out.sequences, torch.stack(out.logits, 1)


def test_dense_generate_equals_sdpa():
    ref = _model(attn_implementation="sdpa")
    sp = _model(state=ref.state_dict())
    ids = torch.randint(1, VOCAB, (2, 9))
    (want, want_logits), (got, got_logits) = _greedy(ref, ids), _greedy(sp, ids)
    assert torch.equal(got, want)
    assert rel_err(got_logits, want_logits) < 1e-5


@pytest.mark.parametrize("spec", [
    {"pattern": "sliding_window:window=5", "block_size": 4},
    {"pattern": "longformer:window=3,global=2", "block_size": (4, 8)},
    {"pattern": "strided:stride=6", "block_size": 4},
    {"pattern": "fixed:stride=8,summary=2", "block_size": (8, 4)},
])
def test_sparse_generate_equals_greedy_by_full_prefills(spec, monkeypatch):
    """Greedy tokens with the KV cache (each decode step the rows of its position) equal greedy
    decoding that recomputes a whole prefill per token; the logits agree (fp32). The decode steps
    never build the square pattern: only the prompt's prefill does."""
    hf_layouts.reset_layouts()
    sp = _model(spec)
    ids = torch.randint(1, VOCAB, (2, 10))
    squares = []
    real = hf_layouts._square_layout
    monkeypatch.setattr(hf_layouts, "_square_layout", lambda pat, n: squares.append(n) or real(pat, n))
    got, got_logits = _greedy(sp, ids)
    assert squares and set(squares) == {ids.shape[1]}, squares          # the prefill's, once per length
    want, want_logits = greedy_by_prefill(sp, ids, NEW)
    assert torch.equal(got, want)
    assert rel_err(got_logits, want_logits) < 1e-5
    # and the pattern is not dense at these lengths: the dense model decodes differently
    dense_logits = greedy_by_prefill(_model(state=sp.state_dict()), ids, NEW)[1]
    assert rel_err(dense_logits[:, :1], want_logits[:, :1]) > 1e-3


def test_decode_step_metadata_at_a_million_keys_reads_only_the_window(monkeypatch):
    """One query against 2**20 cached keys: the layout holds the window's blocks only, the square
    pattern is never built, one build serves both layers, and a module keeps only its last few
    decode lengths."""
    hf_layouts.reset_layouts()
    model = _model({"pattern": "sliding_window:window=256", "block_size": 64})
    attn = [layer.self_attn for layer in model.model.layers]

    def refuse(pat, n):
        raise AssertionError(f"built the square pattern on {n} positions")

    monkeypatch.setattr(hf_layouts, "_square_layout", refuse)
    N = 1 << 20
    steps = hf_layouts._MODULE_RECENT_SIZE + 3
    for step in range(steps):
        kv = N - 2 + step
        first, _ = hf_layouts.layout_no_mask(attn[0], 1, kv, torch.device("cpu"))
        second, _ = hf_layouts.layout_no_mask(attn[1], 1, kv, torch.device("cpu"))
        assert second is first                                  # built once per step for both layers
        assert first.seqlen == (1, kv) and first.nnz_blocks <= 5
        _, _, c = first.entries()
        assert c.tolist() == list(range((kv - 1 - 256) // 64, (kv - 1) // 64 + 1))
    kept = [(1, N - 2 + step, "cpu", "bottom_right") for step in range(3, steps)]
    assert all(list(getattr(a, hf_layouts._MODULE_CACHE_ATTR)) == kept for a in attn)


def test_decode_layouts_are_kept_in_a_bounded_shared_cache(monkeypatch):
    hf_layouts.reset_layouts()
    model = _model({"pattern": "sliding_window:window=5", "block_size": 4})
    attn = model.model.layers[0].self_attn
    cpu = torch.device("cpu")
    prefill, _ = hf_layouts.layout_no_mask(attn, 7, 7, cpu)
    for kv in range(8, 8 + 3 * hf_layouts._ROWS_CACHE_SIZE):
        layout, _ = hf_layouts.layout_no_mask(attn, 1, kv, cpu)
        assert layout.equal(hf_layouts._square_layout(hf_layouts.module_pattern(attn), kv).rows(kv - 1, kv))
    assert len(hf_layouts._ROWS) == hf_layouts._ROWS_CACHE_SIZE
    recent = list(range(kv + 1 - hf_layouts._MODULE_RECENT_SIZE, kv + 1))
    assert list(getattr(attn, hf_layouts._MODULE_CACHE_ATTR)) == [(7, 7, "cpu", "bottom_right")] + [
        (1, k, "cpu", "bottom_right") for k in recent]

    def refuse(*args):
        raise AssertionError("rebuilt a layout the module keeps")

    monkeypatch.setattr(hf_layouts, "_build_no_mask", refuse)   # what a compiled forward must not call
    assert hf_layouts.layout_no_mask(attn, 7, 7, cpu)[0] is prefill
    assert hf_layouts.layout_no_mask(attn, 1, kv, cpu)[0] is layout
    monkeypatch.undo()
    hf_layouts.reset_layouts(model)
    assert not hf_layouts._ROWS and not hasattr(attn, hf_layouts._MODULE_CACHE_ATTR)


@pytest.mark.parametrize("case", ["left-padded", "static-cache"])
def test_masked_decode_steps_build_rows_not_the_square(case, monkeypatch):
    """Decode steps that carry an element mask (a padded batch, a static cache: the keys are the
    preallocated slots) build the pattern's rows too, and still equal greedy decoding by full
    prefills with the same mask and positions."""
    hf_layouts.reset_layouts()
    sp = _model({"pattern": "longformer:window=3,global=2", "block_size": 4})
    ids = torch.randint(1, VOCAB, (2, 9))
    am = torch.ones_like(ids)
    if case == "left-padded":
        am[0, :3] = 0
    squares = []
    real = hf_layouts._square_layout
    monkeypatch.setattr(hf_layouts, "_square_layout", lambda pat, n: squares.append(n) or real(pat, n))
    kw = {"cache_implementation": "static"} if case == "static-cache" else {}
    out = sp.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                      return_dict_in_generate=True, output_logits=True, **kw)
    assert set(squares) <= {ids.shape[1]}, squares          # a prefill's square at most, no decode step's
    got, got_logits = out.sequences, torch.stack(out.logits, 1)
    want, logits = ids, []
    with torch.no_grad():
        for _ in range(NEW):
            mask = torch.cat([am, torch.ones(2, want.shape[1] - am.shape[1], dtype=am.dtype)], 1)
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)      # as generate() places the tokens
            last = sp(want, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -1]
            logits.append(last)
            want = torch.cat([want, last.argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, want)
    assert rel_err(got_logits, torch.stack(logits, 1)) < 1e-5


def test_callable_pattern_decodes_from_its_square_layout():
    """A callable pattern can only be asked for ``(n, n)``: its decode steps take the rows of that
    layout; a layer whose callable returns ``None`` (dense) decodes densely."""
    from sparse_io_attn import patterns

    calls = []

    def fn(sq, sk, layer_idx):
        calls.append((sq, sk, layer_idx))
        return patterns.sliding_window((sq, sk), 4, window=4) if layer_idx == 0 else None

    hf_layouts.reset_layouts()
    sp = _model(fn)
    ids = torch.randint(1, VOCAB, (2, 8))
    got, got_logits = _greedy(sp, ids)
    want, want_logits = greedy_by_prefill(sp, ids, NEW)
    assert torch.equal(got, want)
    assert rel_err(got_logits, want_logits) < 1e-5
    assert {(n, n, layer) for n in range(8, 8 + NEW) for layer in (0, 1)} <= set(calls)
