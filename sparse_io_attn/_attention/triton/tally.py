"""``@triton.jit`` tallies of the bytes every attention kernel of a kind moves (``COUNT_IO``): the
tensors of the ``*_BASE`` tuples of :mod:`sparse_io_attn._attention.traffic`, which start every op's
counter tuples. Each kernel adds its own index tensors (layout, masks, plan) after these."""
from __future__ import annotations

from sparse_io_attn._attention.triton.slots import (BWD_DELTA, BWD_DO, BWD_K, BWD_Q, BWD_STATS, BWD_V, DKDV_DK,
                                                    DKDV_DV, DQ_DQ, MERGE_LSE, MERGE_O, MERGE_PARTIAL, MERGE_STATS,
                                                    OUT_K, OUT_LSE, OUT_O, OUT_PARTIAL, OUT_Q, OUT_STATS, OUT_V)
from sparse_io_attn._triton.jit import io_add  # (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def tally_forward(io_ptr, rows, keys, head_dim, head_dim_v, elem_bytes, NUM_SPLITS: tl.constexpr):
    """A forward (``NUM_SPLITS == 1``) or decode split's program: ``rows`` query rows read and their
    outputs written (``o``, fp32 ``lse`` and ``stats``; a split of several writes its fp32 ``(m, l,
    acc)`` partial instead), ``keys`` key rows of ``k`` and ``v`` read; ``q``/``k`` rows of ``head_dim``
    elements, ``v``/``o``/``acc`` rows of ``head_dim_v``."""
    io_add(io_ptr, OUT_Q, rows * head_dim * elem_bytes, 0)
    io_add(io_ptr, OUT_K, keys * head_dim * elem_bytes, 0)
    io_add(io_ptr, OUT_V, keys * head_dim_v * elem_bytes, 0)
    if NUM_SPLITS == 1:
        io_add(io_ptr, OUT_O, 0, rows * head_dim_v * elem_bytes)
        io_add(io_ptr, OUT_LSE, 0, rows * 4)
        io_add(io_ptr, OUT_STATS, 0, rows * 8)
    else:
        io_add(io_ptr, OUT_PARTIAL, 0, rows * (2 + head_dim_v) * 4)


@triton.jit
def tally_residual(io_ptr, slot, rows, row_bytes, HAS_RESIDUAL: tl.constexpr):
    """A row-storing program that also wrote its rows' rounding residual (``HAS_RESIDUAL``): ``rows`` rows of
    ``row_bytes`` written to the ``residual`` slot ``slot`` (:func:`~.softmax.store_rows`)."""
    if HAS_RESIDUAL:
        io_add(io_ptr, slot, 0, rows * row_bytes)


@triton.jit
def tally_backward(io_ptr, queries, keys, head_dim, head_dim_v, elem_bytes, DKDV: tl.constexpr):
    """A dQ (``DKDV`` False) or dK/dV program: ``queries`` (gathered) query rows of ``q``, ``do``, ``stats``,
    ``delta`` read, ``keys`` key rows of ``k`` and ``v`` read; written: ``dq`` for its query rows, or
    ``dk`` and ``dv`` for its key rows. ``q``/``k``/``dq``/``dk`` rows of ``head_dim`` elements,
    ``v``/``do``/``dv`` rows of ``head_dim_v``."""
    row_bytes = head_dim * elem_bytes
    v_bytes = head_dim_v * elem_bytes
    io_add(io_ptr, BWD_Q, queries * row_bytes, 0)
    io_add(io_ptr, BWD_K, keys * row_bytes, 0)
    io_add(io_ptr, BWD_V, keys * v_bytes, 0)
    io_add(io_ptr, BWD_DO, queries * v_bytes, 0)
    io_add(io_ptr, BWD_STATS, queries * 8, 0)
    io_add(io_ptr, BWD_DELTA, queries * 4, 0)
    if DKDV:
        io_add(io_ptr, DKDV_DK, 0, keys * row_bytes)
        io_add(io_ptr, DKDV_DV, 0, keys * v_bytes)
    else:
        io_add(io_ptr, DQ_DQ, 0, queries * row_bytes)


@triton.jit
def tally_merge(io_ptr, rows, partials, row_bytes, head_dim):
    """A merge program (``DECODE_MERGE_TENSORS`` slots): ``partials`` fp32 partial rows (``2 + head_dim``
    floats, ``head_dim``: V's) read, ``rows`` rows of ``o`` (``row_bytes``), fp32 ``lse`` and ``stats`` written."""
    io_add(io_ptr, MERGE_PARTIAL, partials * (2 + head_dim) * 4, 0)
    io_add(io_ptr, MERGE_O, 0, rows * row_bytes)
    io_add(io_ptr, MERGE_LSE, 0, rows * 4)
    io_add(io_ptr, MERGE_STATS, 0, rows * 8)


__all__ = ["tally_backward", "tally_forward", "tally_merge", "tally_residual"]
