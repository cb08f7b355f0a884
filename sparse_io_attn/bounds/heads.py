"""Theorem 4.5's counts per ``(batch element, head)`` for the batched, multi-head form of the
paper's attention (``sparse_operands.attention`` with ``A1 [B, n, d]``, per-head ``X``): one
:func:`~sparse_io_attn.bounds.nnz_stats` call per ``(b, h)``, and the counts summed over them.

Operand forms (as ``sparse_operands.attention`` takes them): ``A1``/``A2`` a 2-D matrix shared by every batch
element (dense, ``BlockSparseMatrix``, scipy), a 3-D dense ``[B, n, d]`` or a list/tuple of ``B``
matrices (a pattern per batch element); ``X`` a 2-D matrix
shared by every head, a 3-D dense ``[H, d, d]`` or a list/tuple of ``H`` matrices (a pattern per
head); ``qk_layout`` a :class:`~sparse_io_attn.BlockSparseLayout` with ``layout_batch`` 1 or ``B``
and ``layout_heads`` 1 or ``H``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from sparse_io_attn.bounds.nnz import NnzStats, nnz_stats

COUNTS = ("Z_A", "Z_X", "Z_AX", "Z_AXA")


def _lead(t) -> int | None:
    if isinstance(t, (list, tuple)):
        return len(t)
    shape = getattr(t, "shape", ())
    return shape[0] if len(shape) == 3 else None


def _pick(t, i: int):
    return t[i] if _lead(t) is not None else t


@dataclass(frozen=True)
class HeadNnzStats:
    """``per_head[b * H + h]``: the :class:`~sparse_io_attn.bounds.NnzStats` of batch element ``b``,
    head ``h``; ``Z_A``, ``Z_X``, ``Z_AX``, ``Z_AXA``: their sums over every ``(b, h)``."""
    B: int
    H: int
    per_head: tuple
    Z_A: int
    Z_X: int
    Z_AX: int
    Z_AXA: int

    def stats(self, b: int, h: int) -> NnzStats:
        return self.per_head[b * self.H + h]

    def bounds(self, M, *, dtype=None) -> list:
        """Theorem 4.5 per ``(b, h)`` (:meth:`NnzStats.bound`, element level), in ``per_head`` order
        (sorted ``(b, h)``: what ``accounting.compare`` takes beside per-head reports); the problems
        are independent, so the batched call needs at least their sum."""
        return [s.bound(M, dtype=dtype) for s in self.per_head]


def _grid(grid, B: int, H: int) -> tuple:
    """``grid`` as ``(B, H)``: positive ints equal to the operands' sizes or repeating a shared (1) axis."""
    ok = (isinstance(grid, (tuple, list)) and len(grid) == 2
          and all(isinstance(g, numbers.Integral) and not isinstance(g, bool) and g > 0 for g in grid))
    if not ok:
        raise TypeError(f"grid must be the call's (B, H), a pair of positive ints, got {grid!r}")
    for axis, have, want in (("batch", B, int(grid[0])), ("head", H, int(grid[1]))):
        if have not in (1, want):
            raise ValueError(f"grid {tuple(grid)} has {want} along the {axis} axis but the operands have "
                             f"{have}; pass the call's (B, H)")
    return int(grid[0]), int(grid[1])


def head_nnz_stats(A1, X, A2, qk_layout=None, *, level: str = "element", block_size=None,
                   grid: tuple | None = None) -> HeadNnzStats:
    """Theorem 4.5's counts for every ``(b, h)`` of a batched call (see the module docstring for the
    operand forms) and their sums. ``level``/``block_size`` as for
    :func:`~sparse_io_attn.bounds.nnz_stats`. ``grid``: the call's ``(B, H)`` where it has more batch
    elements or heads than ``A1``, ``X``, ``A2`` and the layout show (``A3`` or ``Y`` vary along an
    axis they share): the shared counts then stand for every ``(b, h)`` of the call (computed once)."""
    sizes = {"batch": {}, "head": {}}
    for name, t, axis in (("A1", A1, "batch"), ("A2", A2, "batch"), ("X", X, "head")):
        if _lead(t) is not None:
            sizes[axis][name] = _lead(t)
    if qk_layout is not None:
        sizes["batch"]["qk_layout.layout_batch"] = qk_layout.layout_batch
        sizes["head"]["qk_layout.layout_heads"] = qk_layout.layout_heads
    dims = {}
    for axis, given in sizes.items():
        values = {n for n in given.values() if n != 1}
        if len(values) > 1:
            raise ValueError(f"inconsistent {axis} sizes: {given}; operands that vary along the {axis} axis "
                             f"must agree (or be 2-D, shared)")
        dims[axis] = values.pop() if values else 1
    B, H = dims["batch"], dims["head"]
    if grid is not None:
        B, H = _grid(grid, B, H)
    per_head, seen = [], {}
    for b in range(B):
        for h in range(H):
            own = (b % dims["batch"], h % dims["head"])    # the operands' own indices (0 on a shared axis)
            if own not in seen:
                index = None
                if qk_layout is not None and qk_layout.num_layouts > 1:
                    index = (b % qk_layout.layout_batch) * qk_layout.layout_heads + h % qk_layout.layout_heads
                seen[own] = nnz_stats(_pick(A1, b), _pick(X, h), _pick(A2, b), qk_layout, level=level,
                                      block_size=block_size, layout_index=index)
            per_head.append(seen[own])
    sums = {c: sum(getattr(s, c) for s in per_head) for c in COUNTS}
    return HeadNnzStats(B, H, tuple(per_head), **sums)
