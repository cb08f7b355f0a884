"""The paper's I/O lower bounds as numbers.

All quantities are in *words* (matrix elements) for a fast memory of ``M`` words; ``Bound.bytes``
converts with a dtype. The paper's results are asymptotic (Θ/Ω) **with constants unstated**: the
``value_words`` of a :class:`Bound` is the asymptotic expression evaluated with every constant set
to 1. It is a scale, not a certified floor. Two things make it usable against measurements:

* ``compulsory_words``: the traffic no algorithm avoids (each input read once, each output written
  once). At realistic sizes the unit-constant bound can sit *below* it; compare a measurement with
  ``max(compulsory, bound)`` (:attr:`Bound.floor_words`) and say which binds.
* ``explicit_constant``: lower bounds with proven constants for the matrix-product part, where
  known, each with its citation.

Functions: :func:`dense_backward` (Theorem 1.1), :func:`dense_forward` (Saha & Ye 2024),
:func:`sparse` (Theorem 4.5 = F.3/F.4, dividing point of Remark 4.7).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sparse_io_attn.bounds.units import dtype_name, itemsize, parse_memory

#: Term names shared by the calculator, the pebble closed forms and the benchmarks.
LARGE_CACHE = "large_cache"   # the 1/M term, binds when M >= dividing point
SMALL_CACHE = "small_cache"   # the 1/sqrt(M) term, binds when M < dividing point

_KWASNIEWSKI = ("Kwasniewski et al., 'Red-blue pebbling revisited' (COSMA), SC'19, arXiv 1908.09606, "
                "Theorem 1: Q >= 2mnk/sqrt(M) + mn for an m x k by k x n product")
_SMITH = ("Smith, Lowery, Langou, van de Geijn, 'A tight I/O lower bound for matrix multiplication', "
          "arXiv 1702.02017: Q >= 2mnk/sqrt(M) - 2M")


@dataclass(frozen=True)
class Bound:
    """One evaluated lower bound (words). See the module docstring for what the value means.

    ``terms``: ``{"large_cache": ..., "small_cache": ...}``; ``binding``: the smaller term (the
    bound is their min); ``regime``: ``"small"`` if ``M`` is below ``crossover_M`` (the dividing
    point where the two terms are equal), else ``"large"``; ``explicit_constant``:
    ``{name: (words, citation)}``; ``heads``: independent (batch, head) problems summed in every
    number.
    """
    kind: str
    M: int
    value_words: float
    terms: dict
    binding: str
    regime: str
    crossover_M: float
    theorem: str
    compulsory_words: int
    compulsory_terms: dict = field(default_factory=dict)
    explicit_constant: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    heads: int = 1
    dtype: str | None = None
    _itemsize: int | None = None
    note: str = ""

    @property
    def floor_words(self) -> float:
        """``max(compulsory_words, value_words)``: what a measurement is compared against."""
        return max(float(self.compulsory_words), self.value_words)

    @property
    def floor_binding(self) -> str:
        """``"compulsory"`` or ``"bound"``: which of the two makes :attr:`floor_words`."""
        return "compulsory" if self.compulsory_words >= self.value_words else "bound"

    def bytes(self, dtype=None) -> float:
        """``value_words`` in bytes of ``dtype`` (default: the dtype the bound was built with)."""
        return self.value_words * self._size(dtype)

    def compulsory_bytes(self, dtype=None) -> int:
        return self.compulsory_words * self._size(dtype)

    def floor_bytes(self, dtype=None) -> float:
        return self.floor_words * self._size(dtype)

    def _size(self, dtype) -> int:
        if dtype is not None:
            return itemsize(dtype)
        if self._itemsize is None:
            raise ValueError("this Bound was built without a dtype; pass one, e.g. "
                             "bound.bytes(torch.bfloat16)")
        return self._itemsize

    def to_dict(self) -> dict:
        out = {
            "kind": self.kind, "theorem": self.theorem, "M_words": self.M, "heads": self.heads,
            "params": dict(self.params), "value_words": self.value_words, "terms": dict(self.terms),
            "binding": self.binding, "regime": self.regime, "crossover_M": self.crossover_M,
            "compulsory_words": self.compulsory_words, "compulsory_terms": dict(self.compulsory_terms),
            "floor_words": self.floor_words, "floor_binding": self.floor_binding,
            "explicit_constant": {k: {"words": w, "citation": c} for k, (w, c) in self.explicit_constant.items()},
            "dtype": self.dtype, "constants": "unit (the paper states Theta/Omega without constants)",
            "note": self.note,
        }
        if self._itemsize is not None:
            out.update(value_bytes=self.bytes(), compulsory_bytes=self.compulsory_bytes(),
                       floor_bytes=self.floor_bytes())
        return out

    def __str__(self) -> str:
        p = ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in self.params.items())
        unit = f" ({self.dtype}, {self._itemsize} B/word)" if self._itemsize else ""
        lines = [f"{self.kind} lower bound, {self.theorem}",
                 f"  {p}, M={self.M:,} words{unit}" + (f", heads={self.heads}" if self.heads > 1 else ""),
                 f"  regime: {self.regime} cache (dividing point M = {self.crossover_M:,.1f} words)"]
        for name, w in self.terms.items():
            mark = "  <- binds" if name == self.binding else ""
            lines.append(f"  {name:>12} term: {w:,.4g} words{self._b(w)}{mark}")
        lines.append(f"  bound (unit constants): {self.value_words:,.4g} words{self._b(self.value_words)}")
        lines.append(f"  compulsory traffic:     {self.compulsory_words:,} words{self._b(self.compulsory_words)}")
        lines.append(f"  compare against max(compulsory, bound) = {self.floor_words:,.4g} words "
                     f"({self.floor_binding} binds)")
        for name, (w, _cite) in self.explicit_constant.items():
            lines.append(f"  explicit constant, {name}: {w:,.4g} words (citation in to_dict())")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def _b(self, words) -> str:
        return f" = {words * self._itemsize:,.4g} B" if self._itemsize else ""


def _sqrt(x: int) -> float:
    """``sqrt`` of a non-negative int, exact when ``x`` is a perfect square (big ints included)."""
    r = math.isqrt(x)
    return float(r) if r * r == x else math.sqrt(x)


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def _nonneg_count(value, what: str) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int count, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{what} is a count of nonzeros and cannot be negative, got {value}")
    return value


def _finish(kind, M, terms, crossover, theorem, compulsory_terms, explicit, params, heads, dtype, note=""):
    binding = min(terms, key=lambda k: (terms[k], k != LARGE_CACHE))
    scaled = {k: v * heads for k, v in terms.items()}
    return Bound(
        kind=kind, M=M, value_words=scaled[binding], terms=scaled, binding=binding,
        regime="small" if M < crossover else "large", crossover_M=crossover, theorem=theorem,
        compulsory_words=heads * sum(compulsory_terms.values()),
        compulsory_terms={k: heads * v for k, v in compulsory_terms.items()},
        explicit_constant={k: (w * heads, c) for k, (w, c) in explicit.items()},
        params=params, heads=heads, dtype=dtype_name(dtype),
        _itemsize=None if dtype is None else itemsize(dtype), note=note)


def _qk_product_bounds(n_q: int, n_k: int, d: int, M: int) -> dict:
    """Explicit-constant bounds for the n_q x d by d x n_k product Q K^T.

    The first two bound the standalone product (its n_q*n_k output written). Attention need not
    write that product; the third applies to attention through the reduction of Theorem E.10 (an
    attention algorithm plus an output and a reload of each product entry, 2*n_q*n_k I/Os,
    computes the product): Q_attn >= 2 n_q n_k d / sqrt(M) + n_q n_k - 2 n_q n_k. It is
    informative only in the small-cache regime (sqrt(M) < d/2); elsewhere it is 0."""
    mnk = n_q * n_k * d
    root = _sqrt(M)
    return {
        "QK^T product alone, Kwasniewski 2019": (2 * mnk / root + n_q * n_k, _KWASNIEWSKI),
        "QK^T product alone, Smith 2019": (max(0.0, 2 * mnk / root - 2 * M), _SMITH),
        "attention via Theorem E.10 reduction": (
            max(0.0, 2 * mnk / root - n_q * n_k),
            "derived here: Kwasniewski 2019 Theorem 1 minus the 2*n^2 I/Os of the reduction in the "
            "paper's Theorem E.10 proof"),
    }


def dense_backward(n: int, d: int, M, *, dtype=None, heads: int = 1, form: str = "qkv") -> Bound:
    """Theorem 1.1: attention backward needs Θ(min{(n²d² + nd³)/M, (n²d + nd²)/√M}) words.

    Terms: ``large_cache`` = (n²d² + nd³)/M, ``small_cache`` = (n²d + nd²)/√M; since
    n²d² + nd³ = d·(n²d + nd²) they are equal exactly at the dividing point ``M = d²``
    (``regime`` "small" for M < d², "large" otherwise). Constants are unstated in the paper; the
    value uses 1.

    ``M``: words, or a size string with ``dtype`` (``"228KiB"``). ``heads``: number of independent
    (batch, head) problems (every number is multiplied). ``form`` sets the compulsory traffic:
    ``"qkv"`` (the library's kernels: read q, k, v, o, do and lse, write dq, dk, dv: 8nd + n) or
    ``"paper"`` (Definition 3.2: read A1, A2, A3, dO, X, Y, write g = dL/dX: 4nd + 3d²).
    """
    n, d = _positive_int(n, "n"), _positive_int(d, "d")
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    terms = {LARGE_CACHE: (n * n * d * d + n * d ** 3) / M,
             SMALL_CACHE: (n * n * d + n * d * d) / _sqrt(M)}
    if form == "qkv":
        compulsory = {"read q,k,v,o,do": 5 * n * d, "read lse": n, "write dq,dk,dv": 3 * n * d}
    elif form == "paper":
        compulsory = {"read A1,A2,A3,dO": 4 * n * d, "read X,Y": 2 * d * d, "write g": d * d}
    else:
        raise ValueError(f"form must be 'qkv' or 'paper', got {form!r}")
    return _finish("dense backward", M, terms, float(d * d),
                   "Theorem 1.1 (Theorems 4.1-4.4 / D.5, E.9, C.12, E.10), arXiv 2410.09397",
                   compulsory, _qk_product_bounds(n, n, d, M), {"n": n, "d": d, "form": form}, heads, dtype)


def dense_forward(n: int, d: int, M, *, dtype=None, heads: int = 1, form: str = "qkv") -> Bound:
    """Saha & Ye 2024 (ICML, arXiv 2402.07443): attention forward needs
    Θ(min{n²d²/M, n²d/√M}) words; the terms are equal at ``M = d²``. Constants unstated (value
    uses 1). Compulsory (``form="qkv"``): read q, k, v, write o and lse = 4nd + n; ``"paper"``:
    read A1, A2, A3, X, Y, write O = 4nd + 2d².
    """
    n, d = _positive_int(n, "n"), _positive_int(d, "d")
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    terms = {LARGE_CACHE: n * n * d * d / M, SMALL_CACHE: n * n * d / _sqrt(M)}
    if form == "qkv":
        compulsory = {"read q,k,v": 3 * n * d, "write o": n * d, "write lse": n}
    elif form == "paper":
        compulsory = {"read A1,A2,A3": 3 * n * d, "read X,Y": 2 * d * d, "write O": n * d}
    else:
        raise ValueError(f"form must be 'qkv' or 'paper', got {form!r}")
    return _finish("dense forward", M, terms, float(d * d),
                   "Saha & Ye 2024, arXiv 2402.07443 (Theorem 3.1)",
                   compulsory, _qk_product_bounds(n, n, d, M), {"n": n, "d": d, "form": form}, heads, dtype)


def sparse_crossover(Z_A: int, Z_X: int, Z_AX: int, Z_AXA: int) -> float:
    """Remark 4.7: the ``M`` at which the two terms of Theorem 4.5 are equal,
    √M = (Z_A² + Z_A·Z_X) / (Z_A·√Z_AXA + √(Z_A·Z_X·Z_AX)); ``inf`` when the denominator is 0."""
    num = Z_A * Z_A + Z_A * Z_X
    den = Z_A * _sqrt(Z_AXA) + _sqrt(Z_A * Z_X * Z_AX)
    return math.inf if den == 0 else (num / den) ** 2


def sparse(Z_A: int, Z_X: int, Z_AX: int, Z_AXA: int, M, *, n: int | None = None,
           d: int | None = None, dtype=None, heads: int = 1, note: str = "") -> Bound:
    """Theorem 4.5 (= F.3 forward, F.4 backward): sparse attention needs
    Ω(min{(Z_A² + Z_A·Z_X)/M, (Z_A·√Z_AXA + √(Z_A·Z_X·Z_AX))/√M}) words, with
    Z_A = min(nnz A1, nnz A2), Z_X = nnz X, Z_AX = min(nnz A1X, nnz XA2ᵀ), Z_AXA = nnz A1XA2ᵀ
    (:func:`~sparse_io_attn.bounds.nnz_stats` computes them). Dividing point: Remark 4.7
    (:func:`sparse_crossover`); with dense operands this is the dense bound (Remark 4.6).
    Constants unstated (value uses 1).

    Compulsory traffic: reading the operands of A1·X·A2ᵀ once, 2·Z_A + Z_X (a lower estimate, as
    Z_A is the sparser of A1, A2), plus writing the n x d output (n·d) when ``n`` and ``d`` are
    given. ``n`` (and ``d``) also enable the checks Z_AXA <= n², Z_A <= n·d, Z_X <= d².
    ``note`` is carried into the record (e.g. the caveat of a QK-pattern-restricted Z_AXA).

    Scope: the theorem bounds computing the *structural product* A1·X·A2ᵀ of sparse operands. A
    Z_AXA restricted to a QK mask (masked / block-sparse attention, which computes only the kept
    entries) is outside its hypotheses, and the formula is then not a proven lower bound: its
    small-cache term Z_A·√Z_AXA/√M can exceed the traffic of a plain block-sparse kernel.
    """
    Z_A, Z_X = _nonneg_count(Z_A, "Z_A"), _nonneg_count(Z_X, "Z_X")
    Z_AX, Z_AXA = _nonneg_count(Z_AX, "Z_AX"), _nonneg_count(Z_AXA, "Z_AXA")
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    if n is not None:
        n = _positive_int(n, "n")
        if Z_AXA > n * n:
            raise ValueError(f"Z_AXA = {Z_AXA:,} exceeds n^2 = {n * n:,}: A1 X A2^T is n x n, so at "
                             f"most n^2 entries are nonzero; check the counts or n")
    if d is not None:
        d = _positive_int(d, "d")
        if Z_X > d * d:
            raise ValueError(f"Z_X = {Z_X:,} exceeds d^2 = {d * d:,} (X is d x d)")
    if n is not None and d is not None:
        for name, z in (("Z_A", Z_A), ("Z_AX", Z_AX)):
            if z > n * d:
                raise ValueError(f"{name} = {z:,} exceeds n*d = {n * d:,} (the matrix is n x d)")
    terms = {LARGE_CACHE: (Z_A * Z_A + Z_A * Z_X) / M,
             SMALL_CACHE: (Z_A * _sqrt(Z_AXA) + _sqrt(Z_A * Z_X * Z_AX)) / _sqrt(M)}
    compulsory = {"read A1, A2 (>= 2 Z_A)": 2 * Z_A, "read X": Z_X}
    if n is not None and d is not None:
        compulsory["write output (n x d)"] = n * d
    params = {"Z_A": Z_A, "Z_X": Z_X, "Z_AX": Z_AX, "Z_AXA": Z_AXA}
    if n is not None:
        params["n"] = n
    if d is not None:
        params["d"] = d
    return _finish("sparse forward/backward", M, terms, sparse_crossover(Z_A, Z_X, Z_AX, Z_AXA),
                   "Theorem 4.5 (= F.3/F.4; dividing point Remark 4.7), arXiv 2410.09397",
                   compulsory, {}, params, heads, dtype, note)
