"""examples/train_context_parallel.py: training the character LM with the sequence sharded over 2 gloo
processes (``ContextParallelSelfAttention`` in every layer, gradients summed over the ranks) gives the
losses of single-process training step by step."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sparse_io_attn import patterns
from sparse_io_attn.distributed import ContextParallelPlan, ContextParallelSelfAttention
from sparse_io_attn.nn import SparseSelfAttention, selectors

_PATH = Path(__file__).resolve().parents[2] / "examples" / "train_context_parallel.py"
_spec = importlib.util.spec_from_file_location("train_context_parallel", _PATH)
example = sys.modules.setdefault("train_context_parallel", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(example)


def test_two_processes_train_like_one():
    cfg = example.small_config(seq_len=96, block_size=16, stride=32, d_model=32, num_layers=2, batch_size=2,
                               steps=3)
    single = example.train_single(example.Corpus(), cfg)
    cp = example.train_context_parallel(cfg, 2)
    assert len(cp["losses"]) == 3 and cp["rows"] != [6, 0]
    for a, b in zip(single, cp["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (single, cp["losses"])
    assert single[-1] < single[0]


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
    with pytest.raises(ValueError, match="selector"):
        ContextParallelSelfAttention(SparseSelfAttention(16, 2, selector=selectors.moba(16, 2), causal=True), plan)
    with pytest.raises(TypeError, match="SparseSelfAttention"):
        ContextParallelSelfAttention(torch.nn.Linear(2, 2), plan)
