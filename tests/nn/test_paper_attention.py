"""nn.PaperAttention: the per-head products X = W_Q W_K^T and Y = W_V W_O as trainable block-sparse
operands of sparse_operands.attention; output against a dense float64 computation with the same pruned
weights; gradients only on the patterns; patterns fixed by magnitude pruning or given."""
import functools
import math

import pytest
import torch

from sparse_io_attn import patterns
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.nn import PaperAttention
from sparse_io_attn.nn.paper import prune_blocks


def dense_reference(layer: PaperAttention, x: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_h softmax(x X_h x^T * scale) x Y_h`` over the layer's element mask."""
    X, Y = (w.detach().double() for w in layer.dense_weights())
    xd = x.double()
    s = torch.einsum("bnd,hde,bme->bhnm", xd, X, xd) * layer.scale
    lay = layer.layout_for(x.shape[1], x.device)
    if lay is not None:
        mask = lay.to_dense_mask()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhnm,bmd,hde->bne", p, xd, Y)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(x_pattern=0.3, y_pattern=0.5), id="pruned-X30-Y50"),
    pytest.param(dict(x_pattern=0.25, qk_pattern=functools.partial(patterns.causal, block_size=8)), id="causal"),
    pytest.param(dict(), id="dense"),
])
def test_matches_dense_float64_reference_of_pruned_weights(kw):
    g = torch.Generator().manual_seed(3)
    layer = PaperAttention(32, 4, block_size=8, generator=g, **kw)
    x = torch.randn(2, 21, 32, generator=g)
    out = layer(x)
    assert out.shape == (2, 21, 32)
    assert rel_err(out, dense_reference(layer, x)) < 1e-5


def test_gradients_only_on_patterns_and_pruning_keeps_largest_blocks():
    g = torch.Generator().manual_seed(0)
    layer = PaperAttention(32, 2, x_pattern=0.25, y_pattern=0.5, block_size=8, generator=g)
    R = 32 // 8
    assert layer.x.counts == [round(0.25 * R * R)] * 2 and layer.y.counts == [round(0.5 * R * R)] * 2
    X, Y = layer.dense_weights()
    x = torch.randn(3, 16, 32, generator=g)
    layer(x).pow(2).sum().backward()
    assert layer.x.values.grad.shape == layer.x.values.shape and layer.x.values.grad.abs().sum() > 0
    assert layer.y.values.grad.abs().sum() > 0
    # the dense view: a gradient step changes nothing outside the patterns
    with torch.no_grad():
        layer.x.values -= 0.1 * layer.x.values.grad
        layer.y.values -= 0.1 * layer.y.values.grad
    X2, Y2 = layer.dense_weights()
    for before, after, w in ((X, X2, layer.x), (Y, Y2, layer.y)):
        pat = torch.stack([m.to_block_mask() for m in w.matrices()])
        outside = ~pat.repeat_interleave(8, 1).repeat_interleave(8, 2)
        assert (after[outside] == 0).all() and (before[outside] == 0).all()
        assert not torch.equal(before, after)
    # magnitude pruning: every kept block's norm >= every dropped block's norm, per head
    dense = torch.randn(2, 20, 20, generator=g)
    keep = prune_blocks(dense, 8, 0.4)
    norms = torch.nn.functional.pad(dense, (0, 4, 0, 4)).view(2, 3, 8, 3, 8).pow(2).sum((2, 4))
    for h in range(2):
        assert keep[h].sum() == round(0.4 * 9)
        assert norms[h][keep[h]].min() >= norms[h][~keep[h]].max()


def test_given_patterns_per_head_and_layout_per_head():
    g = torch.Generator().manual_seed(1)
    pats = [BlockSparseMatrix.random(torch.rand(3, 3, generator=g) < 0.6, 16, generator=g) for _ in range(3)]
    pats[0] = BlockSparseMatrix.random(torch.eye(3, dtype=torch.bool), 16, generator=g)
    lay = BlockSparseLayout.from_block_mask(torch.rand(3, 2, 2, generator=g) < 0.7, 16, (32, 32))
    layer = PaperAttention(48, 3, x_pattern=pats, y_pattern=pats[0], qk_pattern=lay, block_size=16, generator=g)
    assert [int(m.to_block_mask().sum()) for m in layer.x.matrices()] == [int(p.to_block_mask().sum()) for p in pats]
    for m, p in zip(layer.x.matrices(), pats):
        assert torch.equal(m.to_block_mask(), p.to_block_mask())
    x = torch.randn(2, 32, 48, generator=g)
    assert rel_err(layer(x), dense_reference(layer, x)) < 1e-5


def test_trains_and_errors():
    g = torch.Generator().manual_seed(2)
    layer = PaperAttention(16, 2, x_pattern=0.5, y_pattern=0.5, block_size=8, generator=g)
    x, target = torch.randn(2, 12, 16, generator=g), torch.randn(2, 12, 16, generator=g)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="multiple of num_heads"):
        PaperAttention(10, 3)
    with pytest.raises(ValueError, match=r"density must be a float in \(0, 1\]"):
        PaperAttention(16, 2, x_pattern=1.5, block_size=8)
    with pytest.raises(ValueError, match="must have shape"):
        PaperAttention(16, 2, x_pattern=BlockSparseMatrix.random(torch.ones(1, 1, dtype=torch.bool), 8), block_size=8)
    with pytest.raises(ValueError, match=r"expects x \[B, N, E=16\]"):
        layer(torch.randn(12, 16))


def test_triton_backend_matches_torch_backend():
    """The same layer on backend "triton" (interpreter: every head and batch element in one launch
    per kernel) gives the torch backend's output and weight gradients."""
    g = torch.Generator().manual_seed(4)
    layer = PaperAttention(32, 2, x_pattern=0.5, y_pattern=0.75, block_size=16, generator=g)
    x = torch.randn(2, 24, 32, generator=g)
    grads = {}
    for backend in ("torch", "triton"):
        layer.backend = backend
        layer.zero_grad()
        out = layer(x)
        out.pow(2).sum().backward()
        grads[backend] = (out.detach(), layer.x.values.grad.clone(), layer.y.values.grad.clone())
    for a, b in zip(grads["torch"], grads["triton"]):
        assert rel_err(b, a) < 1e-5


@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 12, 16)], ids=["N0", "B0"])
@pytest.mark.parametrize("qk", [None, "pattern", "layout"])
def test_empty_sequence_or_batch_gives_the_empty_output(shape, qk):
    """N = 0 or B = 0: the reference's empty output and zero weight gradients (a QK pattern has
    nothing to pattern without keys), whatever the QK pattern."""
    g = torch.Generator().manual_seed(4)
    qk_pattern = {None: None, "pattern": functools.partial(patterns.causal, block_size=8),
                  "layout": patterns.causal(12, 8)}[qk]
    layer = PaperAttention(16, 2, x_pattern=0.5, qk_pattern=qk_pattern, block_size=8, generator=g)
    x = torch.randn(shape, generator=g, requires_grad=True)
    out = layer(x)
    assert out.shape == shape and torch.equal(out.double(), dense_reference(layer, x) if shape[1] else out.double())
    out.sum().backward()
    assert x.grad.shape == shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_qk_pattern_must_return_a_layout():
    layer = PaperAttention(16, 2, qk_pattern=lambda n: None)
    with pytest.raises(TypeError, match=r"qk_pattern\(12\) must return a BlockSparseLayout built for seqlen "
                                        r"\(12, 12\), got NoneType"):
        layer(torch.randn(1, 12, 16))
