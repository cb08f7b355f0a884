"""Exact word counts of Algorithms 1 and 6-9, derived from the algorithm text (Appendices C, D).

Notation: ``n`` sequence length, ``d`` head dimension, ``M`` fast-memory words. Blocks along an
axis of length ``L`` with size ``b`` number ``ceil(L/b)`` and cover the axis exactly once, so a
loop that reads every block of an ``n x d`` matrix once per outer iteration moves ``nd`` words per
outer iteration, whether or not ``b`` divides ``L``.

Algorithm 6 (small cache), ``B = floor(sqrt(M/4))``, ``I = ceil(n/B)``, ``J = ceil(d/B)``:

    Phase 1 (Alg. 2): read A1 nd*J, X d^2*I; write S nd; read S nd*I, A2 nd*I; write A n^2;
                      read A n^2; write f n^2
    Phase 2 (Alg. 3): read A3 nd*J, Y d^2*I; write h nd; read dO nd*I, h nd*I; write q n^2
    Phase 3 (Alg. 4): read f, q twice: 4n^2; write p n^2
    Phase 4 (Alg. 5): read A1 nd*I, p n^2*J; write T nd; read T nd*J, A2 nd*J; write g d^2
    reads  = 5n^2 + n^2*J + 5nd*I + 4nd*J + 2d^2*I
    writes = 4n^2 + 3nd + d^2
    M-independent part (n x n matrices A, f, q, p written/read outside the blocked products, and
    the single writes of S, h, T, g): 9n^2 + 3nd + d^2
    peak (b_n = min(B, n), b_d = min(B, d)) = max(2 b_n b_d + b_d^2, b_n + b_n^2 + 2 b_n b_d, b_n + 3 b_n^2)

Small-cache forward (Saha & Ye's schedule on Algorithm 2's tiles, :func:`~.algorithm6.small_cache_forward`):

    S = A1 X: read A1 nd*J, X d^2*I; write S nd
    scores (Alg. 2 lines 15-35): read S nd*I, A2 nd*I; write A n^2, l n; read A n^2; write f n^2
    h = A3 Y: read A3 nd*J, Y d^2*I; write h nd
    O = f h: read f n^2*J, h nd*I; write O nd
    reads  = n^2 + n^2*J + 3nd*I + 2nd*J + 2d^2*I
    writes = 2n^2 + 3nd + n
    M-independent part: 3n^2 + 3nd + n
    peak = max(2 b_n b_d + b_d^2, b_n + b_n^2 + 2 b_n b_d, b_n + 2 b_n^2)

Algorithm 9 (large cache), ``B_r = min(ceil(M/4d), d)``, ``B_c = ceil(M/4d)``, ``T_r = ceil(n/B_r)``,
``T_c = ceil(n/B_c)``, ``r = min(B_r, n)``, ``c = min(B_c, n)``, ``c1 = min(B_c, d)``:

    Alg. 7: read A1, A3 once 2nd, X, Y once per row block 2d^2*T_r; write S, h 2nd
            peak 2rd + d*c1 + r*c1
    Alg. 8 (faithful): read S, O, dO, A1 4nd, l n, h and A2 once per row block 2nd*T_r; write g d^2
            peak d^2 + 3rd + 2r + max(rd, 2cd + 3rc, 3cd + rc)
    Alg. 8, FlashAttention-2 order ("fa2"): pre-pass read O, dO 2nd, write v n; read A2, h once 2nd;
            per key block read S, dO, A1 3nd and l, v 2n: T_c*(3nd + 2n); write g d^2
            peak max(2rd + r, d^2 + 3cd + 3rd + 2r + 3rc)
    faithful total = 8nd + n + d^2 + 2*T_r*(nd + d^2)   -> for M >= 4d^2, T_r = ceil(n/d): a plateau
    fa2 total      = 8nd + n + d^2 + 2d^2*T_r + T_c*(3nd + 2n)   -> falls as 1/M until B_c >= n

Algorithm 1 (no cache): reads 4nd + 2d^2, writes d^2, peak max(4nd + d^2 + n^2, 4nd + 2n^2,
2nd + 3n^2, 2nd + 2n^2 + n).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparse_io_attn.experiments.pebble.algorithm9 import pebble_large_cache_blocks
from sparse_io_attn.experiments.pebble.algorithm6 import pebble_small_cache_block


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class IOCount:
    """Words read and written, and the fast memory's high-water mark, of one algorithm run."""
    reads: int
    writes: int
    peak: int

    @property
    def total(self) -> int:
        return self.reads + self.writes

    def __add__(self, other: "IOCount") -> "IOCount":
        return IOCount(self.reads + other.reads, self.writes + other.writes, max(self.peak, other.peak))


def _check(n, d, M):
    for name, v in (("n", n), ("d", d), ("M", M)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def algorithm1_counts(n: int, d: int) -> IOCount:
    return IOCount(4 * n * d + 2 * d * d, d * d,
                   max(4 * n * d + d * d + n * n, 4 * n * d + 2 * n * n, 2 * n * d + 3 * n * n,
                       2 * n * d + 2 * n * n + n))


def small_cache_counts(n: int, d: int, M: int) -> IOCount:
    """Algorithm 6, exactly (see the module docstring)."""
    _check(n, d, M)
    B = pebble_small_cache_block(M)
    I, J = _ceil(n, B), _ceil(d, B)
    reads = 5 * n * n + n * n * J + 5 * n * d * I + 4 * n * d * J + 2 * d * d * I
    writes = 4 * n * n + 3 * n * d + d * d
    bn, bd = min(B, n), min(B, d)
    peak = max(2 * bn * bd + bd * bd, bn + bn * bn + 2 * bn * bd, bn + 3 * bn * bn)
    return IOCount(reads, writes, peak)


def small_cache_m_independent(n: int, d: int) -> int:
    """The part of Algorithm 6's traffic that does not depend on M: 9n^2 + 3nd + d^2."""
    return 9 * n * n + 3 * n * d + d * d


def small_cache_io(n: int, d: int, M: int) -> int:
    """Words Algorithm 6 moves (reads + writes)."""
    return small_cache_counts(n, d, M).total


def small_forward_counts(n: int, d: int, M: int) -> IOCount:
    """The small-cache forward, exactly (see the module docstring)."""
    _check(n, d, M)
    B = pebble_small_cache_block(M)
    I, J = _ceil(n, B), _ceil(d, B)
    reads = n * n + n * n * J + 3 * n * d * I + 2 * n * d * J + 2 * d * d * I
    writes = 2 * n * n + 3 * n * d + n
    bn, bd = min(B, n), min(B, d)
    peak = max(2 * bn * bd + bd * bd, bn + bn * bn + 2 * bn * bd, bn + 2 * bn * bn)
    return IOCount(reads, writes, peak)


def small_forward_io(n: int, d: int, M: int) -> int:
    """Words the small-cache forward moves (reads + writes)."""
    return small_forward_counts(n, d, M).total


def small_forward_m_independent(n: int, d: int) -> int:
    """The part of the small-cache forward's traffic that does not depend on M: 3n^2 + 3nd + n."""
    return 3 * n * n + 3 * n * d + n


def algorithm7_counts(n: int, d: int, M: int) -> IOCount:
    _check(n, d, M)
    Br, Bc = pebble_large_cache_blocks(n, d, M)
    Tr = _ceil(n, Br)
    r, c1 = min(Br, n), min(Bc, d)
    return IOCount(2 * n * d + 2 * d * d * Tr, 2 * n * d, 2 * r * d + d * c1 + r * c1)


def algorithm8_counts(n: int, d: int, M: int, variant: str = "faithful") -> IOCount:
    _check(n, d, M)
    Br, Bc = pebble_large_cache_blocks(n, d, M)
    Tr, Tc = _ceil(n, Br), _ceil(n, Bc)
    r, c = min(Br, n), min(Bc, n)
    if variant == "faithful":
        return IOCount(4 * n * d + n + 2 * n * d * Tr, d * d,
                       d * d + 3 * r * d + 2 * r + max(r * d, 2 * c * d + 3 * r * c, 3 * c * d + r * c))
    if variant == "fa2":
        return IOCount(2 * n * d + 2 * n * d + Tc * (3 * n * d + 2 * n), n + d * d,
                       max(2 * r * d + r, d * d + 3 * c * d + 3 * r * d + 2 * r + 3 * r * c))
    raise ValueError(f"variant must be 'faithful' or 'fa2', got {variant!r}")


def large_cache_counts(n: int, d: int, M: int, variant: str = "faithful") -> IOCount:
    """Algorithm 9 = Algorithm 7 + Algorithm 8 (``variant`` "faithful" or "fa2"), exactly."""
    return algorithm7_counts(n, d, M) + algorithm8_counts(n, d, M, variant)


def large_cache_io(n: int, d: int, M: int, variant: str = "faithful") -> int:
    """Words Algorithm 9 moves (reads + writes); ``variant="fa2"``: FlashAttention-2 loop order."""
    return large_cache_counts(n, d, M, variant).total


def large_cache_peak(n: int, d: int, M: int, variant: str = "faithful") -> int:
    """Fast-memory words Algorithm 9 holds at its high-water mark with the paper's block sizes."""
    return large_cache_counts(n, d, M, variant).peak

