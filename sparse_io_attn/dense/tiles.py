"""Tile sizes of the dense kernels, chosen from the fast-memory size ``M`` (in words), and each
kernel's per-program working set in words.

Words are elements of the input dtype (fp32 accumulators and the fp32 ``lse``/``v`` vectors count one
word each). ``HEAD_DIM`` = the head dimension ``d`` rounded up to a power of two, at least 16, the
smallest ``tl.dot`` operand (:func:`~sparse_io_attn._triton.shapes.padded_dim`); tiles are held at
that padded width, so the working sets count it.

Small cache (Algorithm 6, Appendix C): square ``B x B`` tiles, ``B`` = the largest power of two
``<= sqrt(M/4)``; every small-cache kernel holds at most ``3B^2 + 2B <= 4B^2 <= M`` words.

Large cache (Algorithms 7-9, Appendix D): the paper's ``B_c = M/(4d)`` and ``B_r = min(M/(4d), d)``
rounded down to powers of two (``B_r`` at least 16 even when ``d < 16``: ``tl.dot``'s minimum).
The paper's sizes ignore the ``d x d`` gradient ``g`` kept in fast
memory by Algorithm 8 and the ``B_r x B_c`` score tiles, so they can overflow ``M`` by a constant
factor; :func:`large_cache_blocks` starts from them and halves the longer side until the declared
working set fits ``M`` (a ``ValueError`` names the smallest ``M`` that works).
"""
from __future__ import annotations

import math

from sparse_io_attn._triton.shapes import MIN_TILE, padded_dim

#: ``tl.dot`` needs every tile side >= 16.
MIN_BLOCK = MIN_TILE

#: The large-cache kernels and their tile roles: ``(long side, short side)`` are the paper's
#: ``(B_c, B_r)``; which loop dimension each one tiles is documented per kernel.
LARGE_KERNELS = ("fwd.attn", "large.phase1", "large.phase2", "large.dq", "large.dkdh", "large.atb",
                 "large.delta")
SMALL_KERNELS = ("small.matmul", "small.softmax", "small.phase3")


def pow2_floor(x: float) -> int:
    """Largest power of two ``<= x`` (``x >= 1``)."""
    return 1 << int(math.floor(math.log2(x))) if x >= 1 else 0


def working_set_words(kernel: str, d: int, *, B: int | None = None, long: int | None = None,
                      short: int | None = None) -> int:
    """Words one program of ``kernel`` holds at its peak (tiles, accumulators, vectors).

    Small-cache kernels take ``B``; large-cache kernels take ``long`` (the paper's ``B_c``) and
    ``short`` (``B_r``). Tile roles per kernel:

    * ``small.matmul``: A tile, B tile, fp32 accumulator: ``3B^2``.
    * ``small.softmax``: S tile, A2 tile, score accumulator, row max and row sum: ``3B^2 + 2B``.
    * ``small.phase3``: f and q tiles, p tile, row vector v: ``3B^2 + B``.
    * ``fwd.attn``: query rows ``short x D`` and output accumulator, key and value tiles
      ``long x D``, score tile ``short x long``, row max and sum.
    * ``large.phase1`` (Algorithm 7): input row block ``short x D``, weight column block
      ``D x min(long, D)``, output tile ``short x min(long, D)``.
    * ``large.phase2`` (Algorithm 8): ``S_i, dO_i, A1_i, dS_i`` (``short x D`` each), ``l_i, v_i``,
      ``h_j, A2_j`` (``long x D``), score/p and q tiles (``short x long``), ``T_{*,j}``
      (``D x long``) and ``g`` (``D x D``). ``O_i`` is dropped (after ``v_i``) before the inner loop.
    * ``large.dq`` (FlashAttention-2 loop order, rows outer): ``S_i, dO_i, dS_i`` (``long x D``),
      ``l_i, v_i``, ``h_j, A2_j`` (``short x D``), two ``long x short`` tiles.
    * ``large.dkdh`` (keys outer): ``A2_j, h_j, dA2_j, dh_j`` (``long x D``), ``S_i, dO_i``
      (``short x D``), ``l_i, v_i``, two ``short x long`` tiles.
    * ``large.atb`` (``A^T B`` into a ``D x D`` output): accumulator ``D x min(long, D)``, row blocks
      ``short x D`` and ``short x min(long, D)``.
    * ``large.delta``: ``O_i, dO_i`` (``short x D``) and ``v_i``.
    """
    D = padded_dim(d)
    if kernel in SMALL_KERNELS:
        if B is None:
            raise TypeError(f"working_set_words({kernel!r}) needs B")
        return {"small.matmul": 3 * B * B, "small.softmax": 3 * B * B + 2 * B,
                "small.phase3": 3 * B * B + B}[kernel]
    if kernel not in LARGE_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {SMALL_KERNELS + LARGE_KERNELS}")
    if long is None or short is None:
        raise TypeError(f"working_set_words({kernel!r}) needs long and short")
    L, s = long, short
    Lc = min(L, D)
    return {
        "fwd.attn": 2 * s * D + 2 * L * D + s * L + 2 * s,
        "large.phase1": s * D + D * Lc + s * Lc,
        "large.phase2": 4 * s * D + 2 * s + 2 * L * D + 2 * s * L + D * L + D * D,
        "large.dq": 3 * L * D + 2 * L + 2 * s * D + 2 * L * s,
        "large.dkdh": 4 * L * D + 2 * s * D + 2 * s + 2 * s * L,
        "large.atb": D * Lc + s * D + s * Lc,
        "large.delta": 2 * s * D + s,
    }[kernel]


def small_cache_block(M: int) -> int:
    """Algorithm 6's ``B``: the largest power of two ``<= sqrt(M/4)``; at least 16."""
    M = _check_M(M)
    B = pow2_floor(math.isqrt(M // 4)) if M >= 4 else 0
    if B < MIN_BLOCK:
        raise ValueError(f"M = {M} words is too small for the small-cache kernels: B = largest power "
                         f"of two <= sqrt(M/4) must be >= {MIN_BLOCK} for tl.dot, so M must be at "
                         f"least {4 * MIN_BLOCK * MIN_BLOCK} words")
    return B


def large_cache_blocks(kernel: str, M: int, d: int, *, min_block: int = MIN_BLOCK) -> tuple[int, int]:
    """``(long, short)`` tile sides of a large-cache kernel for fast memory ``M`` words.

    Start from the paper's ``long = B_c = M/(4d)``, ``short = B_r = min(M/(4d), d)`` rounded down
    to powers of two, then halve the longer side (both when equal) until
    :func:`working_set_words` ``<= M``. Raises ``ValueError`` with the smallest workable ``M``.
    ``min_block`` < 16 is for the traffic model only (``tl.dot`` needs 16): it extends a
    FlashAttention-style schedule to small ``M`` for comparison.
    """
    M = _check_M(M)
    D = padded_dim(d)
    long = pow2_floor(M / (4 * d)) if M >= 4 * d else 0
    short = min(long, max(pow2_floor(d), min_block)) if long else 0  # B_r <= d, but >= the tl.dot minimum
    if kernel in ("large.phase1", "large.atb"):
        long = min(long, D)
    while long >= min_block and short >= min_block and \
            working_set_words(kernel, d, long=long, short=short) > M:
        if long > short:
            long //= 2
        else:
            long //= 2
            short //= 2
    if long < min_block or short < min_block:
        need = working_set_words(kernel, d, long=min_block, short=min_block)
        need = max(need, 4 * d * min_block)
        raise ValueError(f"M = {M} words is too small for kernel {kernel!r} at d = {d}: its "
                         f"{min_block}x{min_block} tiles need at least {need} words (M >= 4*d*"
                         f"{min_block} and the working set must fit); use a larger M or the "
                         f"small-cache kernels (regime='small')")
    return long, short


def min_large_cache_M(d: int, variant: str = "faithful") -> int:
    """Smallest ``M`` (words, a multiple of 16) at which every kernel of the large-cache backward
    ``variant`` ("faithful" or "fa2") can run."""
    kernels = large_cache_kernels(variant)
    M = 4 * d * MIN_BLOCK
    while True:  # terminates: at M >= 4 d * 16 + working_set(16, 16) every kernel fits
        try:
            for k in kernels:
                large_cache_blocks(k, M, d)
            return M
        except ValueError:
            M += MIN_BLOCK


def large_cache_kernels(variant: str) -> tuple[str, ...]:
    """The tiled kernels the large-cache backward ``variant`` launches."""
    if variant == "faithful":
        return ("large.phase1", "large.delta", "large.phase2", "large.dkdh", "large.atb")
    if variant == "fa2":
        return ("large.phase1", "large.delta", "large.dq", "large.dkdh", "large.atb")
    raise ValueError(f"variant must be 'faithful' or 'fa2', got {variant!r}")


def _check_M(M) -> int:
    if isinstance(M, bool) or not isinstance(M, int):
        raise TypeError(f"M must be an int number of words, got {type(M).__name__}")
    if M <= 0:
        raise ValueError(f"M must be a positive number of words, got {M}")
    return M


def forward_blocks(kernel: str, M: int, d: int) -> tuple[int, int]:
    """Tiles of the forward's kernels (``fwd.proj`` uses ``large.phase1``'s rule, ``fwd.attn`` its
    own): :func:`large_cache_blocks`, or the smallest ``16 x 16`` tiles when ``M`` is below what
    they need (the forward then holds more than ``M`` words; the small-cache backward still runs
    within ``M``)."""
    try:
        return large_cache_blocks(kernel, M, d)
    except ValueError:
        _check_M(M)
        return MIN_BLOCK, MIN_BLOCK
