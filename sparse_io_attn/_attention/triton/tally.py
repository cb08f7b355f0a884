"""``@triton.jit`` tallies of the bytes every attention kernel of a kind moves (``COUNT_IO``): the
tensors of the ``*_BASE`` tuples of :mod:`sparse_io_attn._attention.traffic`, which start every op's
counter tuples. Each kernel adds its own index tensors (layout, masks, plan) after these."""
from __future__ import annotations

from sparse_io_attn._attention.triton.slots import (DKDV_DELTA, DKDV_DK, DKDV_DO, DKDV_DV, DKDV_K, DKDV_Q,
                                                    DKDV_STATS, DKDV_V, DQ_DELTA, DQ_DO, DQ_DQ, DQ_K, DQ_Q, DQ_STATS,
                                                    DQ_V, MERGE_LSE, MERGE_O, MERGE_PARTIAL, MERGE_STATS, OUT_K,
                                                    OUT_LSE, OUT_O, OUT_PARTIAL, OUT_Q, OUT_STATS, OUT_V)
from sparse_io_attn._triton.jit import io_add  # (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def tally_forward(io_ptr, rows, keys, row_bytes, head_dim, NUM_SPLITS: tl.constexpr):
    """A forward (``NUM_SPLITS == 1``) or decode split's program: ``rows`` query rows read and their
    outputs written (``o``, fp32 ``lse`` and ``stats``; a split of several writes its fp32 ``(m, l,
    acc)`` partial instead), ``keys`` key rows of ``k`` and ``v`` read."""
    io_add(io_ptr, OUT_Q, rows * row_bytes, 0)
    io_add(io_ptr, OUT_K, keys * row_bytes, 0)
    io_add(io_ptr, OUT_V, keys * row_bytes, 0)
    if NUM_SPLITS == 1:
        io_add(io_ptr, OUT_O, 0, rows * row_bytes)
        io_add(io_ptr, OUT_LSE, 0, rows * 4)
        io_add(io_ptr, OUT_STATS, 0, rows * 8)
    else:
        io_add(io_ptr, OUT_PARTIAL, 0, rows * (2 + head_dim) * 4)


@triton.jit
def tally_dq(io_ptr, rows, keys, row_bytes):
    """A dQ program: ``rows`` query rows of ``q``, ``do``, ``stats``, ``delta`` read and of ``dq``
    written, ``keys`` key rows of ``k`` and ``v`` read."""
    io_add(io_ptr, DQ_Q, rows * row_bytes, 0)
    io_add(io_ptr, DQ_K, keys * row_bytes, 0)
    io_add(io_ptr, DQ_V, keys * row_bytes, 0)
    io_add(io_ptr, DQ_DO, rows * row_bytes, 0)
    io_add(io_ptr, DQ_STATS, rows * 8, 0)
    io_add(io_ptr, DQ_DELTA, rows * 4, 0)
    io_add(io_ptr, DQ_DQ, 0, rows * row_bytes)


@triton.jit
def tally_dkdv(io_ptr, queries, keys, row_bytes):
    """A dK/dV program: ``queries`` (gathered) query rows of ``q``, ``do``, ``stats``, ``delta`` read,
    ``keys`` key rows of ``k``, ``v`` read and of ``dk``, ``dv`` written."""
    io_add(io_ptr, DKDV_Q, queries * row_bytes, 0)
    io_add(io_ptr, DKDV_K, keys * row_bytes, 0)
    io_add(io_ptr, DKDV_V, keys * row_bytes, 0)
    io_add(io_ptr, DKDV_DO, queries * row_bytes, 0)
    io_add(io_ptr, DKDV_STATS, queries * 8, 0)
    io_add(io_ptr, DKDV_DELTA, queries * 4, 0)
    io_add(io_ptr, DKDV_DK, 0, keys * row_bytes)
    io_add(io_ptr, DKDV_DV, 0, keys * row_bytes)


@triton.jit
def tally_merge(io_ptr, rows, partials, row_bytes, head_dim):
    """A merge program (``DECODE_MERGE_TENSORS`` slots): ``partials`` fp32 partial rows (``2 + head_dim``
    floats) read, ``rows`` rows of ``o``, fp32 ``lse`` and ``stats`` written."""
    io_add(io_ptr, MERGE_PARTIAL, partials * (2 + head_dim) * 4, 0)
    io_add(io_ptr, MERGE_O, 0, rows * row_bytes)
    io_add(io_ptr, MERGE_LSE, 0, rows * 4)
    io_add(io_ptr, MERGE_STATS, 0, rows * 8)


__all__ = ["tally_dkdv", "tally_dq", "tally_forward", "tally_merge"]
