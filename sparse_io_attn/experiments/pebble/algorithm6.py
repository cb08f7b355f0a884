"""The paper's Algorithms 1-6 (Appendix C) run on :class:`TwoLevelMemory`, line by line.

Indices are 0-based; ``blk(i)`` is the ``i``-th block of ``B`` rows or columns (the last may be
short). ``M^{(B)}[i, j]`` of the text is ``slow["M"][blk(i), blk(j)]``; a block of a transpose
``(A2^T)^{(B)}[k, j]`` is read from ``A2`` and transposed in fast memory (same words).
Each function returns the result; the I/O is on the ``mem`` passed in.
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


def algorithm2(mem: TwoLevelMemory, M: int) -> None:
    """Phase 1: S = A1 X, A = exp(S A2^T), l = A 1, f = diag(l)^-1 A (writes S, A, f)."""
    n, d = mem.slow["A1"].shape
    B = pebble_small_cache_block(M)
    In, Id = num_blocks(n, B), num_blocks(d, B)
    bn = lambda i: block(i, B, n)  # noqa: E731
    bd = lambda i: block(i, B, d)  # noqa: E731
    mem.allocate("S", (n, d)), mem.allocate("A", (n, n)), mem.allocate("f", (n, n))
    for i in range(In):                                                           # lines 4-14
        for j in range(Id):
            mem.alloc("S_ij", (bn(i).stop - bn(i).start, bd(j).stop - bd(j).start))
            for k in range(Id):
                mem.load("A1_ik", "A1", bn(i), bd(k)), mem.load("X_kj", "X", bd(k), bd(j))
                mem.compute("S_ij", lambda s, a, x: s + a @ x, "S_ij", "A1_ik", "X_kj")
                mem.free("A1_ik", "X_kj")
            mem.store("S_ij", "S", bn(i), bd(j))
            mem.free("S_ij")
    for i in range(In):                                                           # lines 15-35
        rows = bn(i).stop - bn(i).start
        mem.alloc("l_i", (rows,))
        for j in range(In):
            mem.alloc("A_ij", (rows, bn(j).stop - bn(j).start))
            for k in range(Id):
                mem.load("S_ik", "S", bn(i), bd(k)), mem.load("A2T_kj", "A2", bn(j), bd(k), transpose=True)
                mem.compute("A_ij", lambda a, s, a2t: a + s @ a2t, "A_ij", "S_ik", "A2T_kj")
                mem.free("S_ik", "A2T_kj")
            mem.compute("A_ij", np.exp, "A_ij")                                   # line 24
            mem.store("A_ij", "A", bn(i), bn(j))
            mem.compute("l_i", lambda l, a: l + a.sum(axis=1), "l_i", "A_ij")      # line 25
            mem.free("A_ij")
        for j in range(In):
            mem.alloc("f_ij", (rows, bn(j).stop - bn(j).start))                    # line 29
            mem.load("A_ij", "A", bn(i), bn(j))
            mem.compute("f_ij", lambda f, l, a: f + a / l[:, None], "f_ij", "l_i", "A_ij")
            mem.store("f_ij", "f", bn(i), bn(j))
            mem.free("A_ij", "f_ij")
        mem.free("l_i")


def algorithm3(mem: TwoLevelMemory, M: int) -> None:
    """Phase 2: h = A3 Y, q = dO h^T (writes h, q). (The text also passes f; it is unused.)"""
    n, d = mem.slow["A3"].shape
    B = pebble_small_cache_block(M)
    In, Id = num_blocks(n, B), num_blocks(d, B)
    bn = lambda i: block(i, B, n)  # noqa: E731
    bd = lambda i: block(i, B, d)  # noqa: E731
    mem.allocate("h", (n, d)), mem.allocate("q", (n, n))
    for i in range(In):
        for j in range(Id):
            mem.alloc("h_ij", (bn(i).stop - bn(i).start, bd(j).stop - bd(j).start))
            for k in range(Id):
                mem.load("A3_ik", "A3", bn(i), bd(k)), mem.load("Y_kj", "Y", bd(k), bd(j))
                mem.compute("h_ij", lambda h, a, y: h + a @ y, "h_ij", "A3_ik", "Y_kj")
                mem.free("A3_ik", "Y_kj")        # line 10 says "A_2"; it is the A_3 block just read
            mem.store("h_ij", "h", bn(i), bd(j))
            mem.free("h_ij")
    for i in range(In):
        for j in range(In):
            mem.alloc("q_ij", (bn(i).stop - bn(i).start, bn(j).stop - bn(j).start))
            for k in range(Id):
                mem.load("dO_ik", "dO", bn(i), bd(k)), mem.load("hT_kj", "h", bn(j), bd(k), transpose=True)
                mem.compute("q_ij", lambda q, do, ht: q + do @ ht, "q_ij", "dO_ik", "hT_kj")
                mem.free("dO_ik", "hT_kj")
            mem.store("q_ij", "q", bn(i), bn(j))
            mem.free("q_ij")


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
    In, Id = num_blocks(n, B), num_blocks(d, B)
    bn = lambda i: block(i, B, n)  # noqa: E731
    bd = lambda i: block(i, B, d)  # noqa: E731
    mem.allocate("T", (d, n)), mem.allocate("g", (d, d))
    for i in range(Id):
        for j in range(In):
            mem.alloc("T_ij", (bd(i).stop - bd(i).start, bn(j).stop - bn(j).start))
            for k in range(In):
                mem.load("A1T_ik", "A1", bn(k), bd(i), transpose=True), mem.load("p_kj", "p", bn(k), bn(j))
                mem.compute("T_ij", lambda t, a, p: t + a @ p, "T_ij", "A1T_ik", "p_kj")
                mem.free("A1T_ik", "p_kj")
            mem.store("T_ij", "T", bd(i), bn(j))
            mem.free("T_ij")
    for i in range(Id):
        for j in range(Id):
            mem.alloc("g_ij", (bd(i).stop - bd(i).start, bd(j).stop - bd(j).start))
            for k in range(In):
                mem.load("T_ik", "T", bd(i), bn(k)), mem.load("A2_kj", "A2", bn(k), bd(j))
                mem.compute("g_ij", lambda g, t, a: g + t @ a, "g_ij", "T_ik", "A2_kj")
                mem.free("T_ik", "A2_kj")
            mem.store("g_ij", "g", bd(i), bd(j))
            mem.free("g_ij")
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
    In, Id = num_blocks(n, B), num_blocks(d, B)
    bn = lambda i: block(i, B, n)  # noqa: E731
    bd = lambda i: block(i, B, d)  # noqa: E731
    mem.allocate("S", (n, d)), mem.allocate("A", (n, n)), mem.allocate("f", (n, n)), mem.allocate("l", (n,))
    mem.allocate("h", (n, d)), mem.allocate("O", (n, d))
    for prod, (a, b) in (("S", ("A1", "X")), ("h", ("A3", "Y"))):                  # S = A1 X, h = A3 Y
        for i in range(In):
            for j in range(Id):
                mem.alloc(f"{prod}_ij", (bn(i).stop - bn(i).start, bd(j).stop - bd(j).start))
                for k in range(Id):
                    mem.load("a_ik", a, bn(i), bd(k)), mem.load("b_kj", b, bd(k), bd(j))
                    mem.compute(f"{prod}_ij", lambda s, x, y: s + x @ y, f"{prod}_ij", "a_ik", "b_kj")
                    mem.free("a_ik", "b_kj")
                mem.store(f"{prod}_ij", prod, bn(i), bd(j))
                mem.free(f"{prod}_ij")
        if prod == "S":                                                            # Algorithm 2, lines 15-35
            for i in range(In):
                rows = bn(i).stop - bn(i).start
                mem.alloc("l_i", (rows,))
                for j in range(In):
                    mem.alloc("A_ij", (rows, bn(j).stop - bn(j).start))
                    for k in range(Id):
                        mem.load("S_ik", "S", bn(i), bd(k)), mem.load("A2T_kj", "A2", bn(j), bd(k), transpose=True)
                        mem.compute("A_ij", lambda s_, x, y: s_ + x @ y, "A_ij", "S_ik", "A2T_kj")
                        mem.free("S_ik", "A2T_kj")
                    mem.compute("A_ij", np.exp, "A_ij")
                    mem.store("A_ij", "A", bn(i), bn(j))
                    mem.compute("l_i", lambda l_, a_: l_ + a_.sum(axis=1), "l_i", "A_ij")
                    mem.free("A_ij")
                mem.store("l_i", "l", bn(i))
                for j in range(In):
                    mem.alloc("f_ij", (rows, bn(j).stop - bn(j).start))
                    mem.load("A_ij", "A", bn(i), bn(j))
                    mem.compute("f_ij", lambda f_, l_, a_: f_ + a_ / l_[:, None], "f_ij", "l_i", "A_ij")
                    mem.store("f_ij", "f", bn(i), bn(j))
                    mem.free("A_ij", "f_ij")
                mem.free("l_i")
    for i in range(In):                                                            # O = f h
        for j in range(Id):
            mem.alloc("O_ij", (bn(i).stop - bn(i).start, bd(j).stop - bd(j).start))
            for k in range(In):
                mem.load("f_ik", "f", bn(i), bn(k)), mem.load("h_kj", "h", bn(k), bd(j))
                mem.compute("O_ij", lambda o, f_, h_: o + f_ @ h_, "O_ij", "f_ik", "h_kj")
                mem.free("f_ik", "h_kj")
            mem.store("O_ij", "O", bn(i), bd(j))
            mem.free("O_ij")
    return mem.slow["O"]
