"""The Triton selection kernel families of issue 47 (``family_name=`` forces one on every case;
``"auto"`` picks by :func:`~sparse_io_attn.selection.tiles.kernel_family`): the key-major gathered
tiles (``"key"``: forward + merge, dK/dV with dQ partials + their merge) and the element-masked
tiles of consecutive keys (``"masked"``), each against the float64 reference with counted == predicted
bytes (exact integers) for the forward and the backward, on curated edge cases (ragged key ends, blocks
of several key tiles, blocks smaller than a tile, GQA with heads padding a unit, heads past a tile's rows,
bottom-right causality with Nq > Nk and empty rows, counts, batched and shared selections, strided
views); determinism; the dispatch. bf16 against a same-precision baseline and unselected keys never
read: ``test_triton_selection.py`` (every family). Interpreter cases stay tiny."""

import pytest
import torch

from helpers import check_close, check_repeatable, make_inputs
from selection.test_triton_selection import make_selection
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection import tiles
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference
from sparse_io_attn.selection.triton import launch

DEVICE = "cpu" if INTERPRET else "cuda"
FAMILIES = ("key", "masked")


def run_counted(q, k, v, do, sel, causal, family):
    """Forward + backward of ``family`` through the launcher, each counted: ``(outputs, fwd report,
    bwd report, plan)``."""
    plan = plan_selection(sel, k.shape[2], causal_offset=causal_offset(causal, q.shape[2], k.shape[2]))
    scale = q.shape[-1] ** -0.5
    with IOCounter() as fwd_io:
        out, lse, stats = launch.forward(q, k, v, plan, sm_scale=scale, decode=False, family_name=family)
    with IOCounter() as bwd_io:
        dq, dk, dv = launch.backward(do, q, k, v, out, stats, plan, sm_scale=scale, family_name=family)
    return (out, lse, dq, dk, dv), fwd_io.report, bwd_io.report, plan


CASES = [  # (B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts)
    pytest.param(1, 4, 2, 4, 40, 100, 16, 16, 3, True, False, False, id="moba-Ghq-bs16-ragged-top_left"),
    pytest.param(2, 4, 2, 2, 37, 90, 24, 32, 3, "bottom_right", False, True, id="nsa-Ghkv-bs32-batched-counts-D24"),
    pytest.param(1, 2, 1, 1, 20, 200, 16, 100, 2, False, True, False, id="bs100-key-tiles-ragged-shared"),
    pytest.param(1, 4, 1, 1, 20, 30, 16, 4, 5, True, True, False, id="dsa-G1-bs4-mqa"),
    pytest.param(1, 2, 2, 2, 26, 70, 16, 1, 9, True, False, False, id="tokens-bs1-mha"),
    pytest.param(1, 2, 1, 1, 30, 20, 16, 16, 2, "bottom_right", False, False, id="bottom_right-Nq>Nk-empty-rows"),
    pytest.param(1, 6, 2, 2, 24, 64, 16, 16, 3, True, False, False, id="R3-padded-unit"),
    pytest.param(1, 32, 1, 1, 6, 40, 16, 16, 2, True, True, False, id="R32-heads-past-the-rows"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts", CASES)
def test_family_matches_float64_and_counts_equal_the_model(B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared,
                                                           counts, family):
    sel = make_selection(B, G, Nq, Nk, block, K, shared=shared, counts=counts, empty_rows=(Nq // 2,))
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    got, fwd, bwd, plan = run_counted(q, k, v, do, sel, causal, family)
    check_close(got, selection_reference(q, k, v, sel, causal=causal, do=do))
    t = Nq // 2   # the emptied row: output 0, lse -inf, zero dq
    assert torch.isneginf(got[1][:, :, t]).all() and (got[0][:, :, t] == 0).all() and (got[2][:, :, t] == 0).all()
    args = (plan, B, Hq, Hkv, D, torch.float32)
    want_fwd = traffic.selection_forward(*args, decode=False, family_name=family)
    want_bwd = traffic.selection_backward(*args, family_name=family)
    assert fwd == want_fwd, f"{fwd.table()}\n{want_fwd.table()}"
    assert bwd == want_bwd, f"{bwd.table()}\n{want_bwd.table()}"
    assert all(name.startswith(("selection_" + family, "selection_bwd_preprocess")) for name in fwd.kernels | bwd.kernels)


@pytest.mark.parametrize("family", FAMILIES)
def test_strided_views_and_nothing_selected(family):
    """``[B, N, H, D]`` storage seen as ``[B, H, N, D]``; a selection with every slot empty gives zeros."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 21, 40, 16
    q, do = (torch.randn(B, Nq, Hq, D, device=DEVICE).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, Nk, Hkv, D, device=DEVICE).transpose(1, 2) for _ in range(2))
    sel = make_selection(B, 2, Nq, Nk, 16, 3)
    got, *_ = run_counted(q, k, v, do, sel, True, family)
    check_close(got, selection_reference(q, k, v, sel, causal=True, do=do))
    empty = Selection(torch.full((B, 2, Nq, 3), -1, device=DEVICE), 16)
    out, lse, dq, dk, dv = run_counted(q, k, v, do, empty, True, family)[0]
    assert torch.isneginf(lse).all()
    for x in (out, dq, dk, dv):
        assert not torch.isnan(x).any() and (x == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_is_deterministic(family):
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 30, 50, 16
    sel = make_selection(B, 2, Nq, Nk, 16, 3)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    check_repeatable(lambda: run_counted(q, k, v, do, sel, True, family)[0])


@pytest.mark.parametrize("block, G, Hq, Hkv, want", [
    (64, 16, 16, 4, "key"),       # MoBA: one selection per query head
    (64, 4, 16, 4, "key"),        # NSA: one per GQA group of 4
    (1, 1, 16, 4, "masked"),      # DSA with 4 heads per KV head and list
    (1, 1, 64, 1, "query"),       # DSA as FlashMLA runs it: 64 heads share one list
    (16, 1, 32, 2, "query"),      # 16 heads per list fill a query-major tile
    (8, 8, 8, 8, "masked"),
])
def test_auto_family_by_shape(block, G, Hq, Hkv, want):
    assert tiles.kernel_family(block, 8, G, 1, Hq, Hkv, G, 8192, 8192, 128, torch.bfloat16, "auto") == want


@pytest.mark.parametrize("block, G, Hq, Hkv", [(64, 16, 16, 4), (1, 1, 16, 4)], ids=["moba", "dsa-4-heads"])
def test_auto_family_is_query_major_for_wide_rows(block, G, Hq, Hkv):
    """MLA's 576 in bf16 (and 512 in fp32) are wide rows: the key-major and masked families' 64-key tiles
    exceed sm_90's shared memory there, so ``"auto"`` runs query-major; 512 in bf16 keeps the shape's family."""
    args = (block, 8, G, 1, Hq, Hkv, G, 8192, 8192)
    for head_dim, dtype in ((576, torch.bfloat16), (512, torch.float32)):
        assert tiles.kernel_family(*args, head_dim, dtype, "auto") == "query"
    assert tiles.kernel_family(*args, 512, torch.bfloat16, "auto") != "query"


def test_auto_family_falls_back_and_names_are_checked(monkeypatch):
    """Work buffers past ``MAX_WORK_BYTES`` send ``"auto"`` to the query-major family; an unknown name (or
    environment value) raises naming the choices."""
    args = (64, 8, 16, 1, 16, 4, 16, 1 << 20, 1 << 20, 128, torch.bfloat16)
    assert tiles.kernel_family(*args, "auto") == "query"
    assert tiles.kernel_family(*args, "key") == "key"
    with pytest.raises(ValueError, match="'auto' or one of"):
        tiles.kernel_family(*args, "fast")
    monkeypatch.setenv(tiles.FAMILY_ENV, "masked")
    assert tiles.kernel_family(*args) == "masked"
