"""examples/train_context_parallel.py: training the character LM with the sequence sharded over 2 gloo
processes (``ContextParallelSelfAttention`` in every layer, gradients summed over the ranks) gives the
losses of single-process training step by step, with a static pattern and with the MoBA selector
(a selection every layer and step: the plan of the sequence and each step's part); the wrapper's
checks, and a selector returning a per-token ``Selection``."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sparse_io_attn import patterns, selection_attention
from sparse_io_attn.distributed import ContextParallelPlan, ContextParallelSelfAttention
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn import SparseSelfAttention, selectors

_PATH = Path(__file__).resolve().parents[2] / "examples" / "train_context_parallel.py"
_spec = importlib.util.spec_from_file_location("train_context_parallel", _PATH)
example = sys.modules.setdefault("train_context_parallel", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(example)


def test_two_processes_train_like_one():
    """The strided pattern (a static plan) and the MoBA selector (a selection every layer and step:
    the plan of the sequence and each step's part), one spawn of 2 processes training both: the
    losses of one process; with MoBA each rank receives what its rows selected (at most an
    all-gather), and it changes from step to step."""
    cfg = example.small_config(seq_len=96, block_size=16, stride=32, d_model=32, num_layers=2, batch_size=2,
                               steps=3)
    cp = example.train_context_parallel(cfg, 2, ("strided", "moba"))
    for attention in ("strided", "moba"):
        single = example.train_single(example.Corpus(), cfg, attention)
        losses = cp[attention]["losses"]
        assert len(losses) == 3
        for a, b in zip(single, losses):
            assert abs(a - b) <= 1e-5 * abs(a), (attention, single, losses)
        assert single[-1] < single[0]
    assert cp["strided"]["rows"] != [6, 0] and cp["moba"]["rows"] == [3, 3]     # zig-zag: 2 chunks each
    gathered = cfg.num_layers * (cfg.d_model // cfg.num_heads) * 4 * 2 * cfg.batch_size * cfg.num_heads * 48
    received = cp["moba"]["received"]
    # exact MoBA picks per token and head: on 6 blocks the union of a rank's rows is most of the sequence;
    # what it receives is what they selected (never more than an all-gather), and it changes per step
    assert all(0 < got <= gathered for got in received) and len(set(received)) > 1, (received, gathered)


class _TokenSelector:
    """A hand-made per-token selector: every query token takes its own key block and the first one
    (one selection per KV head), as a ``Selection``; ``causal`` like MoBA's."""
    block_size = 8
    causal = True

    def __call__(self, q, k):
        n = q.shape[2]
        own = torch.arange(n) // self.block_size
        idx = torch.stack([own, torch.zeros_like(own), (own * 7 + 3) % (own + 1)], -1)     # own, first, another
        return Selection(idx.expand(k.shape[1], n, 3).contiguous(), self.block_size)


def test_wrapper_runs_a_selector_layer_in_one_process():
    """One rank: the wrapper with a selector is the layer (a BlockSparseLayout from MoBA, a per-token
    Selection from a hand-made selector, whose layer attends through selection_attention)."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16)
    moba = SparseSelfAttention(16, 4, selector=selectors.moba(16, 2), num_kv_heads=2, causal=True, backend="torch")
    plan = ContextParallelSelfAttention.plan_for(moba, 64, 1)
    assert not plan.is_static and plan.block_size == 16 and plan.causal
    assert torch.allclose(ContextParallelSelfAttention(moba, plan)(x), moba(x), atol=1e-6)
    tokens = SparseSelfAttention(16, 4, selector=_TokenSelector(), num_kv_heads=2, causal=True, backend="torch")
    plan = ContextParallelSelfAttention.plan_for(tokens, 64, 1, balance="contiguous")
    got = ContextParallelSelfAttention(tokens, plan)(x)
    q, k, v = tokens.project(x)
    want = tokens.project_out(selection_attention(q, k, v, _TokenSelector()(q, k), causal=True, backend="torch"))
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="plan was built with causal=False"):
        ContextParallelSelfAttention(moba, ContextParallelPlan.for_sequence(64, 16, 1, causal=False))


def test_wrapper_checks_its_plan_and_input():
    layer = SparseSelfAttention(16, 2, patterns.sliding_window(64, 16, 16), causal=True)
    plan = ContextParallelSelfAttention.plan_for(layer, 64, 1)
    wrapped = ContextParallelSelfAttention(layer, plan)
    x = torch.randn(2, 64, 16)
    assert torch.allclose(wrapped(x), layer(x), atol=1e-6)       # one rank: the layer itself
    with pytest.raises(ValueError, match="batch, 64, 16"):
        wrapped(torch.randn(2, 60, 16))
    other = ContextParallelPlan(patterns.dense(64, 16), 1, causal=True)
    with pytest.raises(ValueError, match="plan was built for"):
        ContextParallelSelfAttention(layer, other)
    with pytest.raises(ValueError, match="plan was built for"):
        ContextParallelSelfAttention(layer, ContextParallelPlan(layer.layout_for(64), 1, causal=False))
    with pytest.raises(ValueError, match="static plan"):
        ContextParallelSelfAttention(layer, ContextParallelPlan.for_sequence(64, 16, 1, causal=True))
    with pytest.raises(TypeError, match="SparseSelfAttention"):
        ContextParallelSelfAttention(torch.nn.Linear(2, 2), plan)
