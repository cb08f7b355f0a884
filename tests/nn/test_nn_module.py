"""`SparseSelfAttention` against a float64 dense masked reference built from the same weights."""
import functools

import pytest
import torch
import torch.nn.functional as F

from sparse_io_attn import BlockSparseLayout
from sparse_io_attn.accounting.allocations import largest_allocation
from sparse_io_attn.nn import SparseSelfAttention
from sparse_io_attn.block_sparse.reference import element_mask, masked_attention, rel_err


def band_layout(seqlen, block_size=16, window=3, causal=True, global_blocks=0):
    """Local window of ``window`` key blocks (behind the query block if causal, centred if not)
    plus ``global_blocks`` leading key blocks every row reads."""
    nb = -(-seqlen // block_size)
    i = torch.arange(nb)
    diff = i[:, None] - i[None, :]
    keep = (diff >= 0) & (diff < window) if causal else diff.abs() <= window // 2
    keep[:, :global_blocks] = True
    return BlockSparseLayout.from_block_mask(keep, block_size, seqlen, name="band")


def random_layout(seqlen, block_size, heads=None, density=0.5, empty_row=False):
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    shape = (-(-seqlen // bq), -(-seqlen // bk))
    if heads is not None:
        shape = (heads, *shape)
    keep = torch.rand(shape) < density
    if empty_row:
        keep[..., 1, :] = False  # one query-block row (of every head) attends to nothing
    return BlockSparseLayout.from_block_mask(keep, (bq, bk), seqlen, name="random")


def reference_forward(mod: SparseSelfAttention, x: torch.Tensor, layout: BlockSparseLayout):
    """The layer in float64 with dense element masking: ``(y, x64, params64)``."""
    params = {n: p.detach().double().requires_grad_() for n, p in mod.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    B, N, E = x.shape
    H, Hkv, D = mod.num_heads, mod.num_kv_heads, mod.head_dim

    def lin(name, t):
        return F.linear(t, params[f"{name}.weight"], params.get(f"{name}.bias"))

    q = lin("q_proj", x64).view(B, N, H, D).transpose(1, 2)
    k = lin("k_proj", x64).view(B, N, Hkv, D).transpose(1, 2)
    v = lin("v_proj", x64).view(B, N, Hkv, D).transpose(1, 2)
    mask = element_mask(layout, B, H, N, N, causal=mod.causal)
    o, _ = masked_attention(q, k, v, mask, D ** -0.5)
    return lin("out_proj", o.transpose(1, 2).reshape(B, N, E)), x64, params


CASES = [
    pytest.param(dict(B=2, E=32, H=4, kv=None, N=70, causal=True, bias=True,
                      lay=functools.partial(band_layout, block_size=16, window=3)),
                 id="B2-H4-N70-bs16-causal-pattern"),
    pytest.param(dict(B=1, E=32, H=4, kv=2, N=64, causal=False, bias=True,
                      lay=random_layout(64, 16)), id="B1-H4-KV2-N64-bs16-GQA-fixed"),
    pytest.param(dict(B=2, E=48, H=4, kv=1, N=50, causal=True, bias=True,
                      lay=functools.partial(random_layout, block_size=(16, 8), density=0.6)),
                 id="B2-H4-KV1-N50-bs16x8-MQA-causal"),
    pytest.param(dict(B=2, E=32, H=4, kv=None, N=45, causal=False, bias=True,
                      lay=functools.partial(random_layout, block_size=16, heads=4, empty_row=True)),
                 id="B2-H4-N45-bs16-perhead-emptyrow"),
    pytest.param(dict(B=1, E=16, H=2, kv=None, N=33, causal=True, bias=False,
                      lay=functools.partial(band_layout, block_size=8, window=2, global_blocks=1)),
                 id="B1-H2-N33-bs8-global-nobias"),
]


@pytest.mark.parametrize("case", CASES)
def test_module_matches_float64_reference(case):
    lay = case["lay"]
    mod = SparseSelfAttention(case["E"], case["H"], lay, num_kv_heads=case["kv"], causal=case["causal"],
                              bias=case["bias"], backend="torch")
    x = torch.randn(case["B"], case["N"], case["E"], requires_grad=True)
    y = mod(x)
    layout = mod.layout_for(case["N"])
    y_ref, x64, p64 = reference_forward(mod, x, layout)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y.detach(), y_ref.detach()) < 1e-5

    w = torch.randn_like(y)
    (y * w).sum().backward()
    (y_ref * w.double()).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert rel_err(x.grad, x64.grad) < 1e-4
    for name, p in mod.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        if name == "k_proj.bias":  # a key bias shifts every score of a row equally: gradient 0
            assert p.grad.norm() < 1e-5 * mod.k_proj.weight.grad.norm()
            continue
        assert rel_err(p.grad, p64[name].grad) < 1e-4, name


def test_empty_rows_give_bias_only_output():
    """Query blocks with no kept key block: attention output 0, so the layer returns out_proj.bias."""
    layout = random_layout(40, 8, heads=2, empty_row=True)
    mod = SparseSelfAttention(16, 2, layout, backend="torch")
    y = mod(torch.randn(3, 40, 16))
    torch.testing.assert_close(y[:, 8:16], mod.out_proj.bias.expand(3, 8, 16), rtol=0, atol=0)


def test_pattern_is_built_once_per_length():
    calls = []

    def pattern(n):
        calls.append(n)
        return band_layout(n, block_size=8)

    mod = SparseSelfAttention(16, 2, pattern, causal=True)
    for n in (24, 40, 24, 40, 24):
        mod(torch.randn(1, n, 16))
    assert calls == [24, 40]
    assert mod.layout_for(24) is mod.layout_for(24)
    assert mod.layout_for(24).seqlen == (24, 24) and mod.layout_for(40).seqlen == (40, 40)


@pytest.mark.parametrize("kwargs, exc, words", [
    pytest.param(dict(dropout=0.1), NotImplementedError, "dropout", id="dropout"),
    pytest.param(dict(dropout=1.5), ValueError, "dropout", id="dropout-range"),
    pytest.param(dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads", id="gqa-heads"),
    pytest.param(dict(embed_dim=30), ValueError, "multiple of num_heads", id="embed-dim"),
    pytest.param(dict(backend="cuda"), ValueError, "backend", id="backend"),
    pytest.param(dict(layout_or_pattern="band"), TypeError, "BlockSparseLayout", id="layout-type"),
    pytest.param(dict(layout_or_pattern=band_layout(32, 8).union(band_layout(32, 8))), None, None,
                 id="ok-layout"),
])
def test_constructor_errors(kwargs, exc, words):
    args = dict(embed_dim=32, num_heads=4, layout_or_pattern=band_layout(32, 8)) | kwargs
    if exc is None:
        SparseSelfAttention(**args)
        return
    with pytest.raises(exc, match=words):
        SparseSelfAttention(**args)


def test_forward_errors():
    fixed = SparseSelfAttention(16, 2, band_layout(32, 8))
    with pytest.raises(ValueError, match="built for seqlen 32 but the input has 40"):
        fixed(torch.randn(1, 40, 16))
    with pytest.raises(ValueError, match=r"\[batch, seqlen, 16\]"):
        fixed(torch.randn(1, 32, 8))
    wrong_len = SparseSelfAttention(16, 2, lambda n: band_layout(n + 8, 8))
    with pytest.raises(ValueError, match="square layout for seqlen 32"):
        wrong_len(torch.randn(1, 32, 16))
    wrong_heads = SparseSelfAttention(16, 2, functools.partial(random_layout, block_size=8, heads=3))
    with pytest.raises(ValueError, match="3 head masks"):
        wrong_heads(torch.randn(1, 32, 16))
    with pytest.raises(TypeError, match="must return a BlockSparseLayout"):
        SparseSelfAttention(16, 2, lambda n: None)(torch.randn(1, 32, 16))


def test_no_quadratic_buffer_at_16k():
    """Forward+backward at n = 16384: the largest allocation stays far below one n x n fp32
    buffer (1 GiB). The probe is checked first on dense attention, where it must see n^2."""
    n_small = 1024
    qd = torch.randn(1, 1, n_small, 16, requires_grad=True)
    dense = largest_allocation(
        lambda: masked_attention(qd, qd, qd, torch.ones(n_small, n_small, dtype=torch.bool), 0.25)[0]
        .sum().backward())
    assert dense >= n_small * n_small * 4

    n = 16384
    mod = SparseSelfAttention(64, 2, functools.partial(band_layout, block_size=64, window=3,
                                                       global_blocks=1), causal=True, backend="torch")
    x = torch.randn(1, n, 64, requires_grad=True)
    mod.layout_for(n)
    largest = largest_allocation(lambda: mod(x).sum().backward())
    assert largest < n * n * 4 // 64, f"largest allocation {largest} bytes"
    assert torch.isfinite(x.grad).all()
