"""The traffic model predicts exactly the bytes the Triton kernels count (exact integer equality)."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_io_attn import BlockSparseLayout, block_sparse_attention
from sparse_io_attn.block_sparse.tiles import choose_tiles, kernel_configs
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse.reference import element_mask

DEVICE = "cpu" if INTERPRET else "cuda"


def random_config(rng: random.Random):
    bq, bk = rng.choice([(16, 16), (32, 32), (16, 32), (32, 16), (64, 64), (128, 64), (48, 32)])
    Hkv = rng.choice([1, 2])
    Hq = Hkv * rng.choice([1, 2])
    B = rng.choice([1, 2])
    Nq, Nk = rng.randint(20, 160), rng.randint(20, 160)
    D = rng.choice([16, 24, 48, 64, 80])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    causal = rng.choice([False, True, "bottom_right"])
    lb = B if rng.random() < 0.3 else 1
    lh = Hq if rng.random() < 0.4 else 1
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    mask = torch.rand(lb, lh, nqb, nkb, generator=gen) < rng.random()
    if rng.random() < 0.5:   # element-exact: thin some kept blocks to partial ones
        elem = mask.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :Nq, :Nk]
        thin = (torch.rand(lb, lh, nqb, nkb, generator=gen) < 0.5).repeat_interleave(bq, -2) \
            .repeat_interleave(bk, -1)[..., :Nq, :Nk]
        elem &= ~thin | (torch.rand(elem.shape, generator=gen) < 0.5)
        layout = BlockSparseLayout.from_dense_mask(elem, (bq, bk))
    else:
        layout = BlockSparseLayout.from_block_mask(mask, (bq, bk), (Nq, Nk))
    return layout, B, Hq, Hkv, D, dtype, causal


def curated_config(block, seqlen, B, Hq, Hkv, D, dtype, causal, per_head):
    nqb, nkb = -(-seqlen[0] // block[0]), -(-seqlen[1] // block[1])
    mask = torch.rand(Hq if per_head else 1, nqb, nkb) < 0.7
    return BlockSparseLayout.from_block_mask(mask, block, seqlen), B, Hq, Hkv, D, dtype, causal


CURATED = [
    pytest.param(((128, 128), (250, 230), 1, 2, 1, 40, torch.bfloat16, True, True), id="block128-tile64-causal-gqa"),
    pytest.param(((64, 128), (130, 260), 1, 1, 1, 32, torch.float16, True, False), id="block64x128-causal-rect"),
    pytest.param(((128, 128), (200, 300), 1, 2, 2, 32, torch.float32, "bottom_right", False),
                 id="block128-bottom-right-Nq<Nk"),
]


@pytest.mark.parametrize("config", [pytest.param(s, id=f"seed{s}") for s in range(16)] + CURATED)
def test_counted_equals_predicted(config):
    if isinstance(config, int):
        layout, B, Hq, Hkv, D, dtype, causal = random_config(random.Random(config))
    else:
        layout, B, Hq, Hkv, D, dtype, causal = curated_config(*config)
    Nq, Nk = layout.seqlen
    q = torch.randn(B, Hq, Nq, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, D, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, D, device=DEVICE, dtype=dtype, requires_grad=True)
    with IOCounter() as fwd_io:
        out = block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")
    with IOCounter() as bwd_io:
        out.backward(torch.randn_like(out))
    args = (layout, B, Hq, Hkv, D, dtype)
    # (inputs requiring a gradient: a 16-bit forward writes its rounding residual, the preprocess reads it)
    want_fwd = traffic.block_sparse_forward(*args, causal=causal, residual=True)
    want_bwd = traffic.block_sparse_backward(*args, causal=causal, residual=True)
    assert fwd_io.report == want_fwd, f"{fwd_io.report}\n{want_fwd}"
    assert bwd_io.report == want_bwd, f"{bwd_io.report}\n{want_bwd}"
    if dtype != torch.float32:
        assert fwd_io.report.kernels["attn_fwd"].writes["residual"] == out.numel() * out.element_size()
    total = fwd_io.report + bwd_io.report
    assert total.total_bytes == traffic.block_sparse(*args, causal=causal).total_bytes


def test_dense_forward_closed_form():
    """Dense, non-causal: every query tile reads all of K and V once; blocks at the ragged ends are
    partial (2 schedule entries per tile), the others full (1)."""
    B, Hq, Hkv, N, D, es = 2, 4, 2, 1000, 64, 2
    layout = BlockSparseLayout.from_block_mask(torch.ones(16, 16, dtype=torch.bool), 64, N)
    tiles = choose_tiles((64, 64), D, torch.bfloat16)
    rep = traffic.block_sparse_forward(layout, B, Hq, Hkv, D, torch.bfloat16)
    n_tiles = -(-N // tiles.fwd[0])
    kt = rep.kernels["attn_fwd"]
    assert kt.reads["k"] == kt.reads["v"] == B * Hq * n_tiles * N * D * es
    assert kt.reads["q"] == kt.writes["o"] == B * Hq * N * D * es
    assert kt.writes["lse"] == B * Hq * N * 4
    last_row = 4 + 2 * 16                  # the ragged query-block row: every block partial
    other_rows = 4 + 15 + 2                # 15 full blocks, the ragged key block partial
    assert n_tiles == 16 and kt.reads["layout"] == B * Hq * ((n_tiles - 1) * other_rows + last_row) * 4
    assert kt.reads["mask"] == 0           # no element masks: padding is tested, not loaded


def test_model_scales_to_long_sequences():
    """n = 131072 sliding window (band of 2 blocks each side), predicted without running."""
    n, blk, w = 131072, 64, 2
    nb = n // blk
    i = torch.arange(nb)
    mask = (i[:, None] - i[None, :]).abs() <= w
    layout = BlockSparseLayout.from_block_mask(mask, blk, n)
    B, H, D = 1, 16, 128
    rep = traffic.block_sparse(layout, B, H, H, D, torch.bfloat16)
    fwd = rep.kernels["attn_fwd"]
    assert fwd.reads["k"] == B * H * layout.nnz_blocks * blk * D * 2  # each kept block read once
    dkdv = rep.kernels["attn_bwd_dkdv"]
    assert dkdv.reads["q"] == B * H * layout.nnz_blocks * blk * D * 2
    assert rep.kernels["attn_bwd_dq"].reads["v"] == fwd.reads["v"]


def test_causal_skips_tiles_above_the_diagonal():
    N, D = 256, 64
    layout = BlockSparseLayout.from_block_mask(torch.ones(4, 4, dtype=torch.bool), 64, N)
    full = traffic.block_sparse_forward(layout, 1, 1, 1, D, torch.float16)
    causal = traffic.block_sparse_forward(layout, 1, 1, 1, D, torch.float16, causal=True)
    # 4 query tiles see 1, 2, 3, 4 key tiles instead of 4 each
    assert causal.kernels["attn_fwd"].reads["k"] * 16 == full.kernels["attn_fwd"].reads["k"] * 10


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.integers(1, 200), st.sampled_from([16, 32, (16, 48), (64, 32)]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_kept_elements_matches_element_mask(Nq, Nk, block, causal, seed):
    bq, bk = (block, block) if isinstance(block, int) else block
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, -(-Nq // bq), -(-Nk // bk), generator=g) < 0.5
    layout = BlockSparseLayout.from_block_mask(mask, (bq, bk), (Nq, Nk))
    expect = int(element_mask(layout, 3, 2, Nq, Nk, causal=causal).sum())
    assert traffic.kept_elements(layout, 3, 2, causal=causal) == expect
    assert traffic.block_sparse_flops(layout, 3, 2, 64, causal=causal) == 4 * 64 * expect
    assert traffic.block_sparse_flops(layout, 3, 2, 64, causal=causal, backward=True) == 10 * 64 * expect


@pytest.mark.parametrize("block,head_dim,dtype,expect", [
    pytest.param((128, 128), 64, torch.bfloat16, ((128, 64), (128, 64), (64, 128)), id="b128-d64-bf16"),
    pytest.param((128, 128), 128, torch.float16, ((128, 64), (128, 64), (64, 128)), id="b128-d128-fp16"),
    pytest.param((64, 64), 128, torch.float16, ((64, 64), (64, 64), (64, 64)), id="b64-d128-fp16"),
    pytest.param((128, 128), 256, torch.bfloat16, ((64, 32), (32, 32), (16, 32)), id="b128-d256-bf16"),
    pytest.param((128, 128), 64, torch.float32, ((64, 32), (32, 32), (16, 32)), id="b128-d64-fp32"),
    pytest.param((128, 128), 256, torch.float32, ((32, 32), (16, 32), (16, 16)), id="b128-d256-fp32"),
    pytest.param((48, 16), 80, torch.bfloat16, ((16, 16), (16, 16), (16, 16)), id="b48x16-d80"),
])
def test_choose_tiles(block, head_dim, dtype, expect):
    """Default tiles = the first autotuning candidate, capped to divide the layout block."""
    t = choose_tiles(block, head_dim, dtype)
    assert (t.fwd, t.dq, t.dkdv) == expect
    for kind, tile in zip(("fwd", "dq", "dkdv"), (t.fwd, t.dq, t.dkdv)):
        configs = kernel_configs(kind, block, head_dim, dtype)
        assert (configs[0].block_m, configs[0].block_n) == tile and len(set(configs)) == len(configs)
        for c in configs:
            assert block[0] % c.block_m == 0 and block[1] % c.block_n == 0


def test_choose_tiles_rejects_small_blocks():
    with pytest.raises(NotImplementedError, match="power-of-two divisor >= 16"):
        choose_tiles((24, 64), 64)
    with pytest.raises(NotImplementedError, match="head_dim"):
        choose_tiles((64, 64), 577)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"], ids=["full", "top-left", "bottom-right"])
def test_counted_equals_predicted_with_element_masks(causal):
    """Partial blocks: the mask words the kernels read are counted and predicted exactly."""
    from sparse_io_attn import patterns

    layout = patterns.document([0, 45, 100, 170], 32, causal=True) | patterns.sliding_window(170, 32, 20)
    assert layout.num_partial_blocks > 0
    B, H, D = 1, 2, 32
    q, k, v = (torch.randn(B, H, 170, D, device=DEVICE, requires_grad=True) for _ in range(3))
    with IOCounter() as io:
        block_sparse_attention(q, k, v, layout, causal=causal, backend="triton").sum().backward()
    expect = traffic.block_sparse(layout, B, H, H, D, torch.float32, causal=causal)
    assert io.report == expect, f"{io.report}\n{expect}"
    for kernel in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
        assert io.report.kernels[kernel].reads["mask"] > 0
