"""Every check of ``selection_attention`` (``selection.api.prepare``) and of ``Selection`` refuses a bad
input with ``ValueError``/``TypeError`` naming what was expected and what was got, before any
backend runs; ``check=False`` trusts the indices and treats out-of-range entries as empty slots."""
import pytest
import torch

from helpers import check_close, make_inputs
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference

from .test_correctness import SELECTION_BACKENDS, device_of, run_selection

B, HQ, HKV, NQ, NK, D, BS, K = 2, 4, 2, 12, 20, 8, 4, 3      # 5 key blocks


def _qkv(**shape):
    """``q, k, v`` of the default shapes; ``shape`` overrides ``q``/``k``/``v`` by a tensor."""
    q, k, v, _ = make_inputs(B, HQ, HKV, NQ, NK, D)
    return shape.get("q", q), shape.get("k", k), shape.get("v", v)


def _idx(*lead, high=5, nq=NQ, k=K):
    return torch.randint(-1, high, (*lead, nq, k))


def _call(*, indices=None, block_size=BS, **kwargs):
    """``selection_attention`` with valid defaults; keyword ``q``/``k``/``v`` replace an input."""
    q, k, v = _qkv(**{n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    return selection_attention(q, k, v, _idx(HKV) if indices is None else indices, block_size=block_size, **kwargs)


META = dict(device="meta")
BAD_CALLS = [  # (call, exception, message)
    pytest.param(lambda: _call(q=[1.0]), TypeError, r"q must be a torch.Tensor, got list", id="q-not-a-tensor"),
    pytest.param(lambda: _call(q=torch.randn(HQ, NQ, D)), ValueError, r"q must have shape \[batch, heads, seqlen, "
                 r"head_dim\], got \(4, 12, 8\)", id="q-3d"),
    pytest.param(lambda: _call(q=torch.randn(B, HQ, NQ, D, dtype=torch.float64), k=torch.randn(B, HKV, NK, D).double(),
                               v=torch.randn(B, HKV, NK, D).double()), TypeError,
                 r"dtype torch.float64; supported: float32, float16, bfloat16", id="float64"),
    pytest.param(lambda: _call(k=torch.randn(B, HKV, NK, D).half()), TypeError, r"must share a dtype",
                 id="mixed-dtypes"),
    pytest.param(lambda: _call(k=torch.randn(B, HKV, NK, D, **META)), ValueError, r"one device, got cpu, meta",
                 id="k-on-another-device"),
    pytest.param(lambda: _call(v=torch.randn(B, HKV, NK + 1, D)), ValueError,
                 r"k and v must have the same shape but for v's head dim, got \(2, 2, 20, 8\) and \(2, 2, 21, 8\)",
                 id="k-v-shapes"),
    pytest.param(lambda: _call(k=torch.randn(1, HKV, NK, D), v=torch.randn(1, HKV, NK, D)), ValueError,
                 r"q has batch 2 and k has batch 1", id="q-k-batch"),
    pytest.param(lambda: _call(k=torch.randn(B, HKV, NK, 4), v=torch.randn(B, HKV, NK, 4)), ValueError,
                 r"q has head_dim 8 and k has 4", id="head-dim"),
    pytest.param(lambda: _call(k=torch.randn(B, 3, NK, D), v=torch.randn(B, 3, NK, D)), ValueError,
                 r"q has 4 heads and k has 3; num_heads_q must be a multiple of num_heads_kv", id="Hq-not-multiple"),
    pytest.param(lambda: _call(q=torch.randn(0, HQ, NQ, D), k=torch.randn(0, HKV, NK, D), v=torch.randn(0, HKV, NK, D),
                               indices=_idx(0, HKV)), ValueError,
                 r"q has batch 0 \(shape \(0, 4, 12, 8\)\); attention needs at least one batch element", id="batch-0"),
    pytest.param(lambda: _call(q=torch.randn(B, HQ, NQ, 0), k=torch.randn(B, HKV, NK, 0), v=torch.randn(B, HKV, NK, 0)),
                 ValueError, r"q has head_dim 0 .*at least one batch element, query head and head-dim channel",
                 id="head-dim-0"),
    pytest.param(lambda: _call(q=torch.randn(B, HQ, NQ, D).to_sparse()), TypeError,
                 r"q has layout torch.sparse_coo; attention takes dense \(strided\) tensors", id="sparse-q"),
    pytest.param(lambda: _call(indices=torch.zeros(HKV, NQ, K)), TypeError,
                 r"indices must be an int32 or int64 tensor, got torch.float32", id="float-indices"),
    pytest.param(lambda: _call(indices=[[0]]), TypeError, r"indices must be an int32 or int64 tensor, got list",
                 id="list-indices"),
    pytest.param(lambda: _call(indices=torch.zeros(NQ, K, dtype=torch.int64)), ValueError,
                 r"indices must have shape \[B, G, Nq, K\] or \[G, Nq, K\].*got \(12, 3\)", id="indices-2d"),
    pytest.param(lambda: _call(indices=torch.zeros(1, 1, 1, NQ, K, dtype=torch.int64)), ValueError,
                 r"indices must have shape \[B, G, Nq, K\] or \[G, Nq, K\].*got \(1, 1, 1, 12, 3\)", id="indices-5d"),
    pytest.param(lambda: _call(indices=torch.zeros(0, NQ, K, dtype=torch.int64)), ValueError,
                 r"G = 0 selections", id="G-zero"),
    pytest.param(lambda: _call(block_size=None), TypeError, r"needs block_size= with an index tensor",
                 id="block-size-missing"),
    pytest.param(lambda: _call(block_size=0), ValueError, r"block_size must be a positive int .* got 0",
                 id="block-size-0"),
    pytest.param(lambda: _call(block_size=-4), ValueError, r"block_size must be a positive int .* got -4",
                 id="block-size-negative"),
    pytest.param(lambda: _call(block_size=4.0), ValueError, r"block_size must be a positive int .* got 4.0",
                 id="block-size-float"),
    pytest.param(lambda: _call(block_size=True), ValueError, r"block_size must be a positive int .* got True",
                 id="block-size-bool"),
    pytest.param(lambda: _call(indices=Selection(_idx(HKV), BS), block_size=8), ValueError,
                 r"the Selection has block_size 4 but block_size=8 was passed", id="selection-and-block-size"),
    pytest.param(lambda: _call(indices=Selection(_idx(HKV), BS), block_size=None,
                               counts=torch.ones(HKV, NQ, dtype=torch.int64)), ValueError,
                 r"the Selection carries its counts", id="selection-and-counts"),
    pytest.param(lambda: _call(counts=torch.ones(HKV, NQ + 1, dtype=torch.int64)), ValueError,
                 r"counts must have shape \(2, 12\) .* got \(2, 13\)", id="counts-shape"),
    pytest.param(lambda: _call(counts=torch.ones(HKV, NQ)), TypeError,
                 r"counts must be an int32 or int64 tensor, got torch.float32", id="counts-dtype"),
    pytest.param(lambda: _call(counts=torch.ones(HKV, NQ, dtype=torch.int64, **META)), ValueError,
                 r"counts is on meta but indices on cpu", id="counts-device"),
    pytest.param(lambda: _call(indices=_idx(HKV, nq=NQ - 1)), ValueError,
                 r"indices have 11 query rows but q has 12 tokens", id="Nq-mismatch"),
    pytest.param(lambda: _call(indices=torch.zeros(HKV, NQ, K, dtype=torch.int64, **META)), ValueError,
                 r"indices are on meta but q on cpu", id="indices-device"),
    pytest.param(lambda: _call(indices=torch.full((HKV, NQ, K), 5)), ValueError,
                 r"indices holds key block 5 but seqlen_k 20 with block_size 4 has 5 key blocks \(0..4",
                 id="entry-out-of-range"),
    pytest.param(lambda: _call(counts=torch.full((HKV, NQ), -1)), ValueError,
                 r"counts must lie in \[0, 3\] .* got values in \[-1, -1\]", id="counts-negative"),
    pytest.param(lambda: _call(counts=torch.full((HKV, NQ), K + 1)), ValueError,
                 r"counts must lie in \[0, 3\] .* got values in \[4, 4\]", id="counts-above-K"),
    pytest.param(lambda: _call(indices=_idx(3, HKV)), ValueError,
                 r"the selection was made for batch 3 but the inputs have batch 2", id="batch-mismatch"),
    pytest.param(lambda: _call(indices=_idx(3)), ValueError,
                 r"G = 3 selections but q has 4 heads; G must divide num_heads_q", id="G-not-dividing-Hq"),
    pytest.param(lambda: _call(q=torch.randn(B, 6, NQ, D), indices=_idx(3)), ValueError,
                 r"G = 3 selections and k/v 2 heads: each selection must serve whole GQA groups",
                 id="G-incompatible-with-Hkv"),
    pytest.param(lambda: _call(causal="bottom-right"), ValueError,
                 r"causal must be one of \(False, True, 'top_left', 'bottom_right'\), got 'bottom-right'",
                 id="causal-value"),
    pytest.param(lambda: _call(sm_scale=float("nan")), ValueError, r"sm_scale must be a finite number, got nan",
                 id="sm-scale-nan"),
    pytest.param(lambda: _call(sm_scale=float("inf")), ValueError, r"sm_scale must be a finite number, got inf",
                 id="sm-scale-inf"),
    pytest.param(lambda: _call(sm_scale="0.3"), TypeError, r"sm_scale must be a real number .* got str",
                 id="sm-scale-string"),
    pytest.param(lambda: _call(backend="cuda"), ValueError, r"backend must be one of .* got 'cuda'", id="backend"),
    pytest.param(lambda: _call(indices=plan_selection(Selection(_idx(HKV), BS), NK + 4), block_size=None),
                 ValueError, r"the plan was built for seqlen \(12, 24\) with causal offset None but the call has "
                 r"\(12, 20\)", id="plan-other-seqlen"),
    pytest.param(lambda: _call(indices=plan_selection(Selection(_idx(HKV), BS), NK), block_size=None, causal=True),
                 ValueError, r"causal offset None but the call has \(12, 20\) and causal=True \(offset 0\)",
                 id="plan-other-causal"),
    pytest.param(lambda: _call(indices=plan_selection(Selection(_idx(HKV).to("meta"), BS), NK), block_size=None),
                 ValueError, r"the plan is on meta but q on cpu", id="plan-device"),
]


@pytest.mark.parametrize("call,exc,match", BAD_CALLS)
def test_bad_input_raises_a_clear_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_checked_selection_refuses_what_check_reads():
    """``Selection.check`` is what a checked call runs: entries past the key blocks, counts outside
    ``[0, K]``; entries below ``-1`` are empty slots, not errors."""
    Selection(torch.full((1, 4, 2), -7), 4).check(seqlen_k=8)
    with pytest.raises(ValueError, match=r"key block 2 but seqlen_k 8 with block_size 4 has 2 key blocks"):
        Selection(torch.full((1, 4, 2), 2), 4).check(seqlen_k=8)
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 2\]"):
        Selection(torch.zeros(1, 4, 2, dtype=torch.int32), 4, torch.full((1, 4), 3, dtype=torch.int32)).check(8)


@pytest.mark.parametrize("backend", SELECTION_BACKENDS)
def test_unchecked_out_of_range_entries_are_empty_slots(backend):
    """``check=False``: entries ``>= ceil(Nk / block_size)`` and counts outside ``[0, K]`` are trusted,
    never read past the tensors, and count as the reference with those entries set to -1 (counts
    clamped to ``[0, K]``)."""
    dev = device_of(backend)
    idx = torch.randint(-1, 5, (B, HKV, NQ, K), device=dev)
    idx[..., 0] = torch.where(torch.rand(B, HKV, NQ, device=dev) < 0.5, 5 + torch.arange(NQ, device=dev) * 1000, 0)
    counts = torch.randint(-2, K + 3, (B, HKV, NQ), device=dev)
    q, k, v, do = make_inputs(B, HQ, HKV, NQ, NK, D, device=dev)
    got = run_selection(q, k, v, do, idx, block_size=BS, counts=counts, backend=backend, causal=True, check=False)
    want = Selection(torch.where(idx >= 5, -1, idx), BS, counts.clamp(0, K))
    check_close(got, selection_reference(q, k, v, want, causal=True, do=do))
