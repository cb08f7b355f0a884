"""The paper's Algorithms 7-9 (Appendix D) on :class:`TwoLevelMemory`, and a FlashAttention-2-order
variant of Algorithm 8.

Block sizes (both Algorithms 7 and 8, line 2): ``B_r = min(ceil(M/4d), d)``, ``B_c = ceil(M/4d)``.
Inputs in ``mem.slow``: A1, A2, A3, O, dO (n x d), X, Y (d x d), l (n).

Two omissions of the text are filled in (noted at the lines): Algorithm 8 never deletes ``h_j``
(read at line 11) nor ``p_{i,j}`` (made at line 17); both are deleted at line 22 with ``T_{*,j}``
and ``A_{2,j}``. Without that the fast memory would grow by B_c·d + B_r·B_c words per inner step.

The paper's block sizes do not fit a fast memory of exactly ``M`` words (Algorithm 8 keeps g,
d x d, plus about 5M/4 words of blocks resident): :func:`~.closed_form.large_cache_peak` gives the
exact high-water mark, and the runner uses it as the capacity.
"""
from __future__ import annotations

import numpy as np

from sparse_io_attn.experiments.pebble.executor import TwoLevelMemory, block, num_blocks


def pebble_large_cache_blocks(n: int, d: int, M: int) -> tuple[int, int]:
    """``(B_r, B_c) = (min(ceil(M/4d), d), ceil(M/4d))``."""
    if M < 1:
        raise ValueError(f"M must be positive, got {M}")
    bc = -(-M // (4 * d))
    return min(bc, d), bc


def _rows(s: slice) -> int:
    return s.stop - s.start


def algorithm7(mem: TwoLevelMemory, M: int) -> None:
    """Phase 1: S = A1 X, h = A3 Y (writes S, h)."""
    n, d = mem.slow["A1"].shape
    Br, Bc = pebble_large_cache_blocks(n, d, M)
    Tr, Tc = num_blocks(n, Br), num_blocks(d, Bc)
    mem.allocate("S", (n, d)), mem.allocate("h", (n, d))
    for i in range(Tr):
        r = block(i, Br, n)
        mem.load("A1_i", "A1", r), mem.load("A3_i", "A3", r)                       # line 7
        for j in range(Tc):
            c = block(j, Bc, d)
            mem.load("X_j", "X", slice(None), c), mem.alloc("S_ij", (_rows(r), _rows(c)))   # line 9
            mem.compute("S_ij", lambda s, a, x: s + a @ x, "S_ij", "A1_i", "X_j")
            mem.store("S_ij", "S", r, c)
            mem.free("S_ij", "X_j")
            mem.load("Y_j", "Y", slice(None), c), mem.alloc("h_ij", (_rows(r), _rows(c)))   # line 12
            mem.compute("h_ij", lambda h, a, y: h + a @ y, "h_ij", "A3_i", "Y_j")
            mem.store("h_ij", "h", r, c)
            mem.free("h_ij", "Y_j")
        mem.free("A1_i", "A3_i")                                                   # line 16


def _tile_p(mem, i_keys, j_keys):
    """Lines 11-18 of Algorithm 8 for one (i, j): leaves p_ij resident, frees A_ij, f_ij, q_ij."""
    S, dO, l, v = i_keys
    h, A2 = j_keys
    mem.compute("q_ij", lambda do, hj: do @ hj.T, dO, h)                           # line 12
    mem.compute("A_ij", lambda s, a2: s @ a2.T, S, A2)                              # lines 13-14
    mem.compute("A_ij", np.exp, "A_ij")                                            # line 15
    mem.compute("f_ij", lambda l_, a: a / l_[:, None], l, "A_ij")                  # line 16
    mem.free("A_ij")
    mem.compute("p_ij", lambda f, q, v_: f * q - v_[:, None] * f, "f_ij", "q_ij", v)   # line 18
    mem.free("f_ij", "q_ij")


def algorithm8(mem: TwoLevelMemory, M: int) -> np.ndarray:
    """Phase 2 as written: outer loop over query row blocks i, inner over key blocks j."""
    n, d = mem.slow["A1"].shape
    Br, Bc = pebble_large_cache_blocks(n, d, M)
    Tr, Tc = num_blocks(n, Br), num_blocks(n, Bc)
    mem.allocate("g", (d, d))
    mem.alloc("g", (d, d))                                                         # line 5
    for i in range(Tr):
        r = block(i, Br, n)
        for name in ("S", "O", "dO", "A1", "l"):                                   # line 7
            mem.load(f"{name}_i", name, r)
        mem.compute("v_i", lambda do, o: (do * o).sum(axis=1), "dO_i", "O_i")      # line 8
        mem.free("O_i")                                                            # line 9
        for j in range(Tc):
            c = block(j, Bc, n)
            mem.load("h_j", "h", c)                                                # line 11
            mem.alloc("q_ij", (_rows(r), _rows(c)))
            mem.load("A2_j", "A2", c)                                              # line 13
            mem.alloc("A_ij", (_rows(r), _rows(c)))
            # line 15 initializes f_ij next to A_ij (both resident, as the text orders it)
            mem.alloc("f_ij", (_rows(r), _rows(c)))
            _tile_p(mem, ("S_i", "dO_i", "l_i", "v_i"), ("h_j", "A2_j"))
            mem.alloc("T_j", (d, _rows(c)))                                        # line 19
            mem.compute("T_j", lambda t, a1, p: t + a1.T @ p, "T_j", "A1_i", "p_ij")   # line 20
            mem.compute("g", lambda g, t, a2: g + t @ a2, "g", "T_j", "A2_j")      # line 21
            mem.free("T_j", "A2_j", "h_j", "p_ij")     # line 22 (+ h_j, p_ij: never deleted in the text)
        mem.free("S_i", "A1_i", "dO_i", "l_i", "v_i")                             # line 24
    mem.store("g", "g")                                                            # line 26
    mem.free("g")
    return mem.slow["g"]


def algorithm8_fa2(mem: TwoLevelMemory, M: int) -> np.ndarray:
    """Phase 2 in FlashAttention-2's loop order (a variant, not in the paper).

    A pre-pass writes v = (dO o O) 1 (FlashAttention-2's ``D``); then the outer loop runs over key
    blocks j (A2_j, h_j and the accumulator T_{*,j} stay resident) and the inner loop over query
    blocks i. Query-side blocks are re-read ceil(n / B_c) times, and B_c = ceil(M/4d) is not
    capped, so the traffic keeps falling as 1/M after M > 4d^2, where Algorithm 8 plateaus.
    The per-tile arithmetic is Algorithm 8's lines 11-20; g += T_{*,j} A2_j once per key block.
    """
    n, d = mem.slow["A1"].shape
    Br, Bc = pebble_large_cache_blocks(n, d, M)
    Tr, Tc = num_blocks(n, Br), num_blocks(n, Bc)
    mem.allocate("g", (d, d)), mem.allocate("v", (n,))
    for i in range(Tr):                                                            # pre-pass
        r = block(i, Br, n)
        mem.load("O_i", "O", r), mem.load("dO_i", "dO", r)
        mem.compute("v_i", lambda do, o: (do * o).sum(axis=1), "dO_i", "O_i")
        mem.store("v_i", "v", r)
        mem.free("O_i", "dO_i", "v_i")
    mem.alloc("g", (d, d))
    for j in range(Tc):
        c = block(j, Bc, n)
        mem.load("A2_j", "A2", c), mem.load("h_j", "h", c)
        mem.alloc("T_j", (d, _rows(c)))
        for i in range(Tr):
            r = block(i, Br, n)
            for name in ("S", "dO", "A1", "l", "v"):
                mem.load(f"{name}_i", name, r)
            mem.alloc("q_ij", (_rows(r), _rows(c))), mem.alloc("A_ij", (_rows(r), _rows(c)))
            mem.alloc("f_ij", (_rows(r), _rows(c)))
            _tile_p(mem, ("S_i", "dO_i", "l_i", "v_i"), ("h_j", "A2_j"))
            mem.compute("T_j", lambda t, a1, p: t + a1.T @ p, "T_j", "A1_i", "p_ij")
            mem.free("p_ij", "S_i", "dO_i", "A1_i", "l_i", "v_i")
        mem.compute("g", lambda g, t, a2: g + t @ a2, "g", "T_j", "A2_j")
        mem.free("T_j", "A2_j", "h_j")
    mem.store("g", "g")
    mem.free("g")
    return mem.slow["g"]


def algorithm9(mem: TwoLevelMemory, M: int, variant: str = "faithful") -> np.ndarray:
    """Algorithm 9 (large cache): Algorithm 7 then Algorithm 8 (``variant="faithful"``) or its
    FlashAttention-2-order variant (``variant="fa2"``); returns g."""
    if variant not in ("faithful", "fa2"):
        raise ValueError(f"variant must be 'faithful' or 'fa2', got {variant!r}")
    algorithm7(mem, M)
    return algorithm8(mem, M) if variant == "faithful" else algorithm8_fa2(mem, M)
