"""What is particular to the ``torch`` backend of ``selection_attention``: its two shapes of work
(query-major rows, key-major tiles: each run on the whole correctness matrix), chunks and tile windows
that span units and selections, the sort-and-segment dK/dV sum (the path of CUDA and other devices,
run here on CPU), and no host synchronisation from the plan to the gradients."""
import pytest
import torch

from helpers import check_close, make_inputs, no_host_sync
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import torch_path
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference

from . import test_correctness as matrix
from .test_correctness import random_indices, run_selection

PATHS = {"query-major": 10 ** 9, "key-major": 1}     # KEY_MAJOR_MIN_BLOCK forcing each path


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    monkeypatch.setattr(torch_path, "KEY_MAJOR_MIN_BLOCK", PATHS[request.param])
    return request.param


@pytest.fixture(params=["auto", True], ids=["index_add", "sort-segment"])
def dk_sum(request, monkeypatch):
    """Both ways of summing dK/dV: ``index_add_`` (CPU) and sort + segment_reduce (other devices)."""
    monkeypatch.setattr(torch_path, "DETERMINISTIC_SUM", request.param)
    return request.param


@pytest.mark.parametrize("B,Hq,Hkv,G,Nq,Nk,D,bs,K,causal,opts", matrix.CASES)
def test_matrix_on_the_other_path(monkeypatch, B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, opts):
    """The correctness matrix with each case on the path its block size does not choose."""
    other = PATHS["query-major" if bs >= torch_path.KEY_MAJOR_MIN_BLOCK else "key-major"]
    monkeypatch.setattr(torch_path, "KEY_MAJOR_MIN_BLOCK", other)
    matrix.test_matches_float64_reference("torch", B, Hq, Hkv, G, Nq, Nk, D, bs, K, causal, opts)


@pytest.mark.parametrize("budget", [3, 7, 10 ** 9], ids=["budget-3-rows", "budget-7-rows", "one-chunk"])
def test_chunks_spanning_units_and_selections(path, dk_sum, budget, monkeypatch):
    """Work budgets of 3 and 7 query rows (query-major chunks straddling units, selections and GQA
    groups: Nq = 10; key-major windows of one item, groups of a few selections) and of everything:
    each matches the reference and repeats bitwise."""
    B, Hq, Hkv, G, Nq, Nk, D, bs, K = 2, 4, 2, 4, 10, 37, 16, 4, 5
    per_row = 2 * (Hq // G) * K * bs + 4 * K * bs * D + 4 * (Hq // G) * D
    monkeypatch.setitem(torch_path.CHUNK_ELEMENTS, "cpu", per_row * budget)
    idx = random_indices((B, G), Nq, Nk, K, bs, causal="bottom_right")
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run_selection(q, k, v, do, idx, block_size=bs, backend="torch", causal="bottom_right")
    check_close(got, selection_reference(q, k, v, Selection(idx, bs), causal="bottom_right", do=do))
    again = run_selection(q, k, v, do, idx, block_size=bs, backend="torch", causal="bottom_right")
    for a, b in zip(got, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("B,G,Hkv", [(1, 4, 2), (3, 1, 2)], ids=["per-head", "shared-by-batch-and-heads"])
def test_key_major_groups_of_token_ranges(dk_sum, B, G, Hkv, monkeypatch):
    """A budget below one selection's slot partials: key-major groups of 3 (or 1) tokens of one
    selection, each with its own tiles (a block's token list cut at the range ends)."""
    Hq, Nq, Nk, D, bs, K = 4, 10, 50, 8, 16, 3
    Gu = min(Hq // G, Hq // Hkv)
    monkeypatch.setitem(torch_path.CHUNK_ELEMENTS, "cpu", 3 * B * K * Gu * (D + 2))
    idx = random_indices((G,), Nq, Nk, K, bs, causal=True)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run_selection(q, k, v, do, idx, block_size=bs, backend="torch", causal=True)
    check_close(got, selection_reference(q, k, v, Selection(idx, bs), causal=True, do=do))


@pytest.mark.parametrize("G", [1, 2, 4])
def test_forward_and_backward_never_synchronise(path, dk_sum, G):
    """Plan, forward and backward: tensor operations sized by the shapes only (``check=False``)."""
    B, Hq, Hkv, Nq, Nk, D, bs, K = 1, 4, 2, 12, 30, 16, 4, 3
    idx = random_indices((G,), Nq, Nk, K, bs, causal=True)
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with no_host_sync():
        plan = plan_selection(Selection(idx, bs), Nk, causal_offset=causal_offset(True, Nq, Nk))
        out, lse, stats = torch_path.forward(q.detach(), k.detach(), v.detach(), plan, sm_scale=0.25)
        dq, dk, dv = torch_path.backward(do, q.detach(), k.detach(), v.detach(), out, stats, plan, sm_scale=0.25)
        api_out = selection_attention(q, k, v, idx, block_size=bs, causal=True, sm_scale=0.25, backend="torch",
                                      check=False)
    check_close((out, lse, dq, dk, dv),
                selection_reference(q, k, v, Selection(idx, bs), causal=True, sm_scale=0.25, do=do))
    assert torch.equal(api_out, out)


def test_segment_sum_matches_index_add(monkeypatch):
    """The sort-and-segment sum adds what ``index_add_`` adds (many duplicates, a spare row)."""
    ids = torch.randint(0, 6, (500,))
    vals = torch.randn(500, 15)
    want = torch.zeros(7, 15, dtype=torch.float64).index_add_(0, ids, vals.double())
    monkeypatch.setattr(torch_path, "DETERMINISTIC_SUM", True)
    got = torch.zeros(7, 15)
    torch_path._sum_into(got, ids, vals, spare=6)
    torch.testing.assert_close(got[:6].double(), want[:6], rtol=1e-5, atol=1e-5)
