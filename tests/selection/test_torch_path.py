"""What is particular to the ``torch`` backend of ``selection_attention``: chunks of query rows that
span units, the sort-and-segment dK/dV sum (the path of CUDA and other devices, run here on CPU),
and no host synchronisation from the plan to the gradients."""
import pytest
import torch

from helpers import check_close, make_inputs, no_host_sync
from sparse_io_attn import Selection, selection_attention
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.selection import torch_path
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_reference

from .test_correctness import random_indices, run_selection


@pytest.fixture(params=["auto", True], ids=["index_add", "sort-segment"])
def dk_sum(request, monkeypatch):
    """Both ways of summing dK/dV: ``index_add_`` (CPU) and sort + segment_reduce (other devices)."""
    monkeypatch.setattr(torch_path, "DETERMINISTIC_SUM", request.param)
    return request.param


@pytest.mark.parametrize("rows_per_chunk", [3, 7, 10 ** 6], ids=["3-rows", "7-rows", "one-chunk"])
def test_chunks_spanning_units(dk_sum, rows_per_chunk, monkeypatch):
    """Chunks of 3 or 7 rows (Nq = 10: chunks straddle units and GQA groups) compute what one chunk
    does, and match the reference."""
    B, Hq, Hkv, G, Nq, Nk, D, bs, K = 2, 4, 2, 4, 10, 37, 16, 4, 5
    per_row = 2 * (Hq // G) * K * bs + 4 * K * bs * D + 4 * (Hq // G) * D
    monkeypatch.setitem(torch_path.CHUNK_ELEMENTS, "cpu", per_row * rows_per_chunk)
    idx = random_indices((B, G), Nq, Nk, K, bs, causal="bottom_right")
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    got = run_selection(q, k, v, do, idx, block_size=bs, backend="torch", causal="bottom_right")
    check_close(got, selection_reference(q, k, v, Selection(idx, bs), causal="bottom_right", do=do))
    again = run_selection(q, k, v, do, idx, block_size=bs, backend="torch", causal="bottom_right")
    for a, b in zip(got, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_forward_and_backward_never_synchronise(dk_sum, G):
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
    vals = torch.randn(500, 3, 5)
    want = torch.zeros(7, 3, 5, dtype=torch.float64).index_add_(0, ids, vals.double())
    monkeypatch.setattr(torch_path, "DETERMINISTIC_SUM", True)
    got = torch.zeros(7, 3, 5)
    torch_path._sum_into(got, ids, vals, spare=6)
    torch.testing.assert_close(got[:6].double(), want[:6], rtol=1e-5, atol=1e-5)
