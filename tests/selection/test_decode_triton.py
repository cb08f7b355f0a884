"""The Triton decode kernels of ``selection_attention`` (``Nq <= 16``: split-K over each token row's key
steps, merged in split order), through the backend's launcher: forward (out, lse) and the backward
run on the decode forward's outputs against the float64 reference for Nq in {1, 3, 16}, G in {1, Hkv,
Hq}, blocks of 1, 3, 4, 48 and 64 keys (key steps of several blocks, of one, several steps per block),
ragged Nk, empty slots and rows, counts, top-left and bottom-right causality, GQA/MQA and head
tiles past ``BLOCK_H``; one split and several (forced by small ``split_keys``). Bitwise repeatable;
K/V as strided views of a larger cache with NaN in every key no row selects equal the contiguous
copies, the plan's key lists never built; counted bytes equal the traffic model's (integers);
``decode=False`` runs the prefill kernel. (Separate from ``test_decode.py``, whose tests skip
without the C++ kernels.) Under the interpreter the cases stay small and run fp32."""
from __future__ import annotations

import pytest
import torch

from helpers import check_close, decode_indices, make_inputs, nan_cache_views
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_mask, selection_reference
from sparse_io_attn.selection.tiles import DECODE_SPLIT_KEYS, decode_config
from sparse_io_attn.selection.triton import launch

DEVICE = "cpu" if INTERPRET else "cuda"


def decode_selection(lead: tuple, Nq: int, Nk: int, K: int, bs: int, causal, *, counts=False, empty_rows=()):
    """A :class:`Selection` of ``[*lead, Nq, K]`` blocks: slot 0 the token's diagonal block, the others
    random (later ones dropped by causality), 15% empty slots, slot 2 repeating slot 1, rows emptied,
    optional counts."""
    idx = decode_indices(lead, Nq, Nk, K, bs, causal, empty_rows=empty_rows, device=DEVICE)
    cnt = torch.randint(0, K + 1, idx.shape[:-1], device=DEVICE) if counts else None
    return Selection(idx, bs, cnt)


def setup(B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts=False, empty_rows=()):
    sel = decode_selection((B, G), Nq, Nk, K, bs, causal, counts=counts, empty_rows=empty_rows)
    plan = plan_selection(sel, Nk, causal_offset=causal_offset(causal, Nq, Nk))
    return (sel, plan) + make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)


def splits(plan, q, k, split_keys=DECODE_SPLIT_KEYS) -> int:
    B, Hq, Nq, D = q.shape
    return decode_config(plan.block_size, plan.max_blocks, B, Hq, k.shape[1], plan.num_selections, Nq, D, q.dtype,
                         split_keys=split_keys).splits


CASES = [  # B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, empty_rows, split_keys, several splits
    pytest.param(1, 4, 2, 4, 1, 1000, 32, 64, 6, "bottom_right", False, (), 64, True, id="Nq1-moba-Ghq-bs64-split"),
    pytest.param(1, 4, 2, 4, 1, 1000, 32, 64, 6, "bottom_right", False, (), DECODE_SPLIT_KEYS, False,
                 id="Nq1-moba-Ghq-bs64-one-split"),
    pytest.param(2, 4, 2, 2, 3, 301, 16, 4, 12, "bottom_right", True, (1,), 16, True,
                 id="Nq3-nsa-Ghkv-bs4-counts-empty-row-ragged"),
    pytest.param(1, 4, 1, 1, 16, 150, 16, 1, 40, True, False, (5,), 8, True, id="Nq16-tokens-G1-mqa-top-left"),
    pytest.param(1, 2, 2, 2, 3, 200, 16, 48, 3, "bottom_right", False, (), 16, True,
                 id="Nq3-bs48-steps-per-block-ragged"),
    pytest.param(1, 2, 1, 1, 16, 100, 16, 3, 24, "bottom_right", True, (0, 15), 8, True,
                 id="Nq16-bs3-lanes-counts-empty-rows"),
    pytest.param(1, 36, 1, 1, 1, 120, 16, 4, 20, True, False, (), 16, True, id="Nq1-36-heads-two-head-tiles"),
]


@pytest.mark.parametrize("B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, empty_rows, split_keys, split", CASES)
def test_matches_float64_reference(B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, empty_rows, split_keys, split):
    """Decode forward (the default for ``Nq <= 16``) then the backward kernels on its outputs."""
    sel, plan, q, k, v, do = setup(B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, empty_rows)
    assert (splits(plan, q, k, split_keys) > 1) == split
    with IOCounter() as io:
        out, lse, stats = launch.forward(q, k, v, plan, sm_scale=D ** -0.5, split_keys=split_keys)
    assert set(io.report.kernels) == ({"selection_decode", "selection_decode_merge"} if split else {"selection_decode"})
    dq, dk, dv = launch.backward(do, q, k, v, out, stats, plan, sm_scale=D ** -0.5)
    check_close((out, lse, dq, dk, dv), selection_reference(q, k, v, sel, causal=causal, do=do), tol=2e-5)
    for t in empty_rows:
        assert torch.isneginf(lse[:, :, t]).all() and (out[:, :, t] == 0).all() and (dq[:, :, t] == 0).all()
    assert torch.isinf(stats[0]).eq(torch.isneginf(lse)).all()   # empty rows: +inf row maximum, as the forward


def test_decode_false_runs_the_prefill_kernel_and_agrees():
    sel, plan, q, k, v, _ = setup(1, 4, 2, 2, 3, 300, 16, 16, 6, "bottom_right")
    with IOCounter() as io:
        pre = launch.forward(q, k, v, plan, sm_scale=0.25, decode=False, family_name="query")
    assert set(io.report.kernels) == {"selection_fwd"}   # (the query-major kernel: the decode kernel's steps)
    dec = launch.forward(q, k, v, plan, sm_scale=0.25, split_keys=16)
    assert rel_err(dec[0], pre[0]) <= 1e-6 and rel_err(dec[1], pre[1]) <= 1e-6
    assert torch.equal(dec[2][0], pre[2][0])   # the same row maxima (split or not)


def test_bitwise_repeatable_with_splits():
    sel, plan, q, k, v, _ = setup(1, 8, 2, 2, 2, 2000, 32, 1, 200, "bottom_right")
    assert splits(plan, q, k, 32) > 4
    runs = [launch.forward(q, k, v, plan, sm_scale=0.2, split_keys=32) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("bs, K, split_keys", [(64, 5, 64), (4, 20, 8)], ids=["bs64", "bs4"])
def test_strided_cache_views_equal_contiguous_copies(bs, K, split_keys):
    """K/V as views of a [B, H, 4 Nk, D] cache and of a [B, N, H, D] one, NaN in every key no row
    selects: bitwise the contiguous copies' results; the plan's key lists (O(Nk)) never built."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 3, 700, 32
    sel, plan, q, k, v, _ = setup(B, Hq, Hkv, Hq, Nq, Nk, D, bs, K, "bottom_right")
    used = selection_mask(sel, B, Hq, Nk, causal="bottom_right", device=DEVICE).any(2)    # [B, Hq, Nk]
    used = used.reshape(B, Hkv, Hq // Hkv, Nk).any(2)[..., None]                          # per KV head
    assert splits(plan, q, k, split_keys) > 1
    want = launch.forward(q, k, v, plan, sm_scale=0.2, split_keys=split_keys)
    assert not torch.isnan(want[0]).any()
    for pair in nan_cache_views(k, v, used):
        assert not pair[0].is_contiguous()
        got = launch.forward(q, *pair, plan, sm_scale=0.2, split_keys=split_keys)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert plan._keys is None


TRAFFIC = [  # B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, split_keys
    pytest.param(2, 4, 2, 2, 3, 301, 16, 4, 12, "bottom_right", True, 16, id="Ghkv-bs4-counts-split"),
    pytest.param(1, 4, 2, 4, 1, 1000, 24, 64, 6, "bottom_right", False, 64, id="Ghq-bs64-padded-D-split"),
    pytest.param(1, 2, 1, 1, 16, 100, 16, 3, 24, True, False, 8, id="G1-bs3-lanes-top-left-split"),
    pytest.param(1, 2, 2, 2, 3, 230, 16, 100, 3, "bottom_right", False, 16, id="bs100-ragged-tiles-split"),
    pytest.param(1, 36, 1, 1, 2, 60, 16, 1, 20, True, True, DECODE_SPLIT_KEYS, id="36-heads-bs1-one-split"),
]


@pytest.mark.parametrize("B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, split_keys", TRAFFIC)
def test_counted_equals_predicted(B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts, split_keys):
    _, plan, q, k, v, _ = setup(B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, counts)
    with IOCounter() as io:
        launch.forward(q, k, v, plan, sm_scale=D ** -0.5, split_keys=split_keys)
    want = traffic.selection_decode_forward(plan, B, Hq, Hkv, D, torch.float32, split_keys=split_keys)
    assert io.report == want, f"{io.report}\n{want}"
    assert ("selection_decode_merge" in want.kernels) == (split_keys != DECODE_SPLIT_KEYS)
    if split_keys == DECODE_SPLIT_KEYS:   # the default split: what selection_forward predicts for Nq <= 16
        assert want == traffic.selection_forward(plan, B, Hq, Hkv, D, torch.float32)


def test_bad_split_keys():
    _, plan, q, k, v, _ = setup(1, 2, 1, 1, 1, 40, 16, 4, 3, "bottom_right")
    with pytest.raises(ValueError, match="split_keys"):
        launch.forward(q, k, v, plan, sm_scale=0.25, split_keys=0)


@pytest.mark.parametrize("Nq, kernels", [(16, {"selection_decode"}), (17, {"selection_key_fwd", "selection_key_merge"})])
def test_decode_is_the_default_up_to_16_queries(Nq, kernels):
    """``decode=None``: the decode kernels for ``Nq <= 16``, the prefill family's above (here key-major:
    blocks of 16, one head per selection), launcher and traffic model alike."""
    _, plan, q, k, v, _ = setup(1, 2, 1, 1, Nq, 64, 16, 16, 2, "bottom_right")
    with IOCounter() as io:
        launch.forward(q, k, v, plan, sm_scale=0.25)
    assert set(io.report.kernels) == kernels
    assert io.report == traffic.selection_forward(plan, 1, 2, 1, 16, torch.float32)
