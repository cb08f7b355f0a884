"""The paper's Algorithms 1-6 (Appendix C) run on :class:`TwoLevelMemory`, line by line.

Indices are 0-based; ``blk(i)`` is the ``i``-th block of ``B`` rows or columns (the last may be
short). ``M^{(B)}[i, j]`` of the text is ``slow["M"][blk(i), blk(j)]``; a block of a transpose
``(A2^T)^{(B)}[k, j]`` is read from ``A2`` and transposed in fast memory (same words).
Every tiled product of Algorithms 2-5 (a ``B x B`` output tile accumulated over the inner blocks,
two input tiles resident at a time, then stored) is one helper, :func:`_tiled_product` (one tile:
:func:`_product_tile`); Algorithm 2's softmax rows (lines 15-35), which the small-cache forward
repeats, are :func:`_softmax_rows`. Each function returns the result; the I/O is on the ``mem``
passed in.
"""
from __future__ import annotations

import math

import numpy as np

from sparse_io_attn.experiments.pebble.executor import TwoLevelMemory, block, num_blocks


def pebble_small_cache_block(M: int) -> int:
    """``B = floor(sqrt(M / 4))`` (Algorithms 2-5, line 2)."""
    B = math.isqrt(M // 4)
    if B < 1:
        raise ValueError(f"Algorithm 6 needs M >= 4 words (B = floor(sqrt(M/4)) >= 1), got M={M}")
    return B


def algorithm1(mem: TwoLevelMemory) -> np.ndarray:
    """Algorithm 1 (no cache): whole matrices in fast memory. Reads A1, A2, A3, dO, X, Y; writes g."""
    n, d = mem.slow["A1"].shape
    mem.load("A1", "A1"), mem.load("A2", "A2"), mem.load("X", "X")                 # line 2
    mem.alloc("A", (n, n))
    mem.compute("A", lambda a, a1, x, a2: a + a1 @ x @ a2.T, "A", "A1", "X", "A2")
    mem.free("X")
    mem.compute("A", np.exp, "A")                                                  # line 3
    mem.alloc("l", (n,))
    mem.compute("l", lambda l, a: l + a.sum(axis=1), "l", "A")
    mem.alloc("f", (n, n))                                                         # line 4
    mem.compute("f", lambda f, l, a: f + a / l[:, None], "f", "l", "A")
    mem.free("A", "l")
    mem.load("A3", "A3"), mem.load("Y", "Y"), mem.alloc("h", (n, d))               # line 5
    mem.compute("h", lambda h, a3, y: h + a3 @ y, "h", "A3", "Y")
    mem.free("A3", "Y")
    mem.load("dO", "dO"), mem.alloc("q", (n, n))                                   # line 6
    mem.compute("q", lambda q, do, h: q + do @ h.T, "q", "dO", "h")
    mem.free("dO", "h")
    mem.alloc("p", (n, n))                                                         # line 7
    mem.compute("p", lambda p, f, q: p + f * q - (f * q).sum(axis=1)[:, None] * f, "p", "f", "q")
    mem.free("f", "q")
    mem.alloc("g", (d, d))                                                         # line 8
    mem.compute("g", lambda g, a1, p, a2: g + a1.T @ p @ a2, "g", "A1", "p", "A2")
    mem.free("A1", "A2", "p")
    mem.allocate("g", (d, d))
    mem.store("g", "g")
    mem.free("g")
    return mem.slow["g"]


def _product_tile(mem: TwoLevelMemory, key: str, a: str, b: str, B: int, i: int, j: int, shape, *,
                  a_t: bool = False, b_t: bool = False) -> None:
    """Tile ``(i, j)`` of ``a @ b`` accumulated in fast memory as ``key``: a zero tile, then
    ``key += a[i, k] @ b[k, j]`` for every inner block ``k``, the two input tiles resident only for
    their product (Algorithm 2, lines 6-12, and every tiled product of Algorithms 2-5). ``shape``:
    ``(rows, cols, inner)`` of the product, cut in blocks of ``B``; ``a_t`` (``b_t``): the operand
    is the transpose of slow array ``a`` (``b``), its tile read from ``a``'s transposed block."""
    n_r, n_c, n_k = shape
    r, c = block(i, B, n_r), block(j, B, n_c)
    mem.alloc(key, (r.stop - r.start, c.stop - c.start))
    a_key, b_key = f"{a}{'T' if a_t else ''}_ik", f"{b}{'T' if b_t else ''}_kj"
    for k in range(num_blocks(n_k, B)):
        inner = block(k, B, n_k)
        mem.load(a_key, a, *((inner, r) if a_t else (r, inner)), transpose=a_t)
        mem.load(b_key, b, *((c, inner) if b_t else (inner, c)), transpose=b_t)
        mem.compute(key, lambda acc, x, y: acc + x @ y, key, a_key, b_key)
        mem.free(a_key, b_key)


def _tiled_product(mem: TwoLevelMemory, out: str, a: str, b: str, B: int, shape, *, a_t: bool = False,
                   b_t: bool = False) -> None:
    """Slow ``out = a @ b`` one ``B x B`` tile at a time (:func:`_product_tile`, then stored)."""
    n_r, n_c, _ = shape
    for i in range(num_blocks(n_r, B)):
        for j in range(num_blocks(n_c, B)):
            _product_tile(mem, f"{out}_ij", a, b, B, i, j, shape, a_t=a_t, b_t=b_t)
            mem.store(f"{out}_ij", out, block(i, B, n_r), block(j, B, n_c))
            mem.free(f"{out}_ij")


def _softmax_rows(mem: TwoLevelMemory, B: int, n: int, d: int, *, store_l: bool = False) -> None:
    """Algorithm 2, lines 15-35, from ``S`` in slow memory: per row block ``i``, ``A_ij = exp(S_i A2_j^T)``
    stored with ``l_i = A_i 1`` kept in fast memory, then ``f_ij = diag(l_i)^-1 A_ij`` (writes A, f;
    with ``store_l`` also ``l``, the forward's row statistic)."""
    for i in range(num_blocks(n, B)):
        r = block(i, B, n)
        mem.alloc("l_i", (r.stop - r.start,))
        for j in range(num_blocks(n, B)):
            _product_tile(mem, "A_ij", "S", "A2", B, i, j, (n, n, d), b_t=True)
            mem.compute("A_ij", np.exp, "A_ij")                                   # line 24
            mem.store("A_ij", "A", r, block(j, B, n))
            mem.compute("l_i", lambda l, a: l + a.sum(axis=1), "l_i", "A_ij")      # line 25
            mem.free("A_ij")
        if store_l:
            mem.store("l_i", "l", r)
        for j in range(num_blocks(n, B)):
            c = block(j, B, n)
            mem.alloc("f_ij", (r.stop - r.start, c.stop - c.start))               # line 29
            mem.load("A_ij", "A", r, c)
            mem.compute("f_ij", lambda f, l, a: f + a / l[:, None], "f_ij", "l_i", "A_ij")
            mem.store("f_ij", "f", r, c)
            mem.free("A_ij", "f_ij")
        mem.free("l_i")


def algorithm2(mem: TwoLevelMemory, M: int) -> None:
    """Phase 1: S = A1 X, A = exp(S A2^T), l = A 1, f = diag(l)^-1 A (writes S, A, f)."""
    n, d = mem.slow["A1"].shape
    B = pebble_small_cache_block(M)
    mem.allocate("S", (n, d)), mem.allocate("A", (n, n)), mem.allocate("f", (n, n))
    _tiled_product(mem, "S", "A1", "X", B, (n, d, d))                             # lines 4-14
    _softmax_rows(mem, B, n, d)                                                   # lines 15-35


def algorithm3(mem: TwoLevelMemory, M: int) -> None:
    """Phase 2: h = A3 Y, q = dO h^T (writes h, q). (The text also passes f; it is unused.) Line 10
    frees "A_2"; it is the A_3 block just read."""
    n, d = mem.slow["A3"].shape
    B = pebble_small_cache_block(M)
    mem.allocate("h", (n, d)), mem.allocate("q", (n, n))
    _tiled_product(mem, "h", "A3", "Y", B, (n, d, d))
    _tiled_product(mem, "q", "dO", "h", B, (n, n, d), b_t=True)


def algorithm4(mem: TwoLevelMemory, M: int) -> None:
    """Phase 3: v = (f o q) 1, p = f o q - diag(v) f (writes p)."""
    n = mem.slow["f"].shape[0]
    B = pebble_small_cache_block(M)
    In = num_blocks(n, B)
    bn = lambda i: block(i, B, n)  # noqa: E731
    mem.allocate("p", (n, n))
    for i in range(In):
        rows = bn(i).stop - bn(i).start
        mem.alloc("v_i", (rows,))
        for j in range(In):
            mem.load("f_ij", "f", bn(i), bn(j)), mem.load("q_ij", "q", bn(i), bn(j))
            mem.compute("v_i", lambda v, f, q: v + (f * q).sum(axis=1), "v_i", "f_ij", "q_ij")
            mem.free("f_ij", "q_ij")
        for j in range(In):
            mem.alloc("p_ij", (rows, bn(j).stop - bn(j).start))
            mem.load("f_ij", "f", bn(i), bn(j)), mem.load("q_ij", "q", bn(i), bn(j))
            mem.compute("p_ij", lambda p, f, q, v: p + f * q - v[:, None] * f, "p_ij", "f_ij", "q_ij", "v_i")
            mem.free("f_ij", "q_ij")
            mem.store("p_ij", "p", bn(i), bn(j))
            mem.free("p_ij")
        mem.free("v_i")


def algorithm5(mem: TwoLevelMemory, M: int) -> np.ndarray:
    """Phase 4: T = A1^T p, g = T A2 (writes T, g); returns g."""
    n, d = mem.slow["A1"].shape
    B = pebble_small_cache_block(M)
    mem.allocate("T", (d, n)), mem.allocate("g", (d, d))
    _tiled_product(mem, "T", "A1", "p", B, (d, n, n), a_t=True)
    _tiled_product(mem, "g", "T", "A2", B, (d, d, n))
    return mem.slow["g"]


def algorithm6(mem: TwoLevelMemory, M: int) -> np.ndarray:
    """Algorithm 6 (small cache): Phases 1-4; inputs A1, A2, A3, dO, X, Y in ``mem.slow``; returns g."""
    algorithm2(mem, M)
    algorithm3(mem, M)
    algorithm4(mem, M)
    return algorithm5(mem, M)


def small_cache_forward(mem: TwoLevelMemory, M: int) -> np.ndarray:
    """The small-cache forward (Saha & Ye 2024's O(n^2 d / sqrt(M)) schedule, Table 1 "General /
    Forward Upper, small cache"), on Algorithm 2's ``B x B`` tiles, ``B = floor(sqrt(M/4))``:

    1. ``S = A1 X`` and ``A = exp(S A2^T)`` with ``l = A 1``, ``f = diag(l)^-1 A`` -- Algorithm 2
       (lines 4-35), which also writes ``l`` (the forward's row statistic, ``n`` words);
    2. ``h = A3 Y`` -- the first loop of Algorithm 3;
    3. ``O = f h``: one ``B x B`` output tile at a time, streaming ``f``'s row of tiles and ``h``'s
       column of tiles.

    Inputs A1, A2, A3, X, Y in ``mem.slow``; writes S, A, f, l, h, O; returns O."""
    n, d = mem.slow["A1"].shape
    B = pebble_small_cache_block(M)
    mem.allocate("S", (n, d)), mem.allocate("A", (n, n)), mem.allocate("f", (n, n)), mem.allocate("l", (n,))
    mem.allocate("h", (n, d)), mem.allocate("O", (n, d))
    _tiled_product(mem, "S", "A1", "X", B, (n, d, d))                             # S = A1 X
    _softmax_rows(mem, B, n, d, store_l=True)                                     # Algorithm 2, lines 15-35
    _tiled_product(mem, "h", "A3", "Y", B, (n, d, d))                             # h = A3 Y
    _tiled_product(mem, "O", "f", "h", B, (n, d, n))                              # O = f h
    return mem.slow["O"]
