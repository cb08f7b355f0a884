"""Byte constants and the traffic terms of the kernels both attention ops share (the backward
preprocess, the decode outputs and merge), in the vocabulary of the ops' exact traffic models
(:mod:`sparse_io_attn.block_sparse.traffic`, :mod:`sparse_io_attn.selection.traffic`)."""
from __future__ import annotations

from sparse_io_attn.tally.report import TrafficReport

INDEX_BYTES = 4  # int32 list entries (CSR/CSC offsets and indices, selection rows)
STAT_BYTES = 4   # fp32 lse, delta and the two softmax statistics (row max, log2 row sum)

# Tensor names of the shared kernels' I/O counters, in slot order (the kernels' named slots are built
# from these tuples in :mod:`.triton.slots`).
PREPROCESS_TENSORS = ("o", "do", "delta", "residual")
DECODE_MERGE_TENSORS = ("partial", "o", "lse", "stats", "residual")
# The tensors every kernel of a kind counts, first in its slot order: each op appends the index
# tensors its kernels read (block-sparse ``("layout", "mask")``, selection ``("plan")``), so the
# shared tallies (:mod:`.triton.tally`) address one slot per tensor for every op.
# ("residual": the output's rounding residual, written by a 16-bit forward whose gradient is needed and
# read by the backward preprocess, :mod:`.delta`)
FWD_BASE = ("q", "k", "v", "o", "lse", "stats", "residual")
DECODE_BASE = FWD_BASE + ("partial",)
DQ_BASE = ("q", "k", "v", "do", "stats", "delta", "dq")
DKDV_BASE = ("q", "k", "v", "do", "stats", "delta", "dk", "dv")


def add_preprocess(rep: TrafficReport, name: str, rows: int, head_dim: int, elem_bytes: int,
                   residual: bool = False) -> None:
    """``delta = rowsum(dO * O)``: reads ``o`` and ``do`` once per row (``residual``: and the forward's
    rounding residual, :mod:`.delta`), writes fp32 ``delta``; an empty grid (``rows == 0``) is not
    launched."""
    if rows:
        row = rows * head_dim * elem_bytes
        rep.add(name, {"o": row, "do": row, "residual": row if residual else 0}, {"delta": rows * STAT_BYTES})


def output_bytes(rows: int, head_dim: int, elem_bytes: int, residual: bool = False) -> dict:
    """What a forward's row-storing program writes for ``rows`` rows: ``o``, fp32 ``lse`` and ``stats``, and
    (``residual``) the output's rounding residual."""
    o = rows * head_dim * elem_bytes
    return {"o": o, "lse": rows * STAT_BYTES, "stats": rows * 2 * STAT_BYTES, "residual": o if residual else 0}


def add_decode(rep: TrafficReport, name: str, reads: dict, rows: int, splits: int, head_dim: int,
               elem_bytes: int) -> None:
    """A split-K decode launch ``name`` reading ``reads``: with one split it writes ``o``, ``lse`` and
    ``stats``; otherwise each split's ``(m, l, acc)`` goes to the fp32 ``partial`` buffer and
    ``{name}_merge`` reads it once and writes the outputs."""
    outputs = output_bytes(rows, head_dim, elem_bytes)
    if splits == 1:
        rep.add(name, reads, outputs)
        return
    partial = splits * rows * (2 + head_dim) * STAT_BYTES
    rep.add(name, reads, {"partial": partial})
    rep.add(f"{name}_merge", {"partial": partial}, outputs)


__all__ = ["DECODE_BASE", "DECODE_MERGE_TENSORS", "DKDV_BASE", "DQ_BASE", "FWD_BASE", "INDEX_BYTES",
           "PREPROCESS_TENSORS", "STAT_BYTES", "add_decode", "add_preprocess", "output_bytes"]
