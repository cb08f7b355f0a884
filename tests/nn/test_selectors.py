"""Selections chosen from the activations, through the layer: the pooled top-k selector against brute
force, ``SparseSelfAttention`` with a selector returning a layout (pooled top-k) or a per-token
``Selection`` (exact MoBA, NSA) on every backend against the float64 references, and compiled
training steps that select anew at every call with ``fullgraph=True``, no graph break and no
recompilation. The selectors' agreement with their authors' reference code is tested in
``tests/selection/test_selectors_{moba,nsa,dsa}.py``."""
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from sparse_io_attn import Selection, block_sparse_attention, patterns
from sparse_io_attn.block_sparse.api import prepare
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.nn import SparseSelfAttention, selectors
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.reference import selection_reference

from helpers import BACKENDS, no_host_sync
from selection.transcribed import moba as moba_ref


def _pooled(x, block):
    """Brute force: the mean of each block of positions (the last one ragged), float64."""
    B, H, N, D = x.shape
    return torch.stack([x[:, :, s:s + block].double().mean(2) for s in range(0, N, block)], dim=2)


@pytest.mark.parametrize("n, dtype", [(5, torch.float32), (64, torch.float32), (97, torch.bfloat16),
                                      (33, torch.float64)])
def test_block_means_any_length_and_dtype(n, dtype):
    """Shorter than one block, whole blocks, a ragged tail; 16-bit and float64 inputs: float32 means."""
    torch.manual_seed(n)
    x = torch.randn(2, 3, n, 8).to(dtype)
    got = selectors.block_means(x, 16)
    assert got.dtype == torch.float32 and got.shape == (2, 3, math.ceil(n / 16), 8)
    assert rel_err(got.double(), _pooled(x, 16)) < 1e-6


def test_block_means_and_pooled_scores_match_brute_force():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 70, 8), torch.randn(2, 2, 70, 8)
    sel = selectors.pooled_topk(16, 2)
    assert rel_err(selectors.block_means(k, 16).double(), _pooled(k, 16)) < 1e-6
    qg = _pooled(q, 16).view(2, 2, 2, 5, 8).mean(2)                         # the GQA group's queries
    want = qg @ _pooled(k, 16).transpose(-1, -2)
    assert rel_err(sel.scores(q, k).double(), want) < 1e-5
    layout = sel(q, k)
    assert (layout.layout_batch, layout.layout_heads) == (2, 2)
    assert layout.equal(patterns.topk(sel.scores(q, k), 2, 16, 70, causal=True))
    mask = layout.to_block_mask()
    assert mask[..., torch.arange(5), torch.arange(5)].all()                 # the own block, always
    assert not mask.triu(1).any()                                            # nothing in the future
    assert (mask.sum(-1) == torch.tensor([1, 2, 2, 2, 2])).all()             # top_k, or what row 0 has


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_with_selector_matches_reference(backend):
    torch.manual_seed(1)
    layer = SparseSelfAttention(32, 4, selector=selectors.pooled_topk(16, 2), num_kv_heads=2, causal=True,
                                backend=backend).double()
    x = torch.randn(2, 75, 32, dtype=torch.float64)
    B, N, _ = x.shape
    q = layer.q_proj(x).view(B, N, 4, 8).transpose(1, 2)
    k = layer.k_proj(x).view(B, N, 2, 8).transpose(1, 2)
    v = layer.v_proj(x).view(B, N, 2, 8).transpose(1, 2)
    layout = layer.selector(q, k)
    ref = attention_reference(q, k, v, layout, causal=True)[0]
    ref = layer.out_proj(ref.transpose(1, 2).reshape(B, N, 32))
    fp32 = layer.float()
    out = fp32(x.float())
    assert rel_err(out, ref) < 1e-5
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp32.parameters())


def _check_compiled_step(layer, loss_fn, x):
    """One training step through the compiled ``loss_fn`` (``layer(x).square().mean()``): its loss and
    parameter gradients equal eager mode's."""
    layer.zero_grad()
    loss = loss_fn(x)
    loss.backward()
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    eager = layer(x).square().mean()
    eager.backward()
    assert rel_err(loss, eager) < 1e-6
    assert all(rel_err(a, p.grad) < 1e-4 for a, p in zip(got, layer.parameters()))


def test_compiled_step_selects_every_call_without_recompiling():
    torch.manual_seed(2)
    layer = SparseSelfAttention(32, 4, selector=selectors.pooled_topk(16, 3), num_kv_heads=2, causal=True,
                                backend="cpu")
    counter = CompileCounterWithBackend("aot_eager")
    loss_fn = torch.compile(lambda x: layer(x).square().mean(), fullgraph=True, backend=counter)
    torch._dynamo.reset()
    selections = []
    for step in range(3):
        x = torch.randn(2, 96, 32)
        _check_compiled_step(layer, loss_fn, x)
        q = layer.q_proj(x).view(2, 96, 4, 8).transpose(1, 2)
        k = layer.k_proj(x).view(2, 96, 2, 8).transpose(1, 2)
        selections.append(layer.selector(q, k).to_block_mask())
    assert counter.frame_count == 1 and counter.op_count > 0     # one graph, traced once
    assert not all(torch.equal(selections[0], s) for s in selections[1:])   # the selection did change


def test_selector_pipeline_never_synchronises():
    q, k, v = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    sel = selectors.pooled_topk(16, 2)
    out = block_sparse_attention(q, k, v, sel(q, k), causal=True, backend="cpu")   # builds the C++ kernel first
    with no_host_sync():
        layout = sel(q, k)
        call = prepare(q, k, v, layout, causal=True, sm_scale=None, backend="cpu")   # one layout, one plan
        list(call.plan.meta)
    assert torch.isfinite(out).all()


def test_per_token_selectors_never_synchronise():
    """moba, nsa and lightning_topk, and the plan of their selection: tensor operations only."""
    q, k = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16)
    with no_host_sync():
        for sel in (selectors.moba(16, 3)(q, k), selectors.nsa(8, 4)(q, k),
                    selectors.lightning_topk(q, k[:, 0], torch.randn(1, 4, 64), 8)):
            SelectionPlan(sel, 64, 0)


def test_selector_errors():
    with pytest.raises(ValueError, match="not both"):
        SparseSelfAttention(16, 2, patterns.dense(8, 8), selector=selectors.pooled_topk(8, 1), causal=True)
    for sel in (selectors.pooled_topk(8, 1), selectors.moba(8, 1), selectors.nsa(8, 2)):
        with pytest.raises(ValueError, match="causal=True"):
            SparseSelfAttention(16, 2, selector=sel)
    with pytest.raises(TypeError, match="callable"):
        SparseSelfAttention(16, 2, selector=3)
    with pytest.raises(ValueError, match="positive int"):
        selectors.pooled_topk(0, 2)
    with pytest.raises(ValueError, match="top_k"):
        selectors.pooled_topk(16, -1)
    layer = SparseSelfAttention(16, 2, selector=selectors.pooled_topk(8, 1), causal=True)
    with pytest.raises(ValueError, match="selector"):
        layer.layout_for(16)
    with pytest.raises(ValueError, match="Hq a multiple"):
        selectors.pooled_topk(8, 1)(torch.randn(1, 3, 16, 4), torch.randn(1, 2, 16, 4))
    assert "pooled_topk(block_size=8, top_k=1" in repr(layer)
    assert math.isfinite(float(layer(torch.randn(1, 16, 16)).detach().sum()))


@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 24, 16)], ids=["N0", "B0"])
@pytest.mark.parametrize("kind", ["selector", "pattern", "layout"])
def test_layer_on_an_empty_sequence_or_batch_gives_the_empty_output(shape, kind):
    """Nothing to attend: the empty output ``[B, N, E]`` and gradients (x's empty, the weights' 0)
    for a selector, a ``seqlen -> layout`` pattern and a fixed layout alike; the selector itself
    names why it cannot choose a layout of no positions."""
    torch.manual_seed(2)
    how = {"selector": dict(selector=selectors.pooled_topk(8, 2)),
           "pattern": dict(layout_or_pattern=lambda n: patterns.sliding_window(n, 8, 8)),
           "layout": dict(layout_or_pattern=patterns.sliding_window(24, 8, 8))}[kind]
    layer = SparseSelfAttention(16, 4, num_kv_heads=2, causal=True, backend="torch", **how)
    x = torch.randn(shape, requires_grad=True)
    out = layer(x)
    assert out.shape == shape
    out.sum().backward()
    assert x.grad.shape == shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())
    assert selectors.block_means(torch.randn(2, 3, 0, 8), 16).shape == (2, 3, 0, 8)
    with pytest.raises(ValueError, match=r"at least one query and key position and batch element, got q \(1, 4, 0"):
        selectors.pooled_topk(8, 1)(torch.randn(1, 4, 0, 4), torch.randn(1, 2, 0, 4))


# ------------------------------------------------------------------- per-token selectors in the layer
def _layer_qkv(layer, x):
    return layer.project(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_with_exact_moba_is_mobas_attention(backend):
    """SparseSelfAttention(selector=moba) runs selection_attention: its output is MoBA's
    (moba_attn_varlen_naive on the layer's projections, K/V repeated per query head) and its
    gradients reach every parameter."""
    torch.manual_seed(3)
    layer = SparseSelfAttention(32, 4, selector=selectors.moba(8, 3), num_kv_heads=2, causal=True, backend=backend)
    x = torch.randn(2, 45, 32)
    out = layer(x)
    q, k, v = (t.detach() for t in _layer_qkv(layer, x))
    pack = lambda t: t.repeat_interleave(4 // t.shape[1], 1).permute(0, 2, 1, 3).reshape(90, 4, 8)  # noqa: E731
    o = moba_ref.moba_attn_varlen_naive(pack(q), pack(k), pack(v), torch.tensor([0, 45, 90]), 45, 8, 3)
    ref = layer.project_out(o.view(2, 45, 4, 8).permute(0, 2, 1, 3))
    assert rel_err(out, ref) < 1e-5
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_with_nsa_selector_runs_the_selected_branch(backend):
    torch.manual_seed(4)
    layer = SparseSelfAttention(32, 4, selector=selectors.nsa(8, 3), num_kv_heads=2, causal=True, backend=backend)
    x = torch.randn(1, 40, 32)
    out = layer(x)
    q, k, v = _layer_qkv(layer, x)
    sel = layer.selector(q, k)
    assert isinstance(sel, Selection) and sel.indices.shape == (1, 2, 40, 3)
    ref = layer.project_out(selection_reference(q, k, v, sel, causal=True)[0].float())
    assert rel_err(out, ref) < 1e-5


def test_compiled_step_with_a_per_token_selector_does_not_recompile():
    """Exact MoBA through the layer under torch.compile(fullgraph=True): one graph (the selection and
    its plan built inside it), eager results, a new selection every step, no recompilation."""
    torch.manual_seed(5)
    layer = SparseSelfAttention(32, 4, selector=selectors.moba(16, 2), num_kv_heads=2, causal=True, backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    loss_fn = torch.compile(lambda x: layer(x).square().mean(), fullgraph=True, backend=counter)
    torch._dynamo.reset()
    chosen = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(2, 64, 32)
            _check_compiled_step(layer, loss_fn, x)
            q, k, _ = _layer_qkv(layer, x)
            chosen.append(layer.selector(q, k).indices)
    assert counter.frame_count == 1
    assert not all(torch.equal(chosen[0], c) for c in chosen[1:])
