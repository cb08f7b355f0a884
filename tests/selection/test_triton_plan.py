"""The device plan builders of the Triton selection families (``selection.triton.launch_plan``, what the
backend runs on CUDA): element for element the torch builders' key-major lists, work tiles and masked
tiles (run here under the interpreter on tiny plans: blocks of 16 and single tokens, causal top-left,
bottom-right and none, empty slots, repeats), in a fixed, small number of launches whose host side reads
nothing back from the device (no host synchronisation: capturable in a CUDA graph)."""
import math

import pytest
import torch

from helpers import no_host_sync
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import key_lists, plan_selection
from sparse_io_attn.selection.triton import launch_plan
from sparse_io_attn.selection.varlen import varlen_of
from sparse_io_attn.selection.worklists import key_work, masked_tiles

DEVICE = "cpu" if INTERPRET else "cuda"

CASES = [  # (L, Nq, Nk, block, K, causal offset)
    pytest.param(2, 40, 70, 16, 3, 0, id="bs16-top_left"),
    pytest.param(1, 70, 50, 1, 6, None, id="tokens-no-causal-two-chunks"),
    pytest.param(2, 20, 90, 4, 4, 70, id="bs4-bottom_right"),
]


def _plan(L, Nq, Nk, bs, K, delta):
    idx = torch.randint(-1, math.ceil(Nk / bs), (L, Nq, K), device=DEVICE)
    idx[..., 1] = idx[..., 0]
    return plan_selection(Selection(idx, bs), Nk, causal_offset=delta)


@pytest.mark.parametrize("L, Nq, Nk, bs, K, delta", CASES)
def test_device_builders_equal_the_torch_builders(L, Nq, Nk, bs, K, delta):
    plan = _plan(L, Nq, Nk, bs, K, delta)
    ref = key_lists(plan.rows, plan.num_kv_blocks)
    n = int(ref.col_ptr[-1, -1])
    work = launch_plan.device_key_work(plan, 8)                 # builds the lists too: the plan's keys
    got = plan.keys()
    assert torch.equal(got.col_ptr, ref.col_ptr)
    assert torch.equal(got.col_query[:n], ref.col_query[:n]) and torch.equal(got.col_slot[:n], ref.col_slot[:n])
    assert torch.equal(work.work, key_work(ref, L, plan.num_kv_blocks, L * Nq * K, 8).work)
    want = masked_tiles(plan.rows, bs, Nk, delta, 16, 64)
    have = launch_plan.device_masked_tiles(plan, 16, 64)
    for name in ("bits", "union", "col_union", "row_tiles", "row_counts", "col_tiles", "col_counts"):
        assert torch.equal(getattr(have, name), getattr(want, name)), name


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_device_builders_of_a_packed_plan(causal):
    """A plan of packed sequences (``cu_seqlens``: a block table, global block ids, ``capacity`` blocks):
    the device builders' masked tiles read the table's keys and row offsets, their key-major lists the
    global ids; equal to the torch builders'."""
    lens_q, lens_k, bs = [13, 0, 22], [20, 7, 30], 4
    cu = tuple(torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], device=DEVICE) for n in (lens_q, lens_k))
    Nq, Nk = sum(lens_q), sum(lens_k)
    vl = varlen_of(cu, Nq, Nk, causal, torch.device(DEVICE))
    nb = torch.tensor([math.ceil(n / bs) for n in lens_k])[torch.searchsorted(cu[0][1:].cpu(), torch.arange(Nq),
                                                                              right=True)]
    idx = (torch.rand(2, Nq, 4) * nb[:, None]).long().to(DEVICE)
    plan = plan_selection(Selection(idx, bs), Nk, causal_offset=None if causal is None else 0, varlen=vl)
    ref = key_lists(plan.rows, plan.num_kv_blocks)
    n = int(ref.col_ptr[-1, -1])
    launch_plan.device_key_work(plan, 8)
    got = plan.keys()
    assert torch.equal(got.col_ptr, ref.col_ptr) and torch.equal(got.col_query[:n], ref.col_query[:n])
    want = masked_tiles(plan.rows, bs, Nk, plan.causal_offset, 16, 64, plan.table)
    have = launch_plan.device_masked_tiles(plan, 16, 64)
    for name in ("bits", "union", "col_union", "row_tiles", "row_counts", "col_tiles", "col_counts"):
        assert torch.equal(getattr(have, name), getattr(want, name)), name
    assert int(want.bits.ne(0).sum()) > 0


def test_few_launches_and_no_host_read(monkeypatch):
    """The host side only allocates and launches: 4 kernels for the key-major lists and work (count, scan,
    fill, work), 2 for the masked tiles (bits, lists), each with a grid from the shapes, and no operation
    that reads the device (checked with the launches recorded, not run)."""
    plan = _plan(2, 40, 70, 16, 3, 0)
    launched = []
    monkeypatch.setattr(launch_plan, "_run", lambda calls: launched.append([c.name for c in calls]))
    with no_host_sync():
        launch_plan.device_key_work(plan, 8)
        launch_plan.device_masked_tiles(plan, 16, 64)
    assert launched == [["selection_plan_key_count", "selection_plan_key_scan", "selection_plan_key_fill",
                         "selection_plan_key_work"], ["selection_plan_masked_bits", "selection_plan_masked_lists"]]
