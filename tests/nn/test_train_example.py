"""examples/train_char_lm.py: block-sparse training reproduces dense masked training step by step."""
import importlib.util
import sys
from pathlib import Path

import torch

from sparse_io_attn import BlockSparseLayout

_PATH = Path(__file__).resolve().parents[2] / "examples" / "train_char_lm.py"
_spec = importlib.util.spec_from_file_location("train_char_lm", _PATH)
train_char_lm = sys.modules.setdefault("train_char_lm", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(train_char_lm)


def _run(attention: str, cfg) -> list[float]:
    corpus = train_char_lm.Corpus()
    torch.manual_seed(cfg.seed)
    model = train_char_lm.CharLM(corpus.vocab_size, cfg, attention)
    return train_char_lm.train(model, corpus, cfg)["train"]


def test_sparse_and_dense_masked_training_agree():
    """20 steps from one seed: the loss curves of block-sparse attention and of dense attention over
    the same element mask agree to 1e-4 relative (seq_len 72: the last block is partial)."""
    cfg = train_char_lm.Config(seq_len=72, block_size=8, stride=16, d_model=32, num_layers=2,
                               num_heads=2, batch_size=4, lr=3e-3, steps=20, seed=0)
    sparse, dense = _run("sparse", cfg), _run("dense", cfg)
    assert len(sparse) == len(dense) == 20
    for step, (a, b) in enumerate(zip(sparse, dense)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: sparse {a} vs dense {b}"
    assert sparse[-1] < sparse[0] - 0.3  # it is learning, not sitting still


def test_layout_is_sparse_transformer_strided():
    """The example's layout keeps exactly the blocks touched by the causal strided element pattern
    ``0 <= q - k < stride or (q - k) % stride == 0`` (Child et al. 2019)."""
    cfg = train_char_lm.Config(seq_len=200, block_size=16, stride=48)
    model = train_char_lm.CharLM(10, cfg)
    layout = model.blocks[0].attn.layout_for(200)
    d = torch.arange(200)[:, None] - torch.arange(200)[None, :]
    allowed = (d >= 0) & ((d < 48) | (d % 48 == 0))
    assert layout.equal(BlockSparseLayout.from_dense_mask(allowed, 16))
    assert layout.density < 0.5
