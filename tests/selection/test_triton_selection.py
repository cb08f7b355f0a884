"""backend="triton" of selection_attention, through its launcher (``selection.triton.launch``) with a
``SelectionPlan``: forward and backward against the float64 reference for every selection shape
(G = 1, Hkv, Hq; blocks of 1, 4, 64 and sizes that do not divide the key step; ragged key ends;
repeats, empty slots, counts; causal top-left, bottom-right with Nq != Nk, none; GQA, MQA, MHA),
empty rows, strided views, determinism, unselected keys never read, bf16/fp16 against a
same-precision baseline. These cases have ``Nq <= 16``: the reference cases run both forwards
(``decode=False``: the prefill kernels of the family the launcher picks, ``True``), the others the
default (the decode kernels, ``test_decode_triton.py``); ``test_triton_families.py`` forces each family. Under the
interpreter (CPU) the cases stay tiny."""
import math

import pytest
import torch

from helpers import check_close, check_repeatable, check_within_baseline, make_inputs
from sparse_io_attn._attention.triton import launch as kit
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_mask, selection_reference
from sparse_io_attn.selection.triton import launch

DEVICE = "cpu" if INTERPRET else "cuda"  # the same tests run compiled where CUDA is in use


def make_selection(B, G, Nq, Nk, bs, K, *, shared=False, counts=False, empty_rows=()) -> Selection:
    """Random indices in ``[-1, nkb)`` (empty slots), slot 1 repeating slot 0, optional counts and
    rows emptied (every slot -1)."""
    nkb = math.ceil(Nk / bs)
    idx = torch.randint(-1, nkb, (G, Nq, K) if shared else (B, G, Nq, K), device=DEVICE)
    if K > 1:
        idx[..., 1] = idx[..., 0]
    for t in empty_rows:
        idx[..., t, :] = -1
    cnt = torch.randint(0, K + 1, idx.shape[:-1], device=DEVICE) if counts else None
    return Selection(idx, bs, cnt)


def run_triton(q, k, v, do, selection, causal, sm_scale=None, decode=None, family=None):
    """Forward + backward through the backend's launcher: ``(out, lse, dq, dk, dv)``. ``decode``: the
    launcher's choice of forward kernels (``None``: the decode kernels for ``Nq <= 16``); ``family``:
    the prefill forward's and the backward's kernel family (``None``: the launcher's choice)."""
    plan = plan_selection(selection, k.shape[2], causal_offset=causal_offset(causal, q.shape[2], k.shape[2]))
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out, lse, stats = launch.forward(q, k, v, plan, sm_scale=scale, decode=decode, family_name=family)
    dq, dk, dv = launch.backward(do, q, k, v, out, stats, plan, sm_scale=scale, family_name=family)
    return out, lse, dq, dk, dv


CASES = [  # (B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts)
    pytest.param(1, 4, 2, 1, 8, 24, 16, 1, 6, True, True, False, id="G1-bs1-tokens-top_left-shared"),
    pytest.param(2, 4, 2, 2, 9, 22, 24, 4, 3, False, False, False, id="Ghkv-bs4-ragged-batched"),
    pytest.param(1, 2, 1, 2, 7, 100, 16, 64, 2, "bottom_right", False, False, id="Ghq-bs64-ragged-bottom_right"),
    pytest.param(1, 2, 2, 2, 10, 16, 32, 4, 4, True, False, True, id="mha-Ghq-bs4-counts"),
    pytest.param(1, 4, 2, 4, 6, 40, 16, 16, 3, "bottom_right", True, False, id="gqa-Ghq-bs16-bottom_right"),
    pytest.param(1, 2, 1, 1, 12, 10, 16, 3, 4, True, False, True, id="bs3-lanes-top_left-Nq>Nk"),
    pytest.param(1, 2, 2, 2, 6, 150, 16, 48, 3, "bottom_right", False, False, id="bs48-3-steps-per-block"),
    pytest.param(1, 4, 1, 1, 5, 230, 16, 100, 2, False, True, False, id="bs100-ragged-steps-mqa"),
    pytest.param(1, 2, 1, 1, 14, 8, 16, 2, 3, "bottom_right", False, False, id="bottom_right-Nq>Nk-empty-rows"),
    pytest.param(1, 72, 1, 1, 3, 16, 16, 4, 2, True, True, False, id="72-heads-two-head-tiles"),
]


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts", CASES)
def test_matches_float64_reference(B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts, decode):
    sel = make_selection(B, G, Nq, Nk, block, K, shared=shared, counts=counts, empty_rows=(Nq // 2,))
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    got = run_triton(q, k, v, do, sel, causal, decode=decode)
    ref = selection_reference(q, k, v, sel, causal=causal, do=do)
    check_close(got, ref)
    # the emptied row (every selection): output 0, lse -inf, zero dq
    t = Nq // 2
    assert torch.isneginf(got[1][:, :, t]).all() and (got[0][:, :, t] == 0).all() and (got[2][:, :, t] == 0).all()


def test_nothing_selected_gives_zeros_and_no_nan():
    B, Hq, Hkv, N, D = 1, 4, 2, 12, 16
    sel = Selection(torch.full((B, 2, N, 3), -1, device=DEVICE), 4)
    q, k, v, do = make_inputs(B, Hq, Hkv, N, N, D, device=DEVICE)
    out, lse, dq, dk, dv = run_triton(q, k, v, do, sel, True)
    assert torch.isneginf(lse).all()
    for x in (out, dq, dk, dv):
        assert not torch.isnan(x).any() and (x == 0).all()


def test_strided_views():
    """q, k, v, do as ``[B, N, H, D]`` storage seen as ``[B, H, N, D]`` (non-contiguous)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 9, 20, 16
    sel = make_selection(B, 2, Nq, Nk, 4, 3)
    q, do = (torch.randn(B, Nq, Hq, D, device=DEVICE).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, Nk, Hkv, D, device=DEVICE).transpose(1, 2) for _ in range(2))
    assert not q.is_contiguous()
    check_close(run_triton(q, k, v, do, sel, True), selection_reference(q, k, v, sel, causal=True, do=do))


def test_a_new_selection_of_the_same_shapes_runs_from_the_cached_launches(monkeypatch):
    """After the first call of a shape the launches run from their cached form (the kit's
    ``run_calls``): a new selection of the same shapes, its own rows, exact against float64. The
    query-major family (the key-major and masked ones build their calls every time)."""
    from sparse_io_attn.selection.tiles import FAMILY_ENV
    monkeypatch.setenv(FAMILY_ENV, "query")
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 24, 40, 16       # Nq > 16: the prefill kernels
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    monkeypatch.setattr(kit, "_PREPARED", {})
    launched = []
    real = kit.Prepared.__call__
    monkeypatch.setattr(kit.Prepared, "__call__", lambda self, t: (launched.append(self.name), real(self, t)))
    for _ in range(2):
        sel = make_selection(B, 2, Nq, Nk, 4, 3)
        check_close(run_triton(q, k, v, do, sel, True), selection_reference(q, k, v, sel, causal=True, do=do))
    assert launched == ["selection_fwd", "selection_bwd_preprocess", "selection_bwd_dkdv", "selection_bwd_dq"]


def test_backward_is_deterministic():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 10, 24, 16
    sel = make_selection(B, 1, Nq, Nk, 1, 8)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    check_repeatable(lambda: run_triton(q, k, v, do, sel, True))


@pytest.mark.parametrize("family", [None, "query", "key", "masked"], ids=["decode", "query", "key", "masked"])
def test_unselected_keys_are_never_read(family):
    """NaN in k/v at keys no row selects reaches no output or gradient (every family: the masked one
    loads only the union of its tile's selected keys)."""
    B, Hq, Hkv, Nq, Nk, D, bs = 1, 2, 1, 8, 32, 16, 4
    idx = torch.randint(0, 4, (B, 1, Nq, 3), device=DEVICE)  # blocks 0..3: keys 0..15 only
    sel = Selection(idx, bs)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    k[:, :, 16:], v[:, :, 16:] = float("nan"), float("nan")
    out, lse, dq, dk, dv = run_triton(q, k, v, do, sel, False, decode=family is None, family=family)
    ref = selection_reference(q, k[:, :, :16], v[:, :, :16], sel, do=do)
    for x in (out, lse, dq, dk[:, :, :16], dv[:, :, :16]):
        assert not torch.isnan(x).any()
    check_close((out, lse, dq, dk[:, :, :16], dv[:, :, :16]), ref)


@pytest.mark.parametrize("family", [None, "query", "key", "masked"], ids=["decode", "query", "key", "masked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_vs_same_precision_baseline(dtype, family):
    """flash-attention's rule: error vs float64 at most 2x (outputs) / 3x (gradients) the error of
    plain PyTorch attention with the same element mask, run in the same dtype (the decode forward with
    the default backward, and each family's prefill forward and backward)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 12, 40, 32
    sel = make_selection(B, 2, Nq, Nk, 8, 3)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device=DEVICE)
    out, lse, dq, dk, dv = run_triton(q, k, v, do, sel, True, decode=family is None, family=family)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32
    ref = selection_reference(q, k, v, sel, causal=True, do=do)
    mask = selection_mask(sel, B, Hq, Nk, causal=True, device=q.device)
    check_within_baseline((out, lse, dq, dk, dv), ref, q, k, v, do, mask)


def test_launch_tiles_are_the_models_default():
    """Under the interpreter (no autotuning) the query-major launches use the tiles the traffic model
    assumes."""
    B, Hq, Hkv, N, D = 1, 4, 2, 6, 16
    sel = make_selection(B, 2, N, N, 4, 2)
    q, k, v, do = make_inputs(B, Hq, Hkv, N, N, D, device=DEVICE)
    run_triton(q, k, v, do, sel, False, decode=False, family="query")
    plan = plan_selection(sel, N)
    if INTERPRET:
        assert launch.launched_tiles() == launch.tiles_for(q, k, plan)


def test_public_function_with_backend_triton():
    """``selection_attention(..., backend="triton")``: autograd through the backend (once the op's
    torch path, which ``selection.api`` imports, is in place)."""
    pytest.importorskip("sparse_io_attn.selection.torch_path")
    from sparse_io_attn.selection.api import selection_attention

    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 8, 20, 16
    sel = make_selection(B, 2, Nq, Nk, 4, 3)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = selection_attention(qt, kt, vt, sel, causal="bottom_right", return_lse=True, backend="triton")
    out.backward(do)
    check_close((out.detach(), lse, qt.grad, kt.grad, vt.grad),
                selection_reference(q, k, v, sel, causal="bottom_right", do=do))
