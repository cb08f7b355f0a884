"""Layouts chosen from data (``from_kv_indices``, ``patterns.topk``) through every backend against the
float64 reference with the same element mask, caches that follow in-place edits of a layout's
tensors on every backend, and copies of a plan (``pickle``, ``copy.copy``, ``copy.deepcopy``): a plan
of its own, with the same packed index, running to the same output as the original on the cpu and
torch backends; stale exactly when the original was."""
import copy
import math
import pickle

import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns, plan
from sparse_io_attn.block_sparse.plan import PLAN_ATTR
from sparse_io_attn.block_sparse.reference import attention_reference

from helpers import BACKENDS, check_close, make_inputs, run, skip_cpu_backend_if_unbuilt


@pytest.fixture(autouse=True)
def _cpu_kernel_present(request):
    skip_cpu_backend_if_unbuilt(request)


def _check(backend, layout, B, Hq, Hkv, D, causal):
    Nq, Nk = layout.seqlen
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    check_close(run(q, k, v, do, layout, causal, backend=backend),
                attention_reference(q, k, v, layout, causal=causal, do=do))


# (B, Hq, Hkv, Nq, Nk, block, lead of the selection, causal)
CASES = [
    pytest.param(2, 2, 2, 100, 100, 16, (2, 2), True, id="per-batch-head-causal-ragged"),
    pytest.param(1, 4, 2, 96, 96, 16, (1, 2), True, id="per-kv-head-gqa-causal"),
    pytest.param(2, 4, 1, 80, 120, 16, (2, 1), "bottom_right", id="per-kv-head-mqa-bottom-right"),
    pytest.param(1, 2, 2, 120, 80, (16, 32), (2,), False, id="per-head-rect-blocks"),
    pytest.param(1, 2, 2, 64, 64, 16, (), "top_left", id="shared"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, Hq, Hkv, Nq, Nk, block, lead, causal", CASES)
def test_kv_indices_layouts(backend, B, Hq, Hkv, Nq, Nk, block, lead, causal):
    torch.manual_seed(Nq + Nk + len(lead))
    bq, bk = (block, block) if isinstance(block, int) else block
    nqb, nkb = math.ceil(Nq / bq), math.ceil(Nk / bk)
    idx = torch.randint(-2, nkb, (*lead, nqb, 4))     # repeated and padded slots
    idx[..., 1, :] = -1                                 # an empty row
    layout = BlockSparseLayout.from_kv_indices(idx, block, (Nq, Nk))
    _check(backend, layout, B, Hq, Hkv, 32, causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, "bottom_right", False])
def test_topk_layouts(backend, causal):
    torch.manual_seed(3)
    B, Hq, Hkv, Nq, Nk, block = 1, 4, 2, 112, 144, 16
    scores = torch.randn(B, Hkv, math.ceil(Nq / block), math.ceil(Nk / block))
    layout = patterns.topk(scores, 3, block, (Nq, Nk), causal=causal)
    _check(backend, layout, B, Hq, Hkv, 16, causal)


def _edit_cases():
    """(layout, edit) pairs: an element-exact layout whose masks are edited, and a fixed-capacity one
    whose buffers receive another selection (how a per-step selection or a CUDA graph reuses them)."""
    torch.manual_seed(0)
    dense = torch.rand(2, 96, 96) < 0.4
    exact = BlockSparseLayout.from_dense_mask(dense, 32)

    def flip_masks(layout):
        layout.partial_masks.bitwise_not_()

    nkb = 3
    dynamic = BlockSparseLayout.from_kv_indices(torch.randint(-1, nkb, (2, 3, 2)), 32, 96)
    other = BlockSparseLayout.from_kv_indices(torch.randint(-1, nkb, (2, 3, 2)), 32, 96)

    def refill(layout):
        layout.crow_indices.copy_(other.crow_indices)
        layout.col_slots.copy_(other.col_slots)
    return [(exact, flip_masks), (dynamic, refill)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", [0, 1], ids=["partial-masks-edited", "selection-buffers-refilled"])
def test_in_place_edits_rebuild_every_cache(backend, which):
    layout, edit = _edit_cases()[which]
    q, k, v, do = make_inputs(1, 2, 2, 96, 96, 16)
    check_close(run(q, k, v, do, layout, True, backend=backend),
                attention_reference(q, k, v, layout, causal=True, do=do))
    before = layout.to_dense_mask().clone()
    edit(layout)
    assert not torch.equal(before, layout.to_dense_mask())
    check_close(run(q, k, v, do, layout, True, backend=backend),
                attention_reference(q, k, v, layout, causal=True, do=do))


def test_writes_that_bypass_version_counters_need_mark_edited():
    """A refill through ``.numpy()`` is invisible to the version counters: the cached plan serves the
    old blocks until ``layout.mark_edited()``, after which every backend sees the new ones (and a
    plan held from before the edit is refused as stale)."""
    nkb = 3
    layout = BlockSparseLayout.from_kv_indices(torch.randint(-1, nkb, (2, 3, 2)), 32, 96)
    other = BlockSparseLayout.from_kv_indices(torch.randint(-1, nkb, (2, 3, 2)), 32, 96)
    q, k, v, do = make_inputs(1, 2, 2, 96, 96, 16)
    held = plan(layout, causal=True)
    check_close(run(q, k, v, do, layout, True, backend="cpu"), attention_reference(q, k, v, layout, causal=True, do=do))
    layout.crow_indices.numpy()[:] = other.crow_indices.numpy()
    layout.col_slots.numpy()[:] = other.col_slots.numpy()
    layout.mark_edited()
    assert layout.to_dense_mask().equal(other.to_dense_mask())
    for backend in BACKENDS:
        check_close(run(q, k, v, do, layout, True, backend=backend),
                    attention_reference(q, k, v, other, causal=True, do=do))
    with pytest.raises(ValueError, match="edited in place after the plan was built"):
        block_sparse_attention(q, k, v, held, causal=True)


COPIES = {"pickle": lambda p: pickle.loads(pickle.dumps(p)), "deepcopy": copy.deepcopy, "copy": copy.copy}


def _layouts():
    """(layout, causal, Hq, Hkv): partial blocks under a causal diagonal; one mask per KV head."""
    window = patterns.sliding_window(70, 16, window=20)
    pooled = patterns.topk(torch.randn(1, 2, 4, 4), 2, 16, 64, causal=True)    # one mask per KV head
    return {"window-causal": (window, True, 2, 2), "per-kv-head-gqa": (pooled, True, 4, 2),
            "bottom-right": (window.rows(38, 70), "bottom_right", 2, 1)}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("which", ["window-causal", "per-kv-head-gqa", "bottom-right"])
def test_a_copied_plan_runs_as_the_original(backend, how, which):
    layout, causal, Hq, Hkv = _layouts()[which]
    held = plan(layout, causal=causal, num_heads_q=Hq, num_heads_kv=Hkv)
    q, k, v, do = make_inputs(1, Hq, Hkv, *layout.seqlen, 8)
    want = run(q, k, v, do, held, causal, backend=backend)            # forward and backward
    copied = COPIES[how](held)
    assert copied is not held and torch.equal(copied.index, held.index) and copied.meta == held.meta
    assert copied.causal == held.causal and not copied.is_stale()
    assert getattr(copied.index, PLAN_ATTR)() is copied            # registered: the op finds the copy
    if how != "copy":
        assert copied.index.data_ptr() != held.index.data_ptr()    # its own tensors
    for got, ref in zip(run(q, k, v, do, copied, causal, backend=backend), want):
        assert torch.equal(got, ref)
    check_close(want, attention_reference(q, k, v, layout, causal=causal, do=do))


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copies_follow_their_own_layout_and_a_stale_plan_stays_stale(how):
    layout = BlockSparseLayout.from_kv_indices(torch.tensor([[0, -1], [0, 1], [1, 2]]), 16, 48)
    held = plan(layout, causal=True)
    copied = COPIES[how](held)
    q, k, v, _ = make_inputs(1, 2, 2, 48, 48, 8)
    want = block_sparse_attention(q, k, v, held, causal=True, backend="torch")
    layout.col_slots[0] = 2                                           # the original's layout edited in place
    assert held.is_stale() and not copied.is_stale()                  # the copy holds the layout as it was
    assert torch.equal(block_sparse_attention(q, k, v, copied, causal=True, backend="torch"), want)
    stale = COPIES[how](held)
    assert stale.is_stale()
    for p in (held, stale):
        with pytest.raises(ValueError, match="edited in place after the plan was built"):
            block_sparse_attention(q, k, v, p, causal=True, backend="torch")
