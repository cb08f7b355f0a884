"""IOCounter: nesting, nothing counted when off, the report's API."""
import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention
from sparse_io_attn.accounting import IOCounter, TrafficReport, counting, kernel_io, traffic
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn._triton import runtime

DEVICE = "cpu" if INTERPRET else "cuda"
B, H, N, D = 1, 2, 96, 32


@pytest.fixture
def problem():
    mask = torch.rand(H, 3, 3) < 0.6
    mask[:, 0, 0] = True
    layout = BlockSparseLayout.from_block_mask(mask, 32, N)
    q, k, v = (torch.randn(B, H, N, D, device=DEVICE, requires_grad=True) for _ in range(3))
    return layout, q, k, v


def test_nested_counters(problem):
    layout, q, k, v = problem
    with IOCounter() as outer:
        out = block_sparse_attention(q, k, v, layout, causal=True, backend="triton")
        assert set(outer.report.kernels) == {"attn_fwd"}
        with IOCounter() as inner:
            out.backward(torch.randn_like(out))
    assert set(inner.report.kernels) == {"attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"}
    assert inner.report == traffic.block_sparse_backward(layout, B, H, H, D, torch.float32, causal=True)
    assert outer.report == traffic.block_sparse(layout, B, H, H, D, torch.float32, causal=True)
    assert outer.report.total_bytes == inner.report.total_bytes + outer.report.kernels["attn_fwd"].total
    assert all(kt.launches == 1 for kt in outer.report.kernels.values())
    assert not counting()


def test_counts_accumulate_over_launches(problem):
    layout, q, k, v = problem
    with IOCounter() as io:
        block_sparse_attention(q, k, v, layout, backend="triton")
        block_sparse_attention(q, k, v, layout, backend="triton")
    once = traffic.block_sparse_forward(layout, B, H, H, D, torch.float32)
    assert io.report.kernels["attn_fwd"].launches == 2
    assert io.report.bytes_read == 2 * once.bytes_read and io.report.bytes_written == 2 * once.bytes_written
    io.reset()
    assert io.report.total_bytes == 0 and not io.report.kernels


def test_nothing_counted_when_off(problem):
    layout, q, k, v = problem
    assert kernel_io("attn_fwd", ("q",), DEVICE) is None
    out = block_sparse_attention(q, k, v, layout, backend="triton")  # no counter active
    out.sum().backward()
    buf = runtime._DUMMY_IO[str(torch.device(DEVICE))]  # what the uncounted launches received
    assert torch.equal(buf, torch.zeros_like(buf))          # COUNT_IO=False never touches io_ptr
    with IOCounter() as io:
        pass
    assert io.report.total_bytes == 0 and io.report == TrafficReport(source="predicted")


def test_report_api(problem):
    layout, q, k, v = problem
    with IOCounter() as io:
        block_sparse_attention(q, k, v, layout, backend="triton")
    rep = io.report
    d = rep.to_dict()
    assert d["source"] == "counted" and d["total_bytes"] == rep.total_bytes
    assert d["kernels"]["attn_fwd"]["reads"]["q"] == B * H * N * D * 4
    assert rep.per_tensor()["o"] == (0, B * H * N * D * 4)
    table = rep.table()
    assert "attn_fwd (x1)" in table and f"{rep.total_bytes:,}" in table


def test_counter_sees_launches_from_other_threads():
    """A CUDA backward runs on the autograd engine's own thread: an open counter must count launches
    from every thread of the process (a thread-local counter missed the whole backward on an H200)."""
    import threading

    from sparse_io_attn.tally import kernel_io

    def launch():
        io = kernel_io("worker_kernel", ["x"], "cpu")
        assert io is not None, "the worker thread does not see the open counter"
        io.buffer[0, 0] = 7
        io.buffer[0, 1] = 3
        io.commit()

    with IOCounter() as counter:
        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
    assert counter.report.bytes_read == 7 and counter.report.bytes_written == 3
    # closed: the worker's launches no longer count anywhere
    assert kernel_io("worker_kernel", ["x"], "cpu") is None
