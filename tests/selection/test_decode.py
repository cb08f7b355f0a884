"""Decoding with ``selection_attention`` (``Nq <= 16``): the cpu decode kernel (split-K over each token's
selected keys, scores formed as each family's backward forms them) at every backend against the
float64 reference, forward and backward, for Nq in {1, 3, 16}: MoBA-shaped (a selection per query
head, blocks of 64), NSA-shaped (per GQA group, counts), single tokens shared by every head, micro
blocks; bottom-right and top-left causal, ragged Nk, empty rows, fp32/bf16. Exact at large logits,
bitwise identical across thread counts, strided cache views equal to contiguous copies (NaN in every
key no row may use), no key lists built and work buffers independent of Nk. Backend "triton" runs
its decode kernels here (forward); their own tests (splits, backward, traffic) are in
``test_decode_triton.py``."""
from __future__ import annotations

import pytest
import torch

from helpers import (check_close, check_forward_close, check_within_reference_error, decode_indices, make_inputs,
                     nan_cache_views)
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import cpu
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.reference import selection_mask, selection_reference

DEVICE = "cpu" if INTERPRET else "cuda"
FAMILIES = ("key", "query")


@pytest.fixture(autouse=True)
def _cpu_kernel_present(request):
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend", "cpu") == "cpu" and not cpu.is_available():
        pytest.skip(f"the C++ kernels cannot be built here: {cpu.unavailable_reason()}")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def run_backend(q, k, v, do, sel, causal, backend, family=None):
    """``(out, lse, dq, dk, dv)``: the public API, or (``family``) the cpu backend's functions."""
    if family is not None:
        D = q.shape[-1]
        plan = SelectionPlan(sel, k.shape[2], causal_offset(causal, q.shape[2], k.shape[2]))
        out, lse, stats = cpu.forward(q, k, v, plan, sm_scale=D ** -0.5, family_name=family)
        return (out, lse) + cpu.backward(do, q, k, v, out, stats, plan, sm_scale=D ** -0.5, family_name=family)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = selection_attention(q, k, v, sel, causal=causal, return_lse=True, backend=backend)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


CASES = [  # B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, dtype, empty_rows
    pytest.param(1, 8, 2, 8, 1, 2000, 32, 64, 8, "bottom_right", torch.float32, (), id="Nq1-moba-Ghq"),
    pytest.param(1, 4, 2, 2, 3, 1500, 32, 16, 12, "bottom_right", torch.float32, (1,), id="Nq3-nsa-Ghkv-empty-row"),
    pytest.param(1, 4, 1, 1, 16, 900, 16, 1, 64, "bottom_right", torch.float32, (), id="Nq16-tokens-G1-mqa"),
    pytest.param(2, 4, 2, 4, 3, 1001, 16, 4, 10, True, torch.bfloat16, (0,), id="Nq3-bs4-top-left-bf16"),
    pytest.param(1, 2, 2, 2, 16, 1003, 32, 64, 4, "bottom_right", torch.bfloat16, (), id="Nq16-bs64-ragged-bf16"),
]
RUNS = [pytest.param("torch", None, id="torch"), pytest.param("triton", None, id="triton"),
        pytest.param("cpu", None, id="cpu"), pytest.param("cpu", "key", id="cpu-key-major"),
        pytest.param("cpu", "query", id="cpu-query-major")]


@pytest.mark.parametrize("backend,family", RUNS)
@pytest.mark.parametrize("B,Hq,Hkv,G,Nq,Nk,D,bs,K,causal,dtype,empty_rows", CASES)
def test_matches_reference(backend, family, B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, dtype, empty_rows):
    dev = DEVICE if backend == "triton" else "cpu"
    if backend == "triton" and dtype != torch.float32 and INTERPRET:
        pytest.skip("the interpreter runs fp32 (its 16-bit dot is wrong)")
    sel = Selection(decode_indices((B, G), Nq, Nk, K, bs, causal, empty_rows=empty_rows, device=dev), bs)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device=dev)
    if backend == "triton":   # forward only: the interpreter's backward walks every key block
        out, lse = selection_attention(q, k, v, sel, causal=causal, return_lse=True, backend="triton")
        ref = selection_reference(q, k, v, sel, causal=causal)
        check_forward_close(out, lse, ref, dtype)
        return
    got = run_backend(q, k, v, do, sel, causal, backend, family)
    ref = selection_reference(q.float(), k.float(), v.float(), sel, causal=causal, do=do.float())
    if dtype == torch.float32:
        check_close(got, ref, tol=2e-5)
    else:   # low precision: within 2x (out) / 3x (gradients) of the same-precision baseline's error
        check_within_reference_error(got, ref, selection_reference(q, k, v, sel, causal=causal, do=do), dtype)
    if empty_rows:
        assert torch.isneginf(got[1][..., list(empty_rows)]).all() and (got[0][..., list(empty_rows), :] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_at_large_logits(family):
    """Logits ~1e6: the family's backward recomputes P from the decode forward's stats exactly."""
    sel = Selection(decode_indices((2,), 4, 300, 5, 16, "bottom_right"), 16)
    q, k, v, do = make_inputs(1, 4, 2, 4, 300, 16)
    q, k = q * 1e3, k * 1e3
    got = run_backend(q, k, v, do, sel, "bottom_right", "cpu", family)
    ref = selection_reference(q, k, v, sel, causal="bottom_right", do=do)
    assert rel_err(got[0], ref[0]) <= 1e-6 and rel_err(got[4], ref[4]) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bs,K", [(64, 8), (1, 2048)], ids=["moba", "tokens"])
def test_bitwise_identical_across_thread_counts(threads, family, bs, K):
    """Splits from shapes, merged in split order: 1 and 2 threads agree bitwise (several splits per row)."""
    Nk = 8192
    sel = Selection(decode_indices((8,), 1, Nk, K, bs, "bottom_right"), bs)
    q, k, v, _ = make_inputs(1, 8, 2, 1, Nk, 32)
    plan = SelectionPlan(sel, Nk, causal_offset("bottom_right", 1, Nk))
    results = []
    for n in (1, 2, 1):
        threads(n)
        results.append(cpu.forward(q, k, v, plan, sm_scale=0.2, family_name=family))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [64, 4], ids=["bs64", "bs4"])
def test_strided_cache_views_equal_contiguous_copies(dtype, bs):
    """K/V as views of a [B, H, 4 Nk, D] cache and of a [B, N, H, D] one, NaN in every key no row may
    use: bitwise the contiguous copies' results (no key outside the selection is read)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 3, 1000, 32
    sel = Selection(decode_indices((Hq,), Nq, Nk, 6, bs, "bottom_right"), bs)
    q, k, v, _ = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype)
    used = selection_mask(sel, B, Hq, Nk, causal="bottom_right").any(2)       # [B, Hq, Nk]: keys some row uses
    used = used.reshape(B, Hkv, Hq // Hkv, Nk).any(2)[..., None]               # per kv head
    want = selection_attention(q, k, v, sel, causal="bottom_right", return_lse=True, backend="cpu")
    for pair in nan_cache_views(k, v, used):
        got = selection_attention(q, *pair, sel, causal="bottom_right", return_lse=True, backend="cpu")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_no_key_lists_and_work_buffers_independent_of_nk(threads, family):
    """The same selected blocks (same values) at the end of caches of 4096 and 65536 keys: bitwise the
    same results and work buffers, and the plan's key lists (O(key blocks)) never built."""
    threads(2)
    bs, K = 64, 8
    small = decode_indices((8,), 1, 4096, K, bs, "bottom_right")
    q = torch.randn(1, 8, 1, 32)
    tail_k, tail_v = (torch.randn(1, 2, 4096, 32) for _ in range(2))
    results, sizes = [], []
    for Nk in (4096, 65536):
        idx = torch.where(small >= 0, small + (Nk - 4096) // bs, -1)
        k, v = (torch.full((1, 2, Nk, 32), float("nan")) for _ in range(2))
        k[:, :, -4096:], v[:, :, -4096:] = tail_k, tail_v
        plan = SelectionPlan(Selection(idx, bs), Nk, causal_offset("bottom_right", 1, Nk))
        results.append(cpu.forward(q, k, v, plan, sm_scale=0.2, family_name=family))
        sizes.append(cpu.decode_work_bytes())
        assert plan._keys is None
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.isnan(results[0][0]).any()
    assert sizes[0] == sizes[1] and 0 < sizes[0] < 64 * 1024 * 4, sizes
