"""Per-head traffic of the batched sparse-operand attention against Theorem 4.5, in one call.

``compare_heads(A1, A2, A3, X, Y, qk_layout=...)`` predicts each ``(batch element, head)`` group's
share of the traffic of ``sparse_operands.attention(..., backend="triton")`` (forward and backward)
(:func:`~sparse_io_attn.sparse_operands.predict_traffic_per_head`), evaluates Theorem 4.5 on each
group's own operands (:func:`~sparse_io_attn.bounds.heads.head_nnz_stats`) at the kernels' fast
memory ``M`` (:func:`~sparse_io_attn.sparse_operands.kernel_fast_memory_words`, the same for every
group) and compares them (:func:`~sparse_io_attn.accounting.compare`). Given the counted report of
that call, the total row shows the counted bytes, checked equal to the model's.
"""
from __future__ import annotations

from sparse_io_attn.accounting.compare import HeadComparison, per_head_comparison
from sparse_io_attn.bounds.heads import head_nnz_stats
from sparse_io_attn.sparse_operands.operands import check_batch, check_operands
from sparse_io_attn.sparse_operands.traffic import kernel_fast_memory_words, predict_traffic, predict_traffic_per_head
from sparse_io_attn.tally.report import TrafficReport


def compare_heads(A1, A2, A3, X, Y, *, qk_layout=None, M=None, report=None,
                  backward: bool = True) -> HeadComparison:
    """Each ``(b, h)`` group's predicted traffic against its own Theorem 4.5 bound, and the total.

    Operands as for :func:`~sparse_io_attn.sparse_operands.attention` (single-head or batched);
    bytes are in the operands' dtype, which also converts the bounds' words. ``M``: the fast memory
    at which the bounds are evaluated, words or a size string (``"228KiB"``); default
    :func:`~sparse_io_attn.sparse_operands.kernel_fast_memory_words`, the per-program working set of
    the counted kernels. ``backward``: whether the traffic includes the backward (all five
    gradients), as in :func:`~sparse_io_attn.sparse_operands.predict_traffic`.

    ``report``: the ``TrafficReport`` an :class:`~sparse_io_attn.accounting.IOCounter` counted
    around exactly this call (and its backward when ``backward``). It must equal the model kernel
    by kernel and tensor (``ValueError`` otherwise); the total row then shows its bytes, while the
    per-head rows stay the model's shares (the counter sums a launch over every group).

    Measured bytes include the int32 index traffic (plans, block maps), as counted. With a QK
    layout, Z_AXA is restricted to the kept entries and the bounds are estimates, not proven
    lower bounds (the table says so).
    """
    _, dtype, _ = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    batch = check_batch(A1, A2, A3, X, Y, qk_layout)
    if report is not None and not isinstance(report, TrafficReport):
        raise TypeError(f"report must be the TrafficReport an IOCounter counted around this call, got "
                        f"{type(report).__name__}")
    shares = predict_traffic_per_head(A1, A2, A3, X, Y, qk_layout=qk_layout, backward=backward)
    if M is None:
        M = kernel_fast_memory_words(A1, A2, A3, X, Y, qk_layout=qk_layout)
    stats = head_nnz_stats(A1, X, A2, qk_layout, grid=(batch.B, batch.H))
    bounds = stats.bounds(M, dtype=dtype)
    note = ""
    if report is not None:
        predicted = predict_traffic(A1, A2, A3, X, Y, qk_layout=qk_layout, backward=backward)
        if report != predicted:
            raise ValueError(
                f"the counted report ({report.total_bytes:,} bytes, kernels {sorted(report.kernels)}) differs "
                f"from the model of this call ({predicted.total_bytes:,} bytes, kernels "
                f"{sorted(predicted.kernels)}): count exactly one sparse_operands.attention(..., backend='triton') call"
                f"{' and its backward' if backward else ' (no backward: backward=False)'} under the IOCounter, "
                f"on these operands")
        note = (f"per-head rows: the traffic model's share of each (b, h); total: {report.source} by the "
                f"kernels, equal to the model's total")
    return per_head_comparison(shares, bounds, total=report, note=note)
