"""Decoding with ``block_sparse_attention`` (``Nq <= 16``: one token, speculative verification) at every
backend: the decode kernels (cpu: split-K in C++; triton: split-K + merge) against the float64
reference, forward and backward (backward runs the prefill kernels on the decode forward's stats),
for Nq in {1, 3, 16}, GQA/MQA, shared, per-head and per-KV-head layouts, element-masked partial
blocks, bottom-right causal, ragged Nk, empty rows, fp32/bf16; exact at large logits; bitwise
identical across thread counts; K/V as strided views of a larger cache (NaN everywhere the layout
does not keep) equal to contiguous copies; the cpu kernel's work buffers independent of Nk; the
Triton decode kernels' counted bytes equal to the traffic model's."""
from __future__ import annotations

import pytest
import torch

from helpers import (BACKENDS, check_close, check_forward_close, check_within_reference_error, make_inputs,
                     nan_cache_views, run)
from sparse_io_attn import BlockSparseLayout, block_sparse_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse import cpu
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def _cpu_kernel_present(request):
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "cpu" and not cpu.is_available():
        pytest.skip(f"the C++ kernels cannot be built here: {cpu.unavailable_reason()}")


def device_of(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def window_layout(Nq: int, Nk: int, block, window: int, *, heads: int = 1) -> BlockSparseLayout:
    """The decoded rows of a bottom-right sliding window: query ``i`` (position ``Nk - Nq + i``) sees
    keys ``[pos - window, pos]`` (element-exact: partial blocks at the window's start and on the
    diagonal); ``heads`` masks with the window shrunk by 7 keys per head."""
    pos = torch.arange(Nk - Nq, Nk)[:, None]
    j = torch.arange(Nk)[None, :]
    dense = torch.stack([(j <= pos) & (j >= pos - (window - 7 * h)) for h in range(heads)])
    return BlockSparseLayout.from_dense_mask(dense, block)


def random_layout(Nq: int, Nk: int, block, *, heads: int = 1, density: float = 0.3, empty_head: bool = False):
    """Random element masks (kept blocks thinned to partial ones); ``empty_head``: head 0 keeps nothing."""
    dense = torch.rand(heads, Nq, Nk) < density
    if empty_head:
        dense[0] = False
    return BlockSparseLayout.from_dense_mask(dense, block)


def kv_group_layout(Nq: int, Nk: int, block: int, Hkv: int, K: int) -> BlockSparseLayout:
    """One selection of ``K`` key blocks per KV head (shared by its GQA group): the last block and
    ``K - 1`` random earlier ones."""
    nkb = -(-Nk // block)
    idx = torch.stack([torch.cat([torch.tensor([nkb - 1]), torch.randperm(nkb - 1)[:K - 1]]) for _ in range(Hkv)])
    nqb = -(-Nq // block)
    return BlockSparseLayout.from_kv_indices(idx[:, None, :].expand(Hkv, nqb, K).contiguous(), block, (Nq, Nk))


CASES = [  # Nq, Nk, layout, (B, Hq, Hkv), D, dtype, causal
    pytest.param(1, 1500, lambda: window_layout(1, 1500, 64, 300), (1, 8, 2), 32, torch.float32, "bottom_right",
                 id="Nq1-window-gqa"),
    pytest.param(3, 1003, lambda: random_layout(3, 1003, (16, 32), heads=4, empty_head=True), (2, 4, 1), 24,
                 torch.float32, "bottom_right", id="Nq3-per-head-masks-mqa-ragged-empty-head"),
    pytest.param(16, 777, lambda: window_layout(16, 777, 16, 200, heads=4), (1, 4, 2), 16, torch.float32,
                 "bottom_right", id="Nq16-per-head-window-blocks16"),
    pytest.param(16, 900, lambda: random_layout(16, 900, (8, 16)), (1, 2, 2), 16, torch.float32, True,
                 id="Nq16-two-query-blocks-top-left"),
    pytest.param(1, 2000, lambda: kv_group_layout(1, 2000, 64, 2, 5), (1, 8, 2), 32, torch.float32, "bottom_right",
                 id="Nq1-per-kv-head-selection"),
    pytest.param(3, 1200, lambda: window_layout(3, 1200, 32, 400), (1, 4, 2), 32, torch.bfloat16, "bottom_right",
                 id="Nq3-window-bf16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Nq,Nk,make,heads,D,dtype,causal", CASES)
def test_matches_reference(backend, Nq, Nk, make, heads, D, dtype, causal):
    layout = make()
    if backend == "triton" and (dtype != torch.float32 and INTERPRET or min(layout.block_size) < 16):
        pytest.skip("the interpreter runs fp32 (its 16-bit dot is wrong); triton needs blocks of 16 and more")
    B, Hq, Hkv = heads
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device=device_of(backend))
    if backend == "triton":   # forward only: the interpreter's prefill backward walks every key tile
        out, lse = block_sparse_attention(q, k, v, layout, causal=causal, return_lse=True, backend=backend)
        ref = attention_reference(q, k, v, layout, causal=causal)
        check_forward_close(out, lse, ref, dtype)
        return
    got = run(q, k, v, do, layout, causal, backend=backend)
    ref = attention_reference(q.float(), k.float(), v.float(), layout, causal=causal, do=do.float())
    if dtype == torch.float32:
        check_close(got, ref, tol=2e-5)
    else:   # low precision: within 2x (out) / 3x (gradients) of the same-precision baseline's error
        check_within_reference_error(got, ref, attention_reference(q, k, v, layout, causal=causal, do=do), dtype)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_exact_at_large_logits(backend):
    """Logits ~1e6: the backward (prefill kernels) recomputes P from the decode forward's stats with
    the forward's exact scores, so dV stays exact."""
    layout = random_layout(4, 300, 16, heads=2, density=0.5)
    q, k, v, do = make_inputs(1, 2, 2, 4, 300, 16, device=device_of(backend))
    q, k = q * 1e3, k * 1e3
    got = run(q, k, v, do, layout, "bottom_right", backend=backend)
    ref = attention_reference(q, k, v, layout, causal="bottom_right", do=do)
    assert rel_err(got[0], ref[0]) <= 1e-6 and rel_err(got[4], ref[4]) <= 1e-6


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_bitwise_identical_across_thread_counts(threads, dtype):
    """The splits come from shapes, the merge runs in split order: 1 and 2 threads agree bitwise."""
    layout = window_layout(3, 4000, 64, 2000)   # 32 kept blocks: several splits per row
    q, k, v, _ = make_inputs(1, 8, 2, 3, 4000, 64, dtype)
    results = []
    for n in (1, 2, 1):
        threads(n)
        results.append(block_sparse_attention(q, k, v, layout, causal="bottom_right", return_lse=True, backend="cpu"))
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0]) and torch.equal(results[0][1], other[1])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_cache_views_equal_contiguous_copies(backend, dtype):
    """K/V read where they live: strided views of a larger preallocated cache (and of a [B, N, H, D]
    cache) give the contiguous copies' results bitwise; NaN outside the kept blocks is never read."""
    if backend == "triton" and dtype != torch.float32 and INTERPRET:
        pytest.skip("the interpreter runs fp32")
    Nk, block, window = 1000, 32, 200
    layout = window_layout(2, Nk, block, window)
    q, k, v, _ = make_inputs(1, 4, 2, 2, Nk, 32, dtype, device=device_of(backend))
    kept_from = (Nk - 2 - window) // block * block
    want = block_sparse_attention(q, k, v, layout, causal="bottom_right", return_lse=True, backend=backend)
    assert not torch.isnan(want[0]).any()
    for kv, vv in nan_cache_views(k, v, (torch.arange(k.shape[2], device=k.device) >= kept_from)[:, None]):
        assert not kv.is_contiguous()
        got = block_sparse_attention(q, kv, vv, layout, causal="bottom_right", return_lse=True, backend=backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _shifted_window(Nq: int, Nk: int, block: int, window: int) -> BlockSparseLayout:
    """:func:`window_layout` built at a small length and moved to the end of ``Nk`` keys (whole blocks)."""
    S = -(-(window + Nq + 2 * block) // block) * block
    small = window_layout(Nq, S, block, window)
    return BlockSparseLayout(small.crow_indices, small.col_indices + (Nk - S) // block, block_size=block,
                             seqlen=(Nq, Nk), partial_ids=small.partial_ids, partial_masks=small.partial_masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_work_buffers_do_not_grow_with_the_cache(threads, dtype):
    """No Nk-linear work: the same kept blocks (same values) at the end of caches of 4096 and 65536
    keys give bitwise the same results, with the same work buffers (a few tiles per worker and the
    splits' partials, far below one copy of K), and NaN in every key the layout does not keep."""
    threads(2)
    q = torch.randn(1, 8, 1, 64, dtype=dtype)
    tail_k, tail_v = (torch.randn(1, 2, 1280, 64, dtype=dtype) for _ in range(2))
    results, sizes = [], []
    for Nk in (4096, 65536):
        k, v = (torch.full((1, 2, Nk, 64), float("nan"), dtype=dtype) for _ in range(2))
        k[:, :, -1280:], v[:, :, -1280:] = tail_k, tail_v
        layout = _shifted_window(1, Nk, 64, 1024)
        results.append(block_sparse_attention(q, k, v, layout, causal="bottom_right", return_lse=True, backend="cpu"))
        sizes.append(cpu.decode_work_bytes())
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.isnan(results[0][0]).any()
    assert sizes[0] == sizes[1] and 0 < sizes[0] < 64 * 1024 * 4, sizes


def test_cpu_decode_and_prefill_kernels_agree():
    """The decode kernel (default for Nq <= 16) and the prefill kernel on the same call."""
    layout = random_layout(16, 500, 16, heads=2)
    q, k, v, _ = make_inputs(1, 4, 2, 16, 500, 32)
    p = plan(layout, causal="bottom_right", num_heads_q=4, num_heads_kv=2)
    a = cpu.forward(q, k, v, p, sm_scale=0.2, decode=True)
    b = cpu.forward(q, k, v, p, sm_scale=0.2, decode=False)
    assert rel_err(a[0], b[0]) <= 1e-6 and torch.equal(a[2][0], b[2][0])   # the same row maxima


TRAFFIC = [  # Nq, Nk, layout, (B, Hq, Hkv), D, causal: one split and several, masks, shared/per-head/per-KV-head lists
    pytest.param(1, 600, lambda: window_layout(1, 600, 32, 100), (2, 4, 2), 16, "bottom_right", id="one-split"),
    pytest.param(2, 3000, lambda: window_layout(2, 3000, 32, 1500), (1, 4, 2), 24, "bottom_right",
                 id="splits-window"),
    pytest.param(5, 2000, lambda: random_layout(5, 2000, (16, 32), heads=2, density=0.4), (1, 2, 1), 16, True,
                 id="per-head-masks-top-left"),
    pytest.param(1, 2600, lambda: kv_group_layout(1, 2600, 64, 2, 12), (1, 4, 2), 32, "bottom_right",
                 id="per-kv-head-lists"),
]


@pytest.mark.parametrize("Nq,Nk,make,heads,D,causal", TRAFFIC)
def test_triton_counted_equals_predicted(Nq, Nk, make, heads, D, causal):
    layout = make()
    B, Hq, Hkv = heads
    q, k, v, _ = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    with IOCounter() as io:
        block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")
    predicted = traffic.block_sparse_forward(layout, B, Hq, Hkv, D, torch.float32, causal=causal)
    assert io.report == predicted, f"{io.report}\n{predicted}"
    assert set(predicted.kernels) <= {"attn_decode", "attn_decode_merge"}


def test_decode_tiles_for_wide_rows():
    """MLA's q/k rows (576, bf16: 1024 padded lanes) decode in 32-key tiles over two stages (64-key tiles in
    three stages need more than an H100 block's shared memory); head dim 128 keeps 64 keys, three stages."""
    from sparse_io_attn.block_sparse.tiles import decode_config
    p = plan(BlockSparseLayout.from_block_mask(torch.ones(1, 1, 4, dtype=torch.bool), 64, (1, 256)))
    wide, usual = (decode_config(p, 1, 16, 1, d, torch.bfloat16) for d in (576, 128))
    assert (wide.block_n, wide.num_stages) == (32, 2) and (usual.block_n, usual.num_stages) == (64, 3)
