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
:func:`sparse` (Theorem 4.5 = F.3/F.4, dividing point of Remark 4.7), :func:`sparse_informal`
(Theorem 1.2 / Table 1: the informal sparse bound in Z_input and Z_QK, dividing point
M = Z_input^2 / Z_QK).

Inputs: ``n``, ``d``, ``M`` and the Z counts are any finite real numbers (``int``, ``float``,
NumPy scalars; an expected count such as ``density * n * n`` is a legitimate input), positive for
``n``, ``d``, ``M`` and non-negative for the counts. Integral values are kept as exact ints. Terms
whose intermediate products exceed the float range (inputs around 1e160) are evaluated in log
space; a *result* beyond the float range (~1.8e308 words) raises ``ValueError``.
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, field

import numpy as np

from sparse_io_attn.bounds.units import dtype_name, finite_number, itemsize, parse_memory

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
    ``{name: (words, citation)}`` -- bounds for *materialising* the ``n x n`` product QK^T (a
    standalone product that writes its output; attention need not, and FlashAttention-style
    schedules move less than these once ``M >> d^2``), so they are printed only by
    ``describe(verbose=True)`` and carried by :meth:`to_dict` with their ``scope``; ``heads``:
    independent (batch, head) problems summed in every number.
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
            "explicit_constant": {k: {"words": w, "citation": c, "scope": explicit_scope(k)}
                                  for k, (w, c) in self.explicit_constant.items()},
            "dtype": self.dtype, "constants": "unit (the paper states Theta/Omega without constants)",
            "note": self.note,
        }
        if self._itemsize is not None:
            out.update(value_bytes=self.bytes(), compulsory_bytes=self.compulsory_bytes(),
                       floor_bytes=self.floor_bytes())
        return out

    def __str__(self) -> str:
        return self.describe()

    def describe(self, verbose: bool = False) -> str:
        """The printed record; ``verbose`` adds the explicit-constant bounds for materialising QK^T."""
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
        if verbose:
            for name, (w, _cite) in self.explicit_constant.items():
                lines.append(f"  {explicit_scope(name)} [{name.split(' (')[0]}]: {w:,.4g} words (citation in to_dict())")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def _b(self, words) -> str:
        return f" = {words * self._itemsize:,.4g} B" if self._itemsize else ""


#: Scope labels of the explicit-constant bounds (see :class:`Bound`).
MATERIALISE_SCOPE = "bound for materialising QK^T, not for attention"
REDUCTION_SCOPE = "attention, through the reduction of Theorem E.10"
_E10 = "Theorem E.10 reduction (attention)"


def explicit_scope(name: str) -> str:
    """The scope label of an explicit-constant bound named ``name``."""
    return REDUCTION_SCOPE if name == _E10 else MATERIALISE_SCOPE


# ------------------------------------------------------------------------------ numbers
_LOG_FLOAT_MAX = math.log(sys.float_info.max)


def _real(value, what: str, *, positive: bool):
    """``value`` as an exact ``int`` (integral values) or a finite ``float``.

    Accepts ``int``, ``float``, ``fractions.Fraction`` and NumPy integer/floating scalars (NumPy
    integers become Python ints, so products cannot wrap around). ``positive``: ``> 0`` (sizes),
    else ``>= 0`` (counts)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a real number, got bool {value!r}")
    if isinstance(value, numbers.Integral):
        v = int(value)
    elif isinstance(value, numbers.Real):
        v = finite_number(value, what)
    else:
        raise TypeError(f"{what} must be a real number (int, float or NumPy scalar), got "
                        f"{type(value).__name__} {value!r}")
    if positive and v <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    if not positive and v < 0:
        raise ValueError(f"{what} is a count of nonzeros and cannot be negative, got {value!r}")
    return v


def _positive_int(value, what: str) -> int:
    """A positive integer count (``heads``); NumPy integers accepted."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def _sqrt(x) -> float:
    """``sqrt`` of a non-negative number, exact when ``x`` is an int perfect square (big ints included)."""
    if isinstance(x, int):
        r = math.isqrt(x)
        return float(r) if r * r == x else math.sqrt(x)
    return math.sqrt(x)


def _log(x) -> float:
    """Natural log of a non-negative real (ints of any size); ``-inf`` for 0."""
    return -math.inf if x == 0 else math.log(x)


def _logsum(monomials) -> float:
    """``log(sum_i prod_j x_ij ** p_ij)`` for ``monomials = [[(x, p), ...], ...]`` (log-sum-exp)."""
    logs = [sum(p * _log(x) for x, p in mono) for mono in monomials]
    logs = [v for v in logs if v != -math.inf]
    if not logs:
        return -math.inf
    top = max(logs)
    return top + math.log(sum(math.exp(v - top) for v in logs))


def _from_log(lv: float, what: str, *, overflow_ok: bool = False) -> float:
    if lv == -math.inf:
        return 0.0
    if lv > _LOG_FLOAT_MAX:
        if overflow_ok:
            return math.inf
        raise ValueError(f"{what} is about 10^{lv / math.log(10):.1f} words, beyond the float range "
                         f"(~1.8e308): the inputs are too large to evaluate the bound")
    return math.exp(lv)


def _eval(direct, monomials, what: str, *, overflow_ok: bool = False) -> float:
    """``direct()`` (exact arithmetic where the inputs are ints), or, when an intermediate leaves the
    float range, the same sum of monomials (``[[(x, p), ...], ...]``) in log space. A result
    beyond the float range raises ``ValueError`` (``overflow_ok``: returns ``inf``)."""
    try:
        v = float(direct())
        if math.isfinite(v):
            return v
    except OverflowError:
        pass
    return _from_log(_logsum(monomials), what, overflow_ok=overflow_ok)


def _finish(kind, M, terms, crossover, theorem, compulsory_terms, explicit, params, heads, dtype, note=""):
    binding = min(terms, key=lambda k: (terms[k], k != LARGE_CACHE))
    scaled = {}
    for k, v in terms.items():
        try:
            scaled[k] = v * heads
        except OverflowError:
            scaled[k] = math.inf
        if not math.isfinite(scaled[k]):
            raise ValueError(f"the {k} term of the {kind} bound times heads={heads} is beyond the float "
                             f"range (~1.8e308 words)")
    compulsory = heads * sum(compulsory_terms.values())
    try:
        float(compulsory)
    except OverflowError:
        raise ValueError(f"the compulsory traffic of the {kind} bound ({len(str(int(compulsory)))}-digit "
                         f"number of words) is beyond the float range (~1.8e308)") from None
    return Bound(
        kind=kind, M=M, value_words=scaled[binding], terms=scaled, binding=binding,
        regime="small" if M < crossover else "large", crossover_M=crossover, theorem=theorem,
        compulsory_words=compulsory,
        compulsory_terms={k: heads * v for k, v in compulsory_terms.items()},
        explicit_constant={k: (w * heads, c) for k, (w, c) in explicit.items()},
        params=params, heads=heads, dtype=dtype_name(dtype),
        _itemsize=None if dtype is None else itemsize(dtype), note=note)


def _qk_product_bounds(n_q, n_k, d, M) -> dict:
    """Explicit-constant bounds for the n_q x d by d x n_k product Q K^T.

    The first two bound the standalone product (its n_q*n_k output written): they are bounds for
    *materialising* QK^T, not for attention, which need not write that product (FlashAttention-style
    schedules move less than them once M >> d^2). The third applies to attention through the reduction of Theorem
    E.10 (an attention algorithm plus an output and a reload of each product entry, 2*n_q*n_k I/Os,
    computes the product): Q_attn >= 2 n_q n_k d / sqrt(M) + n_q n_k - 2 n_q n_k. It is positive only
    for sqrt(M) < 2d and is left out where it is 0. Entries that leave the float range are left out."""
    out = {}
    try:
        mnk_root = _eval(lambda: n_q * n_k * d / _sqrt(M), [[(n_q, 1), (n_k, 1), (d, 1), (M, -0.5)]],
                         "QK^T product bound")
        nn = float(n_q * n_k)
    except (ValueError, OverflowError):
        return out
    out["Kwasniewski 2019 (QK^T product)"] = (2 * mnk_root + nn, _KWASNIEWSKI)
    out["Smith 2019 (QK^T product)"] = (max(0.0, 2 * mnk_root - 2 * M), _SMITH)
    e10 = 2 * mnk_root - nn
    if e10 > 0:
        out[_E10] = (e10, "derived here: Kwasniewski 2019 Theorem 1 minus the 2*n^2 I/Os of the reduction "
                          "in the paper's Theorem E.10 proof")
    return out


def dense_backward(n, d, M, *, dtype=None, heads: int = 1, form: str = "qkv") -> Bound:
    """Theorem 1.1: attention backward needs Θ(min{(n²d² + nd³)/M, (n²d + nd²)/√M}) words.

    Terms: ``large_cache`` = (n²d² + nd³)/M, ``small_cache`` = (n²d + nd²)/√M; since
    n²d² + nd³ = d·(n²d + nd²) they are equal exactly at the dividing point ``M = d²``
    (``regime`` "small" for M < d², "large" otherwise). Constants are unstated in the paper; the
    value uses 1.

    ``n``, ``d``: positive reals (ints or floats, NumPy scalars). ``M``: words (a positive real), or
    a size string with ``dtype`` (``"228KiB"``). ``heads``: number of independent (batch, head)
    problems (every number is multiplied). ``form`` sets the compulsory traffic:
    ``"qkv"`` (the library's kernels: read q, k, v, o, do and lse, write dq, dk, dv: 8nd + n) or
    ``"paper"`` (Definition 3.2: read A1, A2, A3, dO, X, Y, write g = dL/dX: 4nd + 3d²).
    """
    return _dense("dense backward", "Theorem 1.1 (Theorems 4.1-4.4 / D.5, E.9, C.12, E.10), arXiv 2410.09397",
                  n, d, M, dtype, heads, form, lambda n, d, M: {
                      LARGE_CACHE: _eval(lambda: (n * n * d * d + n * d ** 3) / M,
                                         [[(n, 2), (d, 2), (M, -1)], [(n, 1), (d, 3), (M, -1)]],
                                         "the large_cache term"),
                      SMALL_CACHE: _eval(lambda: (n * n * d + n * d * d) / _sqrt(M),
                                         [[(n, 2), (d, 1), (M, -0.5)], [(n, 1), (d, 2), (M, -0.5)]],
                                         "the small_cache term")},
                  {"qkv": lambda n, d: {"read q,k,v,o,do": 5 * n * d, "read lse": n, "write dq,dk,dv": 3 * n * d},
                   "paper": lambda n, d: {"read A1,A2,A3,dO": 4 * n * d, "read X,Y": 2 * d * d, "write g": d * d}})


def dense_forward(n, d, M, *, dtype=None, heads: int = 1, form: str = "qkv") -> Bound:
    """Saha & Ye 2024 (ICML, arXiv 2402.07443): attention forward needs
    Θ(min{n²d²/M, n²d/√M}) words; the terms are equal at ``M = d²``. Constants unstated (value
    uses 1). Inputs as in :func:`dense_backward`. Compulsory (``form="qkv"``): read q, k, v, write o
    and lse = 4nd + n; ``"paper"``: read A1, A2, A3, X, Y, write O = 4nd + 2d².
    """
    return _dense("dense forward", "Saha & Ye 2024, arXiv 2402.07443 (Theorem 3.1)", n, d, M, dtype, heads, form,
                  lambda n, d, M: {
                      LARGE_CACHE: _eval(lambda: n * n * d * d / M, [[(n, 2), (d, 2), (M, -1)]],
                                         "the large_cache term"),
                      SMALL_CACHE: _eval(lambda: n * n * d / _sqrt(M), [[(n, 2), (d, 1), (M, -0.5)]],
                                         "the small_cache term")},
                  {"qkv": lambda n, d: {"read q,k,v": 3 * n * d, "write o": n * d, "write lse": n},
                   "paper": lambda n, d: {"read A1,A2,A3": 3 * n * d, "read X,Y": 2 * d * d, "write O": n * d}})


def _dense(name: str, source: str, n, d, M, dtype, heads, form: str, terms, compulsory: dict) -> Bound:
    """A dense bound (:func:`dense_backward`, :func:`dense_forward`): the inputs checked, its
    ``terms(n, d, M)``, the compulsory traffic of ``form`` (``compulsory[form](n, d)``), the
    dividing point ``M = d²`` and the QK^T product bounds."""
    n, d = _real(n, "n", positive=True), _real(d, "d", positive=True)
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    terms = terms(n, d, M)
    if form not in tuple(compulsory):  # (a comparison, not a hash: any form= gets the ValueError)
        raise ValueError(f"form must be 'qkv' or 'paper', got {form!r}")
    crossover = _eval(lambda: d * d, [[(d, 2)]], "the dividing point d^2", overflow_ok=True)
    return _finish(name, M, terms, crossover, source, compulsory[form](n, d), _qk_product_bounds(n, n, d, M),
                   {"n": n, "d": d, "form": form}, heads, dtype)


def _z(Z_A, Z_X, Z_AX, Z_AXA):
    return (_real(Z_A, "Z_A", positive=False), _real(Z_X, "Z_X", positive=False),
            _real(Z_AX, "Z_AX", positive=False), _real(Z_AXA, "Z_AXA", positive=False))


def sparse_crossover(Z_A, Z_X, Z_AX, Z_AXA) -> float:
    """Remark 4.7: the ``M`` at which the two terms of Theorem 4.5 are equal,
    √M = (Z_A² + Z_A·Z_X) / (Z_A·√Z_AXA + √(Z_A·Z_X·Z_AX)); ``inf`` when the denominator is 0
    (or the point lies beyond the float range)."""
    Z_A, Z_X, Z_AX, Z_AXA = _z(Z_A, Z_X, Z_AX, Z_AXA)
    num = [[(Z_A, 2)], [(Z_A, 1), (Z_X, 1)]]
    den = [[(Z_A, 1), (Z_AXA, 0.5)], [(Z_A, 0.5), (Z_X, 0.5), (Z_AX, 0.5)]]
    try:
        n_ = Z_A * Z_A + Z_A * Z_X
        d_ = Z_A * _sqrt(Z_AXA) + _sqrt(Z_A * Z_X * Z_AX)
        if d_ == 0:
            return math.inf
        v = (n_ / d_) ** 2
        if math.isfinite(v):
            return float(v)
    except OverflowError:
        pass
    lden = _logsum(den)
    if lden == -math.inf:
        return math.inf
    return _from_log(2 * (_logsum(num) - lden), "the dividing point", overflow_ok=True)


def _check_sizes(n, d):
    """Optional sizes ``n``, ``d`` as positive reals (``None`` stays ``None``)."""
    if n is not None:
        n = _real(n, "n", positive=True)
    if d is not None:
        d = _real(d, "d", positive=True)
    return n, d


def sparse(Z_A, Z_X, Z_AX, Z_AXA, M, *, n=None, d=None, dtype=None, heads: int = 1,
           note: str = "") -> Bound:
    """Theorem 4.5 (= F.3 forward, F.4 backward): sparse attention needs
    Ω(min{(Z_A² + Z_A·Z_X)/M, (Z_A·√Z_AXA + √(Z_A·Z_X·Z_AX))/√M}) words, with
    Z_A = min(nnz A1, nnz A2), Z_X = nnz X, Z_AX = min(nnz A1X, nnz XA2ᵀ), Z_AXA = nnz A1XA2ᵀ
    (:func:`~sparse_io_attn.bounds.nnz_stats` computes them). Dividing point: Remark 4.7
    (:func:`sparse_crossover`); with dense operands this is the dense bound (Remark 4.6).
    Constants unstated (value uses 1).

    The counts are non-negative reals: exact ints, or expected counts such as ``density * n * n``
    (floats, NumPy scalars).

    Compulsory traffic: reading the operands of A1·X·A2ᵀ once, 2·Z_A + Z_X (a lower estimate, as
    Z_A is the sparser of A1, A2), plus writing the n x d output (n·d) when ``n`` and ``d`` are
    given. ``n`` (and ``d``) also enable the checks Z_AXA <= n², Z_A <= n·d, Z_X <= d².
    ``note`` is carried into the record (e.g. the caveat of a QK-pattern-restricted Z_AXA).

    Scope: the theorem bounds computing the *structural product* A1·X·A2ᵀ of sparse operands. A
    Z_AXA restricted to a QK mask (masked / block-sparse attention, which computes only the kept
    entries) is outside its hypotheses, and the formula is then not a proven lower bound: its
    small-cache term Z_A·√Z_AXA/√M can exceed the traffic of a plain block-sparse kernel.
    """
    Z_A, Z_X, Z_AX, Z_AXA = _z(Z_A, Z_X, Z_AX, Z_AXA)
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    n, d = _check_sizes(n, d)
    if n is not None and Z_AXA > n * n:
        raise ValueError(f"Z_AXA = {Z_AXA:,} exceeds n^2 = {n * n:,}: A1 X A2^T is n x n, so at "
                         f"most n^2 entries are nonzero; check the counts or n")
    if d is not None and Z_X > d * d:
        raise ValueError(f"Z_X = {Z_X:,} exceeds d^2 = {d * d:,} (X is d x d)")
    if n is not None and d is not None:
        for name, z in (("Z_A", Z_A), ("Z_AX", Z_AX)):
            if z > n * d:
                raise ValueError(f"{name} = {z:,} exceeds n*d = {n * d:,} (the matrix is n x d)")
    terms = {LARGE_CACHE: _eval(lambda: (Z_A * Z_A + Z_A * Z_X) / M,
                                [[(Z_A, 2), (M, -1)], [(Z_A, 1), (Z_X, 1), (M, -1)]], "the large_cache term"),
             SMALL_CACHE: _eval(lambda: (Z_A * _sqrt(Z_AXA) + _sqrt(Z_A * Z_X * Z_AX)) / _sqrt(M),
                                [[(Z_A, 1), (Z_AXA, 0.5), (M, -0.5)], [(Z_A, 0.5), (Z_X, 0.5), (Z_AX, 0.5), (M, -0.5)]],
                                "the small_cache term")}
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


def sparse_informal_crossover(Z_input, Z_QK) -> float:
    """Theorem 1.2's dividing point ``M = Z_input^2 / Z_QK`` (``inf`` when ``Z_QK = 0``); ``d^2``
    for dense operands (``Z_input = n d``, ``Z_QK = n^2``)."""
    Z_in, Z_qk = _real(Z_input, "Z_input", positive=False), _real(Z_QK, "Z_QK", positive=False)
    if Z_qk == 0:
        return math.inf
    return _eval(lambda: Z_in * Z_in / Z_qk, [[(Z_in, 2), (Z_qk, -1)]], "the dividing point", overflow_ok=True)


def sparse_informal(Z_input, Z_QK, M, *, n=None, d=None, dtype=None, heads: int = 1,
                    note: str = "") -> Bound:
    """Theorem 1.2 (Table 1's sparse rows; the informal version of Theorem 4.5): sparse attention
    forward and backward need Ω(min{Z_input²/M, Z_input·√Z_QK/√M}) words, with Z_input the nonzeros
    of the input matrix and Z_QK those of the key-query matrix; dividing point
    ``M = Z_input² / Z_QK`` (:func:`sparse_informal_crossover`). Constants unstated (value uses 1).

    With Theorem 4.5's counts, ``Z_input = Z_A`` and ``Z_QK = Z_AXA``: each term is then at most the
    corresponding term of :func:`sparse` (which adds Z_A·Z_X/M and √(Z_A Z_X Z_AX)/√M), so this bound
    is the weaker, informal statement. Dense operands (Z_input = n·d, Z_QK = n²) give
    Ω(min{n²d²/M, n²d/√M}) with dividing point d².

    Compulsory traffic: reading the input once (Z_input), plus writing the n x d output when ``n``
    and ``d`` are given. Inputs: non-negative reals (counts may be expected values).
    """
    Z_in, Z_qk = _real(Z_input, "Z_input", positive=False), _real(Z_QK, "Z_QK", positive=False)
    heads = _positive_int(heads, "heads")
    M = parse_memory(M, dtype)
    n, d = _check_sizes(n, d)
    if n is not None and Z_qk > n * n:
        raise ValueError(f"Z_QK = {Z_qk:,} exceeds n^2 = {n * n:,} (the key-query matrix is n x n)")
    terms = {LARGE_CACHE: _eval(lambda: Z_in * Z_in / M, [[(Z_in, 2), (M, -1)]], "the large_cache term"),
             SMALL_CACHE: _eval(lambda: Z_in * _sqrt(Z_qk) / _sqrt(M), [[(Z_in, 1), (Z_qk, 0.5), (M, -0.5)]],
                                "the small_cache term")}
    compulsory = {"read input (Z_input)": Z_in}
    if n is not None and d is not None:
        compulsory["write output (n x d)"] = n * d
    params = {"Z_input": Z_in, "Z_QK": Z_qk}
    if n is not None:
        params["n"] = n
    if d is not None:
        params["d"] = d
    return _finish("sparse forward/backward (informal)", M, terms, sparse_informal_crossover(Z_in, Z_qk),
                   "Theorem 1.2 / Table 1 (informal version of Theorem 4.5), arXiv 2410.09397",
                   compulsory, {}, params, heads, dtype, note)
