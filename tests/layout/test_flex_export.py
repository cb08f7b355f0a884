"""The FlexAttention export (`layout.to_flex_block_mask`): its `mask_mod` is the layout's element mask
on every element, for each of its three rules (band: no table; rows: per-query intervals; blocks:
narrow block codes and uint8 bits), every table it reads is narrow, and the full lists hold every
full block. Compiled FlexAttention (CPU Inductor) with it equals the float64 reference."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask
from sparse_io_attn.layout import _flex

CAUSAL = [False, True, "bottom_right"]


def _exact_random(shape, block, seqlen, p=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return BlockSparseLayout.from_dense_mask(torch.rand(*shape, *seqlen, generator=g) < p, block)


def _block_random(shape, block, seqlen, p=0.4, seed=1):
    g = torch.Generator().manual_seed(seed)
    R, C = (-(-n // b) for n, b in zip(seqlen, block))
    return BlockSparseLayout.from_block_mask(torch.rand(*shape, R, C, generator=g) < p, block, seqlen)


ROWS, CODES, BITS = {"first", "end"}, {"codes"}, {"codes", "bits"}
CASES = [  # (layout builder, the rule it must get, the tables it must read, the block codes' dtype)
    pytest.param(lambda: patterns.causal((70, 90), (16, 8)), "band", set(), None, id="causal-diagonal-rect"),
    pytest.param(lambda: patterns.sliding_window(100, 16, 20), "band", set(), None, id="window-ragged"),
    pytest.param(lambda: patterns.sliding_window((45, 77), (8, 16), 9, causal=True), "band", set(), None,
                 id="causal-window-rect"),
    pytest.param(lambda: patterns.dense((33, 50), 16), "band", set(), None, id="dense-ragged"),
    pytest.param(lambda: patterns.document([0, 30, 31, 77, 100], 16, causal=True), "rows", ROWS, None,
                 id="documents-causal"),
    pytest.param(lambda: patterns.document([0, 13, 64, 90], 16), "rows", ROWS, None, id="documents"),
    pytest.param(lambda: patterns.prefix_lm(100, 16, 23), "rows", ROWS, None, id="prefix-lm"),
    pytest.param(lambda: patterns.bigbird(256, 16, num_heads=2), "blocks", CODES | ROWS, torch.uint8,
                 id="bigbird-per-head"),
    pytest.param(lambda: _block_random((2, 3), (16, 8), (45, 37)), "blocks", CODES, torch.uint8,
                 id="random-per-batch-head"),
    pytest.param(lambda: patterns.random(100, 16, 0.3, num_heads=2, causal=True), "blocks", CODES | ROWS,
                 torch.uint8, id="random-causal-diagonals"),
    pytest.param(lambda: patterns.longformer(100, 16, 10), "blocks", BITS | ROWS, torch.uint8,
                 id="longformer-global-token"),
    pytest.param(lambda: BlockSparseLayout.from_block_mask(torch.tensor([[True, False, True], [False] * 3]), 8, (12, 20)),
                 "blocks", CODES, torch.uint8, id="gapped-row-empty-row"),
    pytest.param(lambda: BlockSparseLayout.from_block_mask(torch.zeros(2, 3, dtype=torch.bool), 8, (12, 20)),
                 "rows", ROWS, None, id="nothing-kept"),
    pytest.param(lambda: _exact_random((2, 3), (8, 4), (45, 37)), "blocks", BITS | ROWS, torch.int16,
                 id="arbitrary-per-batch-over-253-masks"),
]


def _lists(num, idx, shape):
    out = torch.zeros(shape, dtype=torch.bool)
    B, H, R = num.shape
    for b in range(B):
        for h in range(H):
            for r in range(R):
                out[b, h, r, idx[b, h, r, :int(num[b, h, r])].long()] = True
    return out


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "top-left", "bottom-right"])
@pytest.mark.parametrize("build,rule,tables,codes_dtype", CASES)
def test_mask_mod_is_the_element_mask(build, rule, tables, codes_dtype, causal):
    lo = build()
    B, H, (sq, sk) = lo.layout_batch, lo.layout_heads, lo.seqlen
    bm = lo.to_flex_block_mask(causal)
    assert _flex.describe(bm.mask_mod)["rule"] == rule
    assert set(_flex.mask_tables(bm.mask_mod)) == tables
    want = element_mask(lo, B, H, sq, sk, causal=causal)
    assert torch.equal(create_mask(bm.mask_mod, B, H, sq, sk, device="cpu"), want)
    # every block with an allowed element is listed; the full list holds exactly the blocks whose
    # whole rectangle is allowed (mask_mod never runs there), the partial list the others
    (bq, bk), R, C = lo.block_size, lo.num_q_blocks, lo.num_kv_blocks
    pad = torch.zeros(B, H, R * bq, C * bk, dtype=torch.bool)
    pad[..., :sq, :sk] = want
    tiles = pad.view(B, H, R, bq, C, bk)
    full = _lists(bm.full_kv_num_blocks, bm.full_kv_indices, (B, H, R, C))
    part = _lists(bm.kv_num_blocks, bm.kv_indices, (B, H, R, C))
    assert torch.equal(full, tiles.all(dim=(3, 5)))
    assert torch.equal(part, tiles.any(dim=(3, 5)) & ~full)
    assert BlockSparseLayout.from_flex_block_mask(bm).equal(BlockSparseLayout.from_dense_mask(want, lo.block_size))


@pytest.mark.parametrize("build,rule,tables,codes_dtype", CASES)
def test_tables_are_narrow(build, rule, tables, codes_dtype):
    """What the compiled kernels load: the block codes (a tile gather) in uint8, int16 past 253
    stored bit masks; the mask bits (a tile gather) in uint8; the per-query interval columns in the
    narrowest type holding seqlen_k (8 or 16 bits here). Never a 32-bit tile gather."""
    lo = build()
    read = _flex.mask_tables(lo.to_flex_block_mask().mask_mod)
    for name, t in read.items():
        if name == "codes":
            assert t.dtype == codes_dtype
            stored = read["bits"].shape[0] if "bits" in read else 0          # codes 3 + m for bit mask m
            assert (t.dtype == torch.int16) == (stored > 253)
            assert tuple(t.shape) == (lo.layout_batch, lo.layout_heads, lo.num_q_blocks, lo.num_kv_blocks)
        elif name == "bits":
            assert t.dtype == torch.uint8 and tuple(t.shape[1:]) == (lo.BLOCK_SIZE_Q, -(-lo.BLOCK_SIZE_KV // 8))
        else:
            assert t.dtype == _flex.narrowest(lo.seqlen_k) and t.element_size() <= 2
            assert tuple(t.shape) == (lo.layout_batch, lo.layout_heads, lo.seqlen_q)


def test_narrowest_type_thresholds():
    assert [_flex.narrowest(v) for v in (0, 255, 256, 32767, 32768, 2 ** 31 - 1)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32, torch.int32]
    with pytest.raises(ValueError, match="past int32"):
        _flex.narrowest(2 ** 31)


def test_row_tables_widen_with_seqlen_k():
    """Per-query tables hold key positions: int16 once seqlen_k passes 255."""
    lo = patterns.document([0, 100, 300], 64)
    read = _flex.mask_tables(lo.to_flex_block_mask().mask_mod)
    assert {t.dtype for t in read.values()} == {torch.int16}


@pytest.mark.slow
def test_more_masks_than_int16_codes_fall_back_to_int32():
    """32,766 and more stored bit masks: int32 block codes, still element-exact."""
    g = torch.Generator().manual_seed(3)
    sq = sk = 1456                                           # 182 x 182 blocks of 8 x 8, random elements
    lo = BlockSparseLayout.from_dense_mask(torch.rand(sq, sk, generator=g) < 0.5, 8)
    bm = lo.to_flex_block_mask()
    read = _flex.mask_tables(bm.mask_mod)
    assert read["codes"].dtype == torch.int32 and read["bits"].shape[0] > 32765
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, sq, sk, device="cpu"), lo.to_dense_mask())


@pytest.mark.slow
@pytest.mark.parametrize("build,causal", [
    pytest.param(lambda: patterns.sliding_window(96, 32, 20), True, id="band-causal"),
    pytest.param(lambda: patterns.document([0, 40, 41, 96], 32, causal=True), "bottom_right", id="rows"),
    pytest.param(lambda: _exact_random((2,), (32, 32), (96, 96), p=0.6), False, id="blocks-bits-per-head"),
])
def test_compiled_flex_matches_reference(build, causal):
    """torch.compile(flex_attention) on the CPU (Inductor's C++ template) with the export equals the
    float64 reference, per rule."""
    lo = build()
    H = lo.layout_heads
    sq, sk = lo.seqlen
    q, k, v = (torch.randn(1, H, n, 16) for n in (sq, sk, sk))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=lo.to_flex_block_mask(causal))
    ref, _ = attention_reference(q.double(), k.double(), v.double(), lo, causal=causal)
    assert not out.isnan().any()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.slow
def test_flex_forward_fits_sm90_shared_memory(tmp_path):
    """Flex's sm_90 forward kernel at its default tiles (128 x 64, 3 stages, 8 warps at D 128),
    generated by Inductor and compiled for sm_90 without a GPU (benchmarks/flex_compile_report.py):
    the former int32 export needs the 262,144 B the H200 refused (the calibration), the narrow
    export fits 232,448 B."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "flex_compile_report.py"
    out = tmp_path / "report"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, str(script), "--n", "1024", "--d", "128", "--families", "random",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["export"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["legacy"]["shared_bytes"] == 262144 and rows["legacy"]["tiles"] == {"BLOCK_M": 128, "BLOCK_N": 64}
    assert rows["narrow"]["shared_bytes"] <= 232448 and rows["narrow"]["fits_sm90"]
    assert rows["narrow"]["cp_async"] < rows["legacy"]["cp_async"]
