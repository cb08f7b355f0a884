"""Hugging Face Transformers integration (`sparse_io_attn.integrations.transformers`), CPU-only.

Tiny random models built from configs (2 layers, hidden 64, 4 query heads / 2 KV heads: GQA), no
downloads. Transformers is in the `test` extra: these tests fail (not skip) without it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.integrations import transformers as sia_hf
from sparse_io_attn.integrations.transformers.layouts import layout_with_mask

NAME = sia_hf.register()
VOCAB = 101
FAMILIES = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}
TOL = 1e-5          # fp32 relative error, logits
GRAD_TOL = 1e-4     # fp32 relative error, parameter gradients


def tiny_config(family: str = "llama", **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "mistral":
        cfg["sliding_window"] = None      # the model's own window off (tested separately)
    cfg.update(kw)
    return FAMILIES[family](**cfg)


def pair(family: str = "llama", other: str = "sdpa", sparse_attention=None, sparse_kw=None, **kw):
    """(baseline model, sparse_io_attn model) with identical random weights, in eval mode
    (``sparse_kw``: config values for the sparse model only)."""
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **kw), attn_implementation=other)
    cfg = tiny_config(family, **{**kw, **(sparse_kw or {})})
    if sparse_attention is not None:
        cfg.sparse_attention = sparse_attention
    sp = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    sp.load_state_dict(ref.state_dict())
    assert sp.config._attn_implementation == NAME
    return ref.eval(), sp.eval()


def causal_pattern_mask(layout: BlockSparseLayout | None, n: int) -> torch.Tensor:
    """bool [1, H or 1, n, n]: the pattern intersected with causality (what a layer attends)."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if layout is None:
        return causal[None, None]
    return layout.to_dense_mask() & causal


def additive(mask: torch.Tensor) -> torch.Tensor:
    """bool mask -> the additive float mask "eager" adds to its scores."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def logits_and_grads(model, ids, owner=None, **kw):
    """Logits and parameter gradients of a weighted sum of the logits (``owner``: the module holding
    the parameters, when ``model`` is a compiled wrapper)."""
    owner = model if owner is None else owner
    owner.zero_grad(set_to_none=True)
    out = model(ids, **kw).logits
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}


def assert_grads_close(ga, gb, tol=GRAD_TOL):
    assert ga.keys() == gb.keys()
    for name in ga:
        assert rel_err(gb[name], ga[name]) < tol, name


# -------------------------------------------------------- a reference: sdpa under the pattern's mask
def _reference_forward(module, query, key, value, attention_mask, **kwargs):
    """`sdpa` with the element mask the layer should use: the layer's pattern (rows of the current
    queries, bottom-right aligned), its causality and the model's own mask (padding)."""
    q, kv = query.shape[2], key.shape[2]
    layout = sia_hf.pattern_layout(module.config, kv, module.layer_idx)
    i = torch.arange(kv - q, kv)[:, None]
    j = torch.arange(kv)[None, :]
    mask = (j <= i)[None, None]
    if layout is not None:
        mask = mask & layout.to_dense_mask()[:, :, kv - q:]
    if attention_mask is not None:
        mask = mask & attention_mask
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)


REF = "sdpa_pattern_reference"
AttentionInterface.register(REF, _reference_forward)
AttentionMaskInterface.register(REF, sdpa_mask)


# ------------------------------------------------------------------------------------------- tests
def test_importing_the_package_does_not_import_transformers():
    code = ("import sys, sparse_io_attn, sparse_io_attn.nn, sparse_io_attn.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_adds_both_interfaces():
    assert int(transformers.__version__.split(".")[0]) >= 5
    assert AttentionInterface()[NAME] is sia_hf.sparse_io_attn_forward
    assert AttentionMaskInterface()[NAME] is sia_hf.sparse_io_attn_mask
    assert sia_hf.register() == NAME                      # idempotent
    assert sia_hf.register("my_sparse") == "my_sparse"
    assert AttentionInterface()["my_sparse"] is sia_hf.sparse_io_attn_forward
    for bad in ("sdpa", "eager", "flash_attention_2", "org/kernel", ""):
        with pytest.raises(ValueError, match="register"):
            sia_hf.register(bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dense_equals_sdpa_logits_and_grads(family):
    """No pattern: dense causal, so logits and every parameter gradient equal "sdpa" (GQA 4/2)."""
    ref, sp = pair(family)
    ids = torch.randint(0, VOCAB, (2, 37))
    la, ga = logits_and_grads(ref.train(), ids)
    lb, gb = logits_and_grads(sp.train(), ids)
    assert rel_err(lb, la) < TOL
    assert_grads_close(ga, gb)


def _gpt_oss_pair():
    """(eager, sparse_io_attn) tiny gpt-oss models with identical random weights, sinks drawn far from 0
    (std 2: each head's sink takes a visible share of its rows' softmax)."""
    from transformers import GptOssConfig
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
               max_position_embeddings=256, sliding_window=512, layer_types=["full_attention"] * 2)
    ref = AutoModelForCausalLM.from_config(GptOssConfig(**cfg), attn_implementation="eager")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".sinks"):
                p.normal_(std=2.0)
    sp = AutoModelForCausalLM.from_config(GptOssConfig(**cfg), attn_implementation=NAME)
    sp.load_state_dict(ref.state_dict())
    return ref, sp


def test_gpt_oss_sinks_equal_eager_logits_and_grads():
    """gpt-oss's attention sinks (``s_aux``, one logit per head) join the softmax denominator as in its eager
    attention: logits and every parameter gradient, the sinks' included, equal eager's; a left-padded batch's
    real tokens too (the element-mask path)."""
    ref, sp = _gpt_oss_pair()
    ids = torch.randint(0, VOCAB, (2, 37))
    la, ga = logits_and_grads(ref.train(), ids)
    lb, gb = logits_and_grads(sp.train(), ids)
    assert rel_err(lb, la) < TOL
    assert any(n.endswith(".sinks") for n in gb) and set(ga) == set(gb)
    assert_grads_close(ga, gb)
    am = torch.ones(2, 37, dtype=torch.long)
    am[0, :9] = 0                                               # left padding
    with torch.no_grad():
        la, lb = (m.eval()(ids, attention_mask=am).logits for m in (ref, sp))
    real = am.bool()
    assert rel_err(lb[real], la[real]) < TOL


@pytest.mark.parametrize("spec,block,backend", [
    ("sliding_window:window=6", 8, "torch"),
    ("strided:stride=8", (8, 16), "auto"),
    ("bigbird:window=4,global=1,random=1,heads=4", 8, "auto"),      # per-head masks with GQA
])
@pytest.mark.parametrize("other", ["eager", "sdpa"])
def test_pattern_equals_dense_attention_under_the_element_mask(spec, block, backend, other):
    """A sparse pattern (intersected with causality) equals eager/sdpa given that element mask
    as a 4-D mask: logits and gradients."""
    N = 45
    ref, sp = pair(other=other, sparse_attention={"pattern": spec, "block_size": block, "backend": backend})
    layout = sia_hf.pattern_layout(sp.config, N)
    mask = causal_pattern_mask(layout, N).expand(2, -1, N, N)
    assert layout is not None and bool((mask < causal_pattern_mask(None, N)).any())   # sparser than causal
    ids = torch.randint(0, VOCAB, (2, N))
    la, ga = logits_and_grads(ref.train(), ids, attention_mask=mask if other == "sdpa" else additive(mask))
    lb, gb = logits_and_grads(sp.train(), ids)
    assert rel_err(lb, la) < TOL
    assert_grads_close(ga, gb)


def test_mistral_builtin_sliding_window_matches_sdpa_and_the_same_pattern():
    """A model's own sliding window reaches the kernels through its element mask; the same window as
    a pattern (distance <= w - 1) gives the same logits."""
    ids = torch.randint(0, VOCAB, (2, 40))
    ref, sp = pair("mistral", sliding_window=9)                # the model's window, no pattern
    _, sp2 = pair("mistral", sparse_attention={"pattern": "sliding_window:window=8", "block_size": 8})
    sp2.load_state_dict(ref.state_dict())
    with torch.no_grad():
        a, b, c = ref(ids).logits, sp(ids).logits, sp2(ids).logits
    assert rel_err(b, a) < TOL
    assert rel_err(c, a) < TOL


def test_per_layer_list_and_callable_patterns():
    """A per-layer list (sparse, dense) and a callable (seqlen_q, seqlen_k, layer_idx) -> layout."""
    N = 33
    ids = torch.randint(0, VOCAB, (2, N))
    per_layer = {"pattern": ["sliding_window:window=4", None], "block_size": 8}
    calls = []

    def fn(sq, sk, layer_idx):
        calls.append((sq, sk, layer_idx))
        return patterns.sliding_window((sq, sk), 8, window=3 + 5 * layer_idx)

    for spec in (per_layer, fn):
        ref, sp = pair(other=REF, sparse_attention=spec)
        ref.config.sparse_attention = spec
        la, ga = logits_and_grads(ref.train(), ids)
        lb, gb = logits_and_grads(sp.train(), ids)
        assert rel_err(lb, la) < TOL
        assert_grads_close(ga, gb)
    assert (N, N, 0) in calls and (N, N, 1) in calls
    assert sia_hf.pattern_layout(sp.config, N, 1).seqlen == (N, N)
    assert sia_hf.layer_pattern(tiny_config(sparse_attention=per_layer), 1).is_dense
    # and the reference itself is not dense: the layouts differ per layer
    m0, m1 = (causal_pattern_mask(sia_hf.pattern_layout(sp.config, N, i), N) for i in (0, 1))
    assert not torch.equal(m0, m1)


@pytest.mark.parametrize("spec", [None, {"pattern": "longformer:window=5,global=2", "block_size": 8}])
def test_padded_batch_folds_key_padding_into_per_batch_layouts(spec):
    """Right and left padding: each real token's logits equal those of its unpadded sequence (the
    padding is folded into per-batch element-exact layouts, padded keys are never attended); padded
    query rows come out finite. Dense: equal to "sdpa" on the real tokens."""
    ref, sp = pair(sparse_attention=spec)
    N = 24
    ids = torch.randint(0, VOCAB, (3, N))
    lengths = [N, 17, 9]
    am = torch.zeros(3, N, dtype=torch.long)
    am[0, :] = 1
    am[1, :17] = 1          # right padding
    am[2, N - 9:] = 1       # left padding
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = sp(ids, attention_mask=am, position_ids=pos).logits
        assert torch.isfinite(out).all()
        for b, n in enumerate(lengths):
            real = am[b].bool()
            alone = sp(ids[b:b + 1, real]).logits[0]
            if spec is None or b != 2:
                # left padding shifts absolute slots: only translation-invariant patterns compare
                assert rel_err(out[b, real], alone) < TOL, b
        if spec is None:
            base = ref(ids, attention_mask=am, position_ids=pos).logits
            assert rel_err(out[am.bool()], base[am.bool()]) < TOL
        else:   # the pattern in slot coordinates, and the padding: equal to the reference
            ref.config.sparse_attention = spec
            ref_sp = AutoModelForCausalLM.from_config(ref.config, attn_implementation=REF).eval()
            ref_sp.load_state_dict(sp.state_dict())
            base = ref_sp(ids, attention_mask=am, position_ids=pos).logits
            assert rel_err(out[am.bool()], base[am.bool()]) < TOL


def test_padded_layout_is_per_batch_and_element_exact():
    """The layout of a padded batch is `from_dense_mask(model mask & pattern)`: one element mask per
    batch row, padded keys absent."""
    cfg = tiny_config(sparse_attention={"pattern": "sliding_window:window=5", "block_size": 8})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    N = 20
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :6] = 0
    emb = torch.zeros(2, N, 64)
    mask = create_causal_mask(cfg, emb, am, None, torch.arange(N)[None])
    assert mask.dtype == torch.bool and mask.shape == (2, 1, N, N)
    attn = model.model.layers[0].self_attn
    layout, _ = layout_with_mask(attn, mask, N, N, None, torch.device("cpu"))
    assert layout.layout_batch == 2 and layout.block_size == (8, 8)
    want = mask & causal_pattern_mask(patterns.sliding_window(N, 8, window=5), N)
    assert torch.equal(layout.to_dense_mask(), want)
    # no padding: no element mask at all (the layout and bottom-right causality express it)
    assert create_causal_mask(cfg, emb, torch.ones(2, N, dtype=torch.long), None, torch.arange(N)[None]) is None


def test_packed_sequences_use_the_document_pattern():
    """position_ids restarting at 0 (no attention_mask, no cache): attention stays inside each
    document, and each document gets the pattern as if alone; without a pattern the layout is
    exactly `patterns.document(cu_seqlens, block, causal=True)`."""
    lengths = [12, 18, 10]
    cu = [0, 12, 30, 40]
    pid = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    # longformer's global tokens are absolute positions: per document they are its first tokens
    _, sp = pair(sparse_attention={"pattern": "longformer:window=4,global=1", "block_size": 8})
    with torch.no_grad():
        packed = sp(ids, position_ids=pid, use_cache=False).logits
        alone = torch.cat([sp(ids[:, s:e]).logits for s, e in zip(cu[:-1], cu[1:])], dim=1)
    assert rel_err(packed, alone) < TOL
    # dense: the document pattern itself
    cfg = tiny_config(sparse_attention={"pattern": None, "block_size": 8})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    mask = create_causal_mask(cfg, torch.zeros(1, 40, 64), None, None, pid)
    layout, _ = layout_with_mask(model.model.layers[0].self_attn, mask, 40, 40, pid, torch.device("cpu"))
    assert layout.equal(patterns.document(cu, 8, causal=True))


class _Spy:
    """Registers an attention function that records (seqlen_q, seqlen_k, mask given) and forwards."""

    def __init__(self, name):
        self.calls = []
        AttentionInterface.register(name, self)
        AttentionMaskInterface.register(name, sia_hf.sparse_io_attn_mask)

    def __call__(self, module, query, key, value, attention_mask, **kw):
        self.calls.append((query.shape[2], key.shape[2], attention_mask is not None))
        return sia_hf.sparse_io_attn_forward(module, query, key, value, attention_mask, **kw)


def _generate(model, ids, am=None, n=20, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if am is None else am, max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    assert out.shape[1] == ids.shape[1] + n
    return out


@pytest.mark.parametrize("case", ["dense", "dense-left-padded", "sliding_window", "longformer-left-padded",
                                  "longformer-static-cache"])
def test_greedy_generate_matches_sdpa_under_the_same_mask(case):
    """20 greedy tokens with the KV cache: prefill runs the pattern's layout, every decode step
    (seqlen_q 1 < seqlen_k) the layout rows of its position with bottom-right causality. The
    baseline is "sdpa" under the same element mask: plain sdpa (dense), Mistral's own sliding window
    (sliding window), or sdpa with the pattern's element mask (longformer)."""
    ids = torch.randint(1, VOCAB, (2, 11))
    am = None
    if case.endswith("left-padded"):
        am = torch.ones_like(ids)
        am[0, :4] = 0
    spy = _Spy("sparse_io_attn_spy")
    if case.startswith("dense"):
        ref, sp = pair()
    elif case == "sliding_window":     # Mistral: key allowed iff q - k < sliding_window, i.e. <= 6
        ref, sp = pair("mistral", sliding_window=7, sparse_kw={"sliding_window": None},
                       sparse_attention={"pattern": "sliding_window:window=6", "block_size": 8})
    else:   # absolute positions matter (global tokens): left padding and static caches must place them
        spec = {"pattern": "longformer:window=4,global=2", "block_size": 8}
        ref, sp = pair(other=REF, sparse_attention=spec)
        ref.config.sparse_attention = spec
    sp.set_attn_implementation("sparse_io_attn_spy")
    want = _generate(ref, ids, am)
    # a static cache: keys are the whole preallocated cache, the mask says which slots are filled
    got = _generate(sp, ids, am, cache_implementation="static") if case.endswith("static-cache") \
        else _generate(sp, ids, am)
    assert torch.equal(got, want)
    decode = [c for c in spy.calls if c[0] == 1]
    assert decode and all(k > 1 for _, k, _ in decode)
    assert any(q > 1 for q, _, _ in spy.calls)                      # the prefill
    if case.endswith("static-cache"):
        assert all(m for _, _, m in spy.calls) and any(1 < q < k for q, k, _ in spy.calls)   # prefill q < k
    else:
        assert all(m == (am is not None) for _, _, m in spy.calls)  # element mask only with padding


def _recording(seen):
    def backend(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward
    return backend


def test_torch_compile_keeps_the_attention_call_in_the_graph():
    """`torch.compile(model, fullgraph=True)` traces the attention of every layer as the custom op
    (no graph break), forward and backward match eager."""
    cfg = tiny_config(sparse_attention={"pattern": "sliding_window:window=6", "block_size": 8})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).train()
    ids = torch.randint(0, VOCAB, (2, 40))
    le, ge = logits_and_grads(model, ids)        # eager: builds the layouts (outside any trace)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    seen = []
    torch._dynamo.reset()
    torch.compile(model, backend=_recording(seen), fullgraph=True)(ids)
    ops = [t for graph in seen for t in graph if "sparse_io_attn" in t]
    assert ops == ["sparse_io_attn.block_sparse_attn_fwd.default"] * cfg.num_hidden_layers

    torch._dynamo.reset()
    lc, gc = logits_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True), ids, owner=model)
    assert rel_err(lc, le) < 1e-6
    assert_grads_close(ge, gc, 1e-5)
    torch._dynamo.reset()


def test_config_spec_serialises_and_errors_are_clear(tmp_path):
    spec = {"pattern": ["sliding_window:window=256", "dense"], "block_size": [64, 32], "backend": "torch"}
    cfg = tiny_config(sparse_attention=spec)
    cfg.save_pretrained(tmp_path)
    loaded = json.loads((tmp_path / "config.json").read_text())["sparse_attention"]
    assert loaded == spec
    lp = sia_hf.layer_pattern(type(cfg).from_pretrained(tmp_path), 0)
    assert (lp.pattern, lp.block_size, lp.backend) == ("sliding_window:window=256", (64, 32), "torch")

    for bad, err, match in [
        ({"pattern": "sliding_window:256", "blocksize": 64}, ValueError, "blocksize"),
        ("no_such_pattern:3", ValueError, "unknown pattern"),
        (["sliding_window:8"], ValueError, "one entry per layer"),
        ({"pattern": "sliding_window:8", "backend": "cuda"}, ValueError, "backend"),
        (3.5, TypeError, "spec string"),
    ]:
        with pytest.raises(err, match=match):
            sia_hf.layer_pattern(tiny_config(sparse_attention=bad), 0)

    ids = torch.randint(0, VOCAB, (1, 16))
    wrong = lambda sq, sk, layer: patterns.sliding_window(sq + 1, 8, window=2)  # noqa: E731
    model = AutoModelForCausalLM.from_config(tiny_config(sparse_attention=wrong), attn_implementation=NAME)
    with pytest.raises(ValueError, match="seqlen"):
        model(ids)
    dropout = AutoModelForCausalLM.from_config(tiny_config(attention_dropout=0.1), attn_implementation=NAME)
    with pytest.raises(NotImplementedError, match="dropout"):
        dropout.train()(ids)
    dropout.eval()(ids)     # dropout is 0 in eval mode: runs


def test_train_hf_llama_example_learns_and_generates(capsys):
    """examples/train_hf_llama.py, shrunk: a few steps lower the validation loss and generate() runs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_hf_llama.py"
    spec = importlib.util.spec_from_file_location("train_hf_llama", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    hist = example.main(["--steps", "8", "--seq-len", "64", "--batch-size", "4", "--hidden", "32", "--layers", "1",
                         "--heads", "2", "--kv-heads", "1", "--block-size", "16", "--lr", "1e-2",
                         "--pattern", "sliding_window:window=16", "--eval-every", "4", "--sample-len", "12"])
    out = capsys.readouterr().out
    assert hist["after"] < hist["before"] - 0.3
    assert "attn_implementation='sparse_io_attn'" in out and "generate(): 12 chars" in out
