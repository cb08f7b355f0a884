"""examples/train_dynamic_sparsity.py: the six attention methods (dense causal, static block window,
pooled top-k, exact MoBA, NSA's selection, the NSA layer) train; the five SparseSelfAttention methods
start from the same initialisation, the window, pooled top-k, MoBA and NSA's selection keep the same
block budget per query, and with a budget covering every causal block those five runs coincide."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "examples" / "train_dynamic_sparsity.py"
_spec = importlib.util.spec_from_file_location("train_dynamic_sparsity", _PATH)
dyn = sys.modules.setdefault("train_dynamic_sparsity", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(dyn)



@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the example runs: tiny problems gain nothing from two, and on a
    loaded 2-core machine OpenMP's spinning threads make them tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# seq_len 60 in blocks of 8: 8 block rows, the last one ragged
TINY = dict(seq_len=60, block_size=8, d_model=32, num_layers=2, num_heads=2, batch_size=4, lr=3e-3, seed=0)


def _reference(attn, x, allowed):
    """float64 attention of the layer's projections under the element mask ``allowed [N, N]``."""
    B, N, E = x.shape
    H, D = attn.num_heads, attn.head_dim
    W = {n: getattr(attn, n).weight.double() for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    b = {n: getattr(attn, n).bias.double() for n in W}
    q, k, v = ((x.double() @ W[n].T + b[n]).view(B, N, H, D).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    return (p @ v).transpose(1, 2).reshape(B, N, E) @ W["out_proj"].T + b["out_proj"]


@pytest.mark.parametrize("method", ["dense", "window"])
def test_static_methods_match_float64_reference(method):
    """dense: key j allowed for query i iff j <= i; window: also i // 8 - j // 8 < top_k (3)."""
    cfg = dyn.Config(**TINY)
    attn = dyn.attention_factory(method, top_k=3)(cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    i, j = torch.arange(cfg.seq_len)[:, None], torch.arange(cfg.seq_len)[None, :]
    allowed = j <= i
    if method == "window":
        allowed &= i // 8 - j // 8 < 3
    ref = _reference(attn, x, allowed)
    out = attn(x)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_window_keeps_the_selectors_budget():
    """Row r of the window keeps min(top_k, r + 1) key blocks (r - top_k + 1 .. r); pooled top-k per
    query block, MoBA and NSA's selection per query token read as many."""
    top_k, block, n = 3, 8, 60
    window = dyn.block_window(n, block, top_k).to_block_mask()[0, 0]
    rows = torch.arange(8)
    assert torch.equal(window.sum(-1), torch.clamp(rows + 1, max=top_k))
    r, c = rows[:, None], rows[None, :]
    assert torch.equal(window, (c <= r) & (c > r - top_k))
    q, k = torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16)
    pooled = dyn.selectors.pooled_topk(block, top_k)(q, k).to_block_mask()
    assert torch.equal(pooled.sum(-1), window.sum(-1).expand(2, 2, 8))
    per_token = window.sum(-1).repeat_interleave(block)[:n].double().mean().item()
    for name in ("moba", "nsa_select"):
        sel = dyn.SELECTORS[name](block, top_k)(q, k)
        assert dyn.selected_blocks_per_query(sel, n) == pytest.approx(per_token), name


SAME_INIT = ("dense", "window", "pooled_topk", "moba", "nsa_select")


def test_methods_same_init_same_start_and_learn():
    """One seed gives the five SparseSelfAttention models identical parameters (nsa has its own); each
    method learns in 8 steps (finite losses, validation loss falls), and the sparse ones read the same
    blocks per query, fewer than dense."""
    cfg = dyn.Config(**TINY, steps=8)
    corpus = dyn.char_lm.Corpus()
    states = [dyn.build_model(m, corpus.vocab_size, cfg, top_k=3).state_dict() for m in SAME_INIT]
    for other in states[1:]:
        assert other.keys() == states[0].keys()
        assert all(torch.equal(states[0][name], other[name]) for name in states[0])
    assert "blocks.0.attn.g_proj.weight" in dyn.build_model("nsa", corpus.vocab_size, cfg, top_k=3).state_dict()
    runs = {m: dyn.run(m, corpus, cfg, top_k=3, eval_every=4, eval_batches=1) for m in dyn.METHODS}
    for m, r in runs.items():
        assert [s for s, *_ in r["rows"]] == [0, 4, 8], m
        vals = [v for _, _, v, _ in r["rows"]]
        assert all(math.isfinite(v) for v in vals + r["train"]), m
        assert vals[-1] < vals[0] - 0.2, (m, vals)
        seconds = [t for *_, t in r["rows"]]
        assert 0 == seconds[0] < seconds[1] < seconds[2] <= r["train_seconds"], (m, seconds)
        assert r["tokens_per_s"] > 0
    # untrained models are close to uniform whatever they attend to
    starts = [r["rows"][0][2] for r in runs.values()]
    assert max(starts) - min(starts) < 0.05, starts
    assert runs["dense"]["kept_per_row"] == 36 / 8
    assert runs["window"]["kept_per_row"] == runs["pooled_topk"]["kept_per_row"] == 21 / 8
    for m in ("moba", "nsa_select", "nsa"):
        k = 4 if m == "nsa" else 3                       # fla's layer rounds block_counts up to a power of two
        assert runs[m]["kept_per_row"] == pytest.approx(sum(min(k, t // 8 + 1) for t in range(60)) / 60), m


def test_budget_covering_every_causal_block_makes_the_five_coincide():
    """top_k = blocks per row: the window, pooled top-k, MoBA and NSA's selection keep every causal
    block, so the five runs compute the same attention and their training losses agree step by step."""
    cfg = dyn.Config(**TINY, steps=6)
    corpus = dyn.char_lm.Corpus()
    losses = {m: dyn.run(m, corpus, cfg, top_k=8, eval_every=0, eval_batches=1)["train"] for m in SAME_INIT}
    for m in SAME_INIT[1:]:
        for step, (a, b) in enumerate(zip(losses[m], losses["dense"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"{m} step {step}: {a} vs dense {b}"


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        dyn.attention_factory("sliding", top_k=3)
