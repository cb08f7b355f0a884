"""Pattern builders: each returns an element-exact :class:`~sparse_io_attn.BlockSparseLayout` with a
readable name.

Signature shape: ``NAME(seqlen, block_size, <pattern parameters>, *, causal=False, [num_heads=1,
seed=0])``. ``seqlen`` is an int or a ``(seqlen_q, seqlen_k)`` pair, ``block_size`` an int or a
``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` pair (only :func:`document` takes ``cu_seqlens`` first).

Every pattern is defined on *elements* ``(q, k)`` (query position ``q``, key position ``k``,
top-left aligned, ``d = q - k``) and the layout computes exactly that mask: blocks whose every
in-range element is allowed are full, blocks with some allowed elements are partial (they carry
the element mask), other blocks are not kept. ``causal=True`` intersects the definition with
``k <= q``, and the layout carries it (no ``causal`` flag is needed at the call).

==================  ==========================================================================
pattern             element ``(q, k)`` allowed iff
==================  ==========================================================================
dense               always
causal              ``k <= q``
sliding_window      ``|q - k| <= window`` (``window`` in elements)
strided             ``|q - k| < stride`` or ``(q - k) % stride == 0`` (Child et al. 2019)
fixed               ``q // stride == k // stride`` or ``k % stride >= stride - summary`` (Child et al.)
longformer          ``|q - k| <= window`` or ``q`` or ``k`` is a global token
bigbird             ``|q - k| <= window`` or query block ``< num_global`` or key block ``< num_global``
                    or ``(q, k)`` in one of ``num_random`` random key blocks of its query-block row
                    (seeded, per head)
random              ``(q, k)`` in one of ``round(density * n)`` blocks of the ``n`` allowed ones,
                    drawn uniformly (seeded, per head)
document            ``q`` and ``k`` in the same document of ``cu_seqlens`` (packed sequences)
prefix_lm           ``k < prefix`` or ``k <= q`` (bidirectional prefix, causal continuation)
==================  ==========================================================================

Cost: builders enumerate the candidate blocks of each row from the pattern's structure (bands,
diagonals, global rows and columns, documents), never the ``seqlen_q x seqlen_k`` element mask or
the full block grid (``dense`` and ``random`` excepted, whose kept blocks are the grid), and
evaluate the element definition only on blocks that may be partial, once per distinct mask shape.
Time and memory are O(kept blocks), about 0.1-0.4 us and 100 B per kept block at the peak: at
N = 2**20, block 16 (2 cores, measured) ``sliding_window(window=256)`` builds in 0.3 s,
``bigbird()`` in 0.5 s and ``longformer(window=256)`` in 0.6 s with 200-300 MiB beyond the import,
``document`` with 4096-token documents (16.8M kept blocks) in 3.3 s. Before listing any block a
builder counts the blocks its parts keep and refuses with a ``ValueError`` (the count and the memory
available) when they cannot fit: ``strided(2**20, 16, stride=256)`` keeps 271M blocks by its
definition (every 256th key of the whole sequence), ``fixed(2**20, 16)`` 537M.

Specs (``from_spec``, used by the CLI's ``--pattern``)::

    spec  := NAME [":" arg ("," arg)*]
    arg   := value | KEY "=" value | FLAG          # FLAG: a bare boolean name, e.g. causal
    value := int | float | true | false | int ("/" int)+      # "/" separates a list

Positional values fill the pattern's main parameters in order (see ``SPEC_PARAMS``), e.g.
``sliding_window:512``, ``bigbird:window=256,global=1,random=2``, ``random:0.1,seed=3,heads=8``,
``document:4`` (4 equal documents), ``document:lengths=1000/3096,causal`` or ``prefix_lm:100``.
Keys accept the full parameter names and the short aliases in ``ALIASES`` (``w``, ``g``/``global``,
``r``/``random``, ``d``, ``c``, ``heads``). Parameters left out get defaults scaled to ``seqlen`` and
``block_size``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from sparse_io_attn import _memory
from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout.core import BlockSparseLayout, assemble_ids, inrange_words

__all__ = ["dense", "causal", "sliding_window", "strided", "fixed", "longformer", "bigbird", "random",
           "document", "block_diagonal", "prefix_lm", "from_spec", "get", "available", "SPEC_PARAMS",
           "ALIASES"]

#: element evaluations per chunk when partial blocks are expanded (bounds the temporary memory)
_EVAL_CHUNK = 1 << 24
#: largest sequence length accepted (positions and block products stay far inside int64)
MAX_SEQLEN = 1 << 40


# ---------------------------------------------------------------------------------------- helpers
class _Grid:
    """Block extents of a ``seqlen`` x ``block_size`` grid: ``q_lo/q_hi [R]``, ``k_lo/k_hi [C]``
    (first and last in-range element of each block, int64)."""

    def __init__(self, seqlen, block_size):
        self.sq, self.sk = as_pair(seqlen, "seqlen")
        self.bq, self.bk = as_pair(block_size, "block_size")
        if max(self.sq, self.sk) > MAX_SEQLEN:
            raise ValueError(f"seqlen must be at most {MAX_SEQLEN}, got {(self.sq, self.sk)}")
        self.R, self.C = math.ceil(self.sq / self.bq), math.ceil(self.sk / self.bk)
        self._q_hi = self._k_hi = None

    def q_lo(self, r):
        return r * self.bq

    def q_hi(self, r):   # r, c: block indices in [0, R), [0, C)
        if self._q_hi is None:   # a table: one gather per call instead of four passes over r
            self._q_hi = torch.clamp((self.rows() + 1) * self.bq, max=self.sq) - 1
        return self._q_hi[r]

    def k_lo(self, c):
        return c * self.bk

    def k_hi(self, c):
        if self._k_hi is None:
            self._k_hi = torch.clamp((self.cols() + 1) * self.bk, max=self.sk) - 1
        return self._k_hi[c]

    def rows(self) -> torch.Tensor:
        return torch.arange(self.R)

    def cols(self) -> torch.Tensor:
        return torch.arange(self.C)

    def ranges(self, r: torch.Tensor, c_first: torch.Tensor, c_last: torch.Tensor):
        """Blocks ``(r[i], c)`` for ``c_first[i] <= c <= c_last[i]`` (clipped to the grid): ``(r, c)``."""
        return _expand(r, c_first.clamp(min=0), c_last.clamp(max=self.C - 1))

    def band_spans(self, lo: int, hi: int):
        """Per row, the first and last column block holding some element with ``lo <= q - k <= hi``
        (rows with none get ``c_first > c_last``)."""
        r = self.rows()
        lo_k = self.q_lo(r) - hi   # smallest k with q - k <= hi for some q of the row
        hi_k = self.q_hi(r) - lo   # largest k with q - k >= lo
        c_first = torch.div(torch.clamp(lo_k, min=0), self.bk, rounding_mode="floor")
        c_last = torch.where(hi_k < 0, torch.full_like(hi_k, -1),
                             torch.div(torch.clamp(hi_k, max=self.sk - 1), self.bk, rounding_mode="floor"))
        return c_first, c_last

    def band(self, lo: float, hi: float):
        """Blocks holding some element with ``lo <= q - k <= hi``: ``(r, c)``."""
        lo, hi = self._finite(lo), self._finite(hi)
        return self.ranges(self.rows(), *self.band_spans(lo, hi))

    def ranges_count(self, c_first: torch.Tensor, c_last: torch.Tensor) -> int:
        """How many blocks :meth:`ranges` returns, without listing them."""
        return int(_span_lengths(c_first.clamp(min=0), c_last.clamp(max=self.C - 1)).sum())

    def band_count(self, lo: float, hi: float) -> int:
        """How many blocks :meth:`band` returns, without listing them."""
        return self.ranges_count(*self.band_spans(self._finite(lo), self._finite(hi)))

    def diagonals_count(self, offsets: torch.Tensor) -> int:
        """Blocks holding an in-range element of a thin band ``q - k = d``, summed over ``d`` in
        ``offsets``, in O(len(offsets)): a diagonal walks a staircase through the grid, entering a
        new block at each row or column boundary, once where both coincide. (:meth:`band` may list
        a few more: padding blocks at a ragged end, which the build drops.)"""
        d = offsets.to(torch.int64)
        qa = torch.clamp(d, min=0)
        qb = torch.clamp(d + self.sk - 1, max=self.sq - 1)
        rows = torch.div(qb, self.bq, rounding_mode="floor") - torch.div(qa, self.bq, rounding_mode="floor") + 1
        cols = torch.div(qb - d, self.bk, rounding_mode="floor") - torch.div(qa - d, self.bk, rounding_mode="floor") + 1
        # boundaries crossed together: q = bq * j (j in [ja, jb]) with q = d (mod bk)
        g = math.gcd(self.bq, self.bk)
        m = self.bk // g
        inv = pow(self.bq // g, -1, m) if m > 1 else 0
        j0 = torch.remainder(torch.div(d, g, rounding_mode="floor"), m) * inv % m
        ja = torch.div(qa, self.bq, rounding_mode="floor") + 1
        jb = torch.div(qb, self.bq, rounding_mode="floor")
        both = torch.div(jb - j0, m, rounding_mode="floor") - torch.div(ja - 1 - j0, m, rounding_mode="floor")
        both = torch.where(torch.remainder(d, g) == 0, both, 0)
        cells = torch.where(qa <= qb, rows + cols - 1 - both, 0)
        return int(cells.sum())

    def inside_band(self, r, c, lo: float, hi: float) -> torch.Tensor:
        """Every in-range element of block ``(r, c)`` has ``lo <= q - k <= hi``."""
        lo, hi = self._finite(lo), self._finite(hi)
        return (self.q_hi(r) - self.k_lo(c) <= hi) & (self.q_lo(r) - self.k_hi(c) >= lo)

    def _finite(self, x) -> int:
        """``q - k`` bounds beyond the grid's reach, clamped to integers (``inf`` included)."""
        reach = self.sq + self.sk
        return int(max(-reach, min(reach, x)))

    def d0(self, r, c) -> torch.Tensor:
        """``q - k`` at a block's first element: band masks depend on it alone."""
        return self.q_lo(r) - self.k_lo(c)


#: bytes the builders hold per candidate block at their peak (indices, keys, flags)
_BYTES_PER_CANDIDATE = 96


def _check_size(candidates: int) -> None:
    """Refuse (``ValueError`` with the numbers) a layout whose candidate blocks would not fit in the
    memory available, before allocating them. Builders that combine parts (bands, global rows and
    columns, diagonals) call it with the total before listing any part."""
    need = candidates * _BYTES_PER_CANDIDATE
    free, source = _memory.available_memory_bytes("cpu")
    if free is not None and need > free:
        raise ValueError(f"this pattern keeps about {candidates:,} blocks, which needs about {need / 2**30:.1f} GiB "
                         f"to build but {free / 2**30:.1f} GiB is available ({source}); use a larger block_size "
                         f"or a shorter sequence")


def _span_lengths(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """How many ``x`` with ``first[i] <= x <= last[i]``, per ``i``."""
    return (last - first + 1).clamp(min=0)


def _expand(ids: torch.Tensor, first: torch.Tensor, last: torch.Tensor):
    """Pairs ``(ids[i], x)`` for ``first[i] <= x <= last[i]``."""
    n = _span_lengths(first, last)
    _check_size(int(n.sum()))
    out_ids = torch.repeat_interleave(ids, n)
    start = torch.repeat_interleave(first, n)
    offset = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    return out_ids, start + offset


def _unique(lid, r, c):
    """Unique ``(lid, r, c)`` triples."""
    if lid.numel() == 0:
        return lid, r, c
    big_c = int(c.max()) + 1
    big_r = int(r.max()) + 1
    key = (lid * big_r + r) * big_c + c
    if bool((key[1:] >= key[:-1]).all()):   # listed in order already (most builders): no sort
        key = torch.unique_consecutive(key)
    else:
        key = torch.unique(key)
    c = key % big_c
    rest = key // big_c
    return rest // big_r, rest % big_r, c


def _build(g: _Grid, lid, r, c, elem: Callable, *, full=None, key=None, layout_heads: int = 1,
           name: str) -> BlockSparseLayout:
    """Candidate blocks (any superset of the kept ones, duplicates allowed) -> exact layout.

    ``elem(lid, q, k) -> bool`` is the element definition on broadcast int64 position tensors;
    ``full(lid, r, c) -> bool [E]`` a sufficient condition for "every in-range element allowed"
    (those blocks are not evaluated); ``key(lid, r, c) -> int64 [E, K]`` rows such that interior
    blocks with equal rows have equal element masks (evaluated once per distinct row; None: each
    block). Blocks at a ragged sequence end are evaluated one by one.
    """
    lid, r, c = _unique(lid, r, c)
    E = lid.numel()
    status = torch.full((E,), -1, dtype=torch.int64)       # -1 full, -2 empty, >= 0 mask row
    unsure = ~full(lid, r, c) if full is not None else torch.ones(E, dtype=torch.bool)
    edge = ((r + 1) * g.bq > g.sq) | ((c + 1) * g.bk > g.sk)
    groups = []                                              # (entry indices, evaluated words, inverse)
    inner = (unsure & ~edge).nonzero().squeeze(1)
    if inner.numel():
        if key is not None:
            first, inverse = _first_of_each(key(lid[inner], r[inner], c[inner]))
            reps = inner[first]
        else:
            reps, inverse = inner, torch.arange(inner.numel())
        groups.append((inner, reps, inverse))
    outer = (unsure & edge).nonzero().squeeze(1)
    if outer.numel():
        groups.append((outer, outer, torch.arange(outer.numel())))
    masks = []
    for entries, reps, inverse in groups:
        words = _evaluate(g, elem, lid[reps], r[reps], c[reps]) & inrange_words(r[reps], c[reps],
                                                                                (g.bq, g.bk), (g.sq, g.sk))
        whole = inrange_words(r[reps], c[reps], (g.bq, g.bk), (g.sq, g.sk))
        empty = (words == 0).flatten(1).all(1)
        is_full = (words == whole).flatten(1).all(1)
        rep_status = torch.where(empty, -2, torch.where(is_full, -1, 0))
        part = rep_status == 0
        offset = sum(m.shape[0] for m in masks)
        rep_status[part] = offset + torch.arange(int(part.sum()))
        masks.append(words[part])
        status[entries] = rep_status[inverse]
    masks = torch.cat(masks) if masks else torch.zeros(0, g.bq, _bits.num_words(g.bk), dtype=torch.int32)
    keep = status != -2
    lid, r, c, status = lid[keep], r[keep], c[keep], status[keep]
    uniq, inv = _bits.dedup(masks)
    ids = torch.where(status >= 0, inv[status.clamp(min=0)] if masks.shape[0] else status, -1)
    return assemble_ids(lid, r, c, ids, uniq, block_size=(g.bq, g.bk), seqlen=(g.sq, g.sk),
                        layout_batch=1, layout_heads=layout_heads, name=name)


def _first_of_each(keys: torch.Tensor):
    """Distinct rows of ``keys [E, K]`` (small non-negative ranges per column are packed into one
    int64): ``(index of the first occurrence of each distinct row, inverse [E])``."""
    lo = keys.min(0).values
    span = keys.max(0).values - lo + 1
    if float(torch.prod(span.double())) < 2 ** 62:
        radix = torch.cumprod(torch.cat([torch.ones(1, dtype=torch.int64), span[:-1]]), 0)
        packed = ((keys - lo) * radix).sum(1)
        uniq, inverse = torch.unique(packed, return_inverse=True)
    else:
        uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((uniq.shape[0],), keys.shape[0], dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.shape[0]), reduce="amin")
    return first, inverse


def _evaluate(g: _Grid, elem: Callable, lid, r, c) -> torch.Tensor:
    """Bit-packed element masks of blocks ``(lid, r, c)``: ``int32 [E, bq, W]``."""
    out = torch.empty(lid.numel(), g.bq, _bits.num_words(g.bk), dtype=torch.int32)
    step = max(1, _EVAL_CHUNK // (g.bq * g.bk))
    iq, ik = torch.arange(g.bq), torch.arange(g.bk)
    for a in range(0, lid.numel(), step):
        sl = slice(a, a + step)
        q = (r[sl] * g.bq)[:, None, None] + iq[None, :, None]
        k = (c[sl] * g.bk)[:, None, None] + ik[None, None, :]
        m = elem(lid[sl][:, None, None], q, k)
        out[sl] = _bits.pack(m.expand(q.shape[0], g.bq, g.bk))
    return out


def _int(x, what: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{what} must be an int, got {x!r}")
    if x < lo:
        raise ValueError(f"{what} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{what} must be <= {hi}, got {x}")
    return x


def _bool(x, what: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{what} must be True or False, got {x!r}")
    return x


def _heads(num_heads) -> int:
    return _int(num_heads, "num_heads", 1, 1 << 16)


def _generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(_int(seed, "seed", 0, (1 << 63) - 1))


def _tag(name: str, params: str, causal: bool) -> str:
    inner = ",".join(p for p in (params, "causal" if causal else "") if p)
    return f"{name}({inner})" if inner else name


def _default_window(seqlen) -> int:
    """4% of ``seqlen_k`` each side: about 10% block density at N = 4096, block 64."""
    return max(1, as_pair(seqlen, "seqlen")[1] // 25)


def _window(window, seqlen) -> int:
    """A window in elements, capped at the longest possible distance (a larger one changes nothing)."""
    sq, sk = as_pair(seqlen, "seqlen")
    return min(_int(window, "window"), sq + sk)


def _causal_elem(elem: Callable, causal: bool) -> Callable:
    return (lambda lid, q, k: elem(lid, q, k) & (k <= q)) if causal else elem


def _zeros(n):
    return torch.zeros(n, dtype=torch.int64)


# ---------------------------------------------------------------------------------------- patterns
def dense(seqlen, block_size, *, causal: bool = False) -> BlockSparseLayout:
    """Every element (``causal=True`` gives the same as :func:`causal`)."""
    if _bool(causal, "causal"):
        return causal_(seqlen, block_size)
    g = _Grid(seqlen, block_size)
    r, c = g.ranges(g.rows(), _zeros(g.R), torch.full((g.R,), g.C - 1))
    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: q >= 0,
                  full=lambda lid, r, c: torch.ones(r.numel(), dtype=torch.bool), name="dense")


def causal(seqlen, block_size) -> BlockSparseLayout:
    """Lower triangle ``k <= q`` (top-left aligned, also for rectangular blocks and ``seqlen_q !=
    seqlen_k``): blocks below the diagonal are full, blocks it crosses are partial."""
    g = _Grid(seqlen, block_size)
    r, c = g.band(0, math.inf)
    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: k <= q,
                  full=lambda lid, r, c: g.inside_band(r, c, 0, math.inf),
                  key=lambda lid, r, c: g.d0(r, c)[:, None], name="causal")


causal_ = causal


def _band_layout(g: _Grid, lo, hi, name: str) -> BlockSparseLayout:
    r, c = g.band(lo, hi)
    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: ((q - k) >= lo) & ((q - k) <= hi),
                  full=lambda lid, r, c: g.inside_band(r, c, lo, hi),
                  key=lambda lid, r, c: g.d0(r, c)[:, None], name=name)


def sliding_window(seqlen, block_size, window: int | None = None, *,
                   causal: bool = False) -> BlockSparseLayout:
    """Local band: ``|q - k| <= window`` (``0 <= q - k <= window`` with ``causal``), ``window`` in
    elements (default ``seqlen_k // 25``)."""
    window = _default_window(seqlen) if window is None else _window(window, seqlen)
    g = _Grid(seqlen, block_size)
    lo = 0 if _bool(causal, "causal") else -window
    return _band_layout(g, lo, window, _tag("sliding_window", f"w={window}", causal))


def strided(seqlen, block_size, stride: int | None = None, *, causal: bool = False) -> BlockSparseLayout:
    """Sparse Transformer "strided" (Child et al. 2019): a local window ``|q - k| < stride`` plus
    every ``stride``-th diagonal ``(q - k) % stride == 0``; ``causal`` keeps ``q - k >= 0`` only.
    Default ``stride = 8 * BLOCK_SIZE_KV``."""
    g = _Grid(seqlen, block_size)
    stride = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    stride = min(stride, g.sq + g.sk)
    lo = 0 if _bool(causal, "causal") else -(stride - 1)
    if stride < g.bq + g.bk:  # every block's range of q - k holds a multiple of the stride
        r, c = g.band(lo if causal else -math.inf, math.inf)
    else:                     # the local band plus one thin band per stride-th diagonal
        m_first = 0 if causal else -((g.sk - 1) // stride)
        diagonals = torch.arange(m_first, (g.sq - 1) // stride + 1) * stride
        _check_size(g.band_count(lo, stride - 1) + g.diagonals_count(diagonals))
        parts = [g.band(lo, stride - 1)] + [g.band(d, d) for d in diagonals.tolist()]
        r = torch.cat([p[0] for p in parts])
        c = torch.cat([p[1] for p in parts])

    def elem(lid, q, k):
        d = q - k
        e = (d.abs() < stride) | (torch.remainder(d, stride) == 0)
        return e & (d >= 0) if causal else e

    return _build(g, _zeros(r.numel()), r, c, elem,
                  full=lambda lid, r, c: g.inside_band(r, c, lo, stride - 1),
                  key=lambda lid, r, c: g.d0(r, c)[:, None], name=_tag("strided", f"stride={stride}", causal))


def fixed(seqlen, block_size, stride: int | None = None, summary: int | None = None, *,
          causal: bool = False) -> BlockSparseLayout:
    """Sparse Transformer "fixed" (Child et al. 2019): attend within the same chunk of ``stride``
    positions (``q // stride == k // stride``) and to the last ``summary`` positions of every chunk
    (``k % stride >= stride - summary``). Defaults: ``stride = 8 * BLOCK_SIZE_KV``,
    ``summary = BLOCK_SIZE_KV`` (capped at ``stride``)."""
    g = _Grid(seqlen, block_size)
    stride = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    summary = min(g.bk, stride) if summary is None else _int(summary, "summary", 1)
    if summary > stride:
        raise ValueError(f"summary must be <= stride ({stride}), got {summary}")
    _bool(causal, "causal")
    s = stride
    rows = g.rows()
    # same chunk: keys of the chunks the row's queries fall in
    k_first = torch.div(g.q_lo(rows), s, rounding_mode="floor") * s
    k_last = (torch.div(g.q_hi(rows), s, rounding_mode="floor") + 1) * s - 1
    if causal:
        k_last = torch.minimum(k_last, g.q_hi(rows))
    c_first = torch.div(k_first, g.bk, rounding_mode="floor")
    c_last = torch.div(torch.clamp(k_last, max=g.sk - 1), g.bk, rounding_mode="floor")
    # summary columns: key blocks holding a position with k % s >= s - summary
    cols = g.cols()
    first_summary = torch.maximum(g.k_lo(cols), torch.div(g.k_lo(cols), s, rounding_mode="floor") * s + s - summary)
    has_summary = first_summary <= g.k_hi(cols)
    scols = cols[has_summary]
    first_row = torch.div(first_summary[scols], g.bq, rounding_mode="floor") if causal else _zeros(scols.numel())
    _check_size(g.ranges_count(c_first, c_last) + int(_span_lengths(first_row, g.R - 1).sum()))
    r1, c1 = g.ranges(rows, c_first, c_last)
    c2, r2 = _expand(scols, first_row, torch.full_like(first_row, g.R - 1))   # rows reaching the column
    r, c = torch.cat([r1, r2]), torch.cat([c1, c2])

    def elem(lid, q, k):
        e = (torch.div(q, s, rounding_mode="floor") == torch.div(k, s, rounding_mode="floor")) | (k % s >= s - summary)
        return e & (k <= q) if causal else e

    def key(lid, r, c):
        ql, kl = g.q_lo(r), g.k_lo(c)
        chunk = torch.div(ql, s, rounding_mode="floor") - torch.div(kl, s, rounding_mode="floor")
        span = (g.bq + g.bk) // s + 2
        return torch.stack([ql % s, kl % s, chunk.clamp(-span, span), g.d0(r, c).clamp(-g.bq, g.bk)], 1)

    def full(lid, r, c):  # one chunk holds the whole block, or every key of it is a summary key
        chunk = torch.div(g.q_lo(r), s, rounding_mode="floor")
        same = (torch.div(g.q_hi(r), s, rounding_mode="floor") == chunk) \
            & (torch.div(g.k_lo(c), s, rounding_mode="floor") == chunk) \
            & (torch.div(g.k_hi(c), s, rounding_mode="floor") == chunk)
        summ = (torch.div(g.k_lo(c), s, rounding_mode="floor") == torch.div(g.k_hi(c), s, rounding_mode="floor")) \
            & (g.k_lo(c) % s >= s - summary)
        return (same | summ) & ((g.k_hi(c) <= g.q_lo(r)) if causal else True)

    return _build(g, _zeros(r.numel()), r, c, elem, key=key, full=full,
                  name=_tag("fixed", f"stride={stride},c={summary}", causal))


def _global_positions(global_tokens, g: _Grid) -> tuple[torch.Tensor, str]:
    n = max(g.sq, g.sk)
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        count = _int(global_tokens, "global_tokens")
        if count > n:
            raise ValueError(f"global_tokens = {count} exceeds the sequence length {n}; use at most {n} "
                             f"global tokens (or a list of positions)")
        return torch.arange(count), str(count)
    if isinstance(global_tokens, Sequence) and all(isinstance(p, int) and not isinstance(p, bool)
                                                  for p in global_tokens):
        pos = torch.tensor(sorted(set(global_tokens)), dtype=torch.int64)
        if pos.numel() and (pos.min() < 0 or pos.max() >= n):
            raise ValueError(f"global_tokens must lie in [0, {n}), got values in "
                             f"[{int(pos.min())}, {int(pos.max())}]")
        return pos, str(pos.numel())
    raise TypeError(f"global_tokens must be an int count or a sequence of int positions, "
                    f"got {global_tokens!r}")


def _global_count(g: _Grid, grows: torch.Tensor, gcols: torch.Tensor, causal: bool) -> int:
    """Blocks of complete rows ``grows`` and complete columns ``gcols`` (with repetition; ``causal``:
    only blocks holding an element with ``k <= q``)."""
    if not causal:
        return grows.numel() * g.C + gcols.numel() * g.R
    per_row = torch.clamp(torch.div(g.q_hi(grows), g.bk, rounding_mode="floor") + 1, max=g.C)
    per_col = (g.R - torch.div(g.k_lo(gcols), g.bq, rounding_mode="floor")).clamp(min=0)
    return int(per_row.sum() + per_col.sum())


def _pattern_ids(is_set: torch.Tensor, blocks: int, size: int) -> torch.Tensor:
    """Per block, an id of which of its ``size`` positions are set (0: none)."""
    per_block = is_set[: blocks * size].view(blocks, size)
    _, inv = torch.unique(per_block, dim=0, return_inverse=True)
    none = ~per_block.any(1)
    return torch.where(none, 0, inv + 1)


def longformer(seqlen, block_size, window: int | None = None, global_tokens: int | Sequence[int] = 1,
               *, causal: bool = False) -> BlockSparseLayout:
    """Longformer: sliding window ``|q - k| <= window`` plus global tokens, whose rows (as queries)
    and columns (as keys) are complete. ``global_tokens`` is a count (the first ``n`` positions) or a
    sequence of positions; ``window`` in elements (default ``seqlen_k // 25``)."""
    g = _Grid(seqlen, block_size)
    window = _default_window(seqlen) if window is None else _window(window, seqlen)
    pos, count = _global_positions(global_tokens, g)
    _bool(causal, "causal")
    lo = 0 if causal else -window
    is_gq = torch.zeros(g.R * g.bq, dtype=torch.bool)
    is_gq[pos[pos < g.sq]] = True
    is_gk = torch.zeros(g.C * g.bk, dtype=torch.bool)
    is_gk[pos[pos < g.sk]] = True
    grows = is_gq.view(g.R, g.bq).any(1).nonzero().squeeze(1)
    gcols = is_gk.view(g.C, g.bk).any(1).nonzero().squeeze(1)
    _check_size(g.band_count(lo, window) + _global_count(g, grows, gcols, causal))
    rb, cb = g.band(lo, window)
    r1, c1 = grows.repeat_interleave(g.C), g.cols().repeat(grows.numel())
    r2, c2 = g.rows().repeat(gcols.numel()), gcols.repeat_interleave(g.R)
    r, c = torch.cat([rb, r1, r2]), torch.cat([cb, c1, c2])
    if causal:
        ok = g.k_lo(c) <= g.q_hi(r)
        r, c = r[ok], c[ok]
    row_id, col_id = _pattern_ids(is_gq, g.R, g.bq), _pattern_ids(is_gk, g.C, g.bk)

    def elem(lid, q, k):
        e = (((q - k) >= lo) & ((q - k) <= window)) | is_gq[q.clamp(max=is_gq.numel() - 1)] \
            | is_gk[k.clamp(max=is_gk.numel() - 1)]
        return e & (k <= q) if causal else e

    def full(lid, r, c):
        inside = g.inside_band(r, c, lo, window)
        return inside & ((g.k_hi(c) <= g.q_lo(r)) if causal else True)

    def key(lid, r, c):
        return torch.stack([g.d0(r, c).clamp(lo - g.bq, window + g.bk), row_id[r], col_id[c]], 1)

    return _build(g, _zeros(r.numel()), r, c, elem, full=full, key=key,
                  name=_tag("longformer", f"w={window},g={count}", causal))


def _random_blocks(g: _Grid, num: int, fixed_keys: torch.Tensor, width: torch.Tensor,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For every query-block row ``r``, ``num`` key blocks drawn uniformly without replacement from
    the allowed columns ``[0, width[r])`` whose key ``r * C + c`` is not in the sorted ``fixed_keys``
    (all of them if fewer remain). Rejection sampling on ``4 num + 16`` draws per row (O(rows));
    rows left short of their quota are redrawn exactly from their (then small) free set."""
    draws = 4 * num + 16
    u = torch.rand(g.R, draws, generator=gen)
    cand = torch.minimum((u * width[:, None]).long(), (width - 1).clamp(min=0)[:, None])  # [R, draws]
    rr = g.rows()[:, None].expand_as(cand)
    key = rr * g.C + cand
    ok = (width[:, None] > 0) & ~torch.isin(key, fixed_keys)
    # keep the first draw of each column of a row
    order = torch.argsort(key.flatten(), stable=True)
    sorted_key = key.flatten()[order]
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    is_first = torch.zeros_like(first)
    is_first[order] = first
    ok &= is_first.view_as(ok)
    pick = ok & (torch.cumsum(ok.long(), 1) <= num)
    got = pick.sum(1)
    fixed_rows = torch.div(fixed_keys, g.C, rounding_mode="floor")
    free = width - torch.bincount(fixed_rows, minlength=g.R)[: g.R]
    short = (got < torch.clamp(free, max=num)).nonzero().squeeze(1)
    r_out, c_out = rr[pick], cand[pick]
    if short.numel():
        keep = ~torch.isin(r_out, short)
        extra_r, extra_c = [r_out[keep]], [c_out[keep]]
        for row in short.tolist():
            cols = torch.arange(int(width[row]))
            cols = cols[~torch.isin(row * g.C + cols, fixed_keys)]
            sel = cols[torch.randperm(cols.numel(), generator=gen)[:num]]
            extra_r.append(torch.full_like(sel, row))
            extra_c.append(sel)
        r_out, c_out = torch.cat(extra_r), torch.cat(extra_c)
    return r_out, c_out


def bigbird(seqlen, block_size, *, window: int | None = None, num_global: int = 2, num_random: int = 3,
            seed: int = 0, num_heads: int = 1, causal: bool = False) -> BlockSparseLayout:
    """BigBird (Zaheer et al. 2020): sliding window ``|q - k| <= window`` (elements, default
    ``BLOCK_SIZE_KV``), the first ``num_global`` query blocks attend everywhere and the first
    ``num_global`` key blocks are attended by all, plus ``num_random`` random key blocks per
    query-block row drawn uniformly from the allowed blocks the window and global parts do not
    touch (all of them if fewer remain). Random blocks come from ``torch.Generator().manual_seed(
    seed)`` and differ per head when ``num_heads > 1`` (a per-head layout). Global and random blocks
    are whole blocks (intersected with ``k <= q`` under ``causal``). Defaults give about 15%
    density at N = 4096, block 64."""
    g = _Grid(seqlen, block_size)
    window = g.bk if window is None else _window(window, seqlen)
    num_global = _int(num_global, "num_global")
    num_random = _int(num_random, "num_random")
    H = _heads(num_heads)
    _bool(causal, "causal")
    lo = 0 if causal else -window
    ng_r, ng_c = min(num_global, g.R), min(num_global, g.C)
    fixed_count = g.band_count(lo, window) + _global_count(g, g.rows()[:ng_r], g.cols()[:ng_c], causal)
    _check_size(H * (fixed_count + num_random * g.R))
    rb, cb = g.band(lo, window)
    r1, c1 = g.rows()[:ng_r].repeat_interleave(g.C), g.cols().repeat(ng_r)
    r2, c2 = g.rows().repeat(ng_c), g.cols()[:ng_c].repeat_interleave(g.R)
    r, c = torch.cat([rb, r1, r2]), torch.cat([cb, c1, c2])
    last = torch.div(g.q_hi(g.rows()), g.bk, rounding_mode="floor").clamp(max=g.C - 1) if causal \
        else torch.full((g.R,), g.C - 1)
    ok = c <= last[r]
    r, c = r[ok], c[ok]
    fixed_keys = torch.unique(r * g.C + c)                  # sorted
    gen = _generator(seed)
    lids, rows, cols = [_zeros(r.numel())], [r], [c]
    rand = torch.zeros(0, dtype=torch.int64)
    for h in range(H):
        rr, rc = _random_blocks(g, num_random, fixed_keys, last + 1, gen)
        lids.append(torch.full_like(rr, h))
        rows.append(rr)
        cols.append(rc)
        rand = torch.cat([rand, (h * g.R + rr) * g.C + rc])
    if H > 1:  # the fixed part in every head
        lids = [torch.arange(H).repeat_interleave(r.numel())] + lids[1:]
        rows[0], cols[0] = r.repeat(H), c.repeat(H)
    lid, r, c = torch.cat(lids), torch.cat(rows), torch.cat(cols)
    rand = torch.sort(rand).values
    gq, gk = ng_r * g.bq, ng_c * g.bk

    def elem(lid_, q, k):
        block = ((lid_ * g.R + torch.div(q, g.bq, rounding_mode="floor")) * g.C
                 + torch.div(k, g.bk, rounding_mode="floor"))
        e = (((q - k) >= lo) & ((q - k) <= window)) | (q < gq) | (k < gk) | torch.isin(block, rand)
        return e & (k <= q) if causal else e

    def full(lid_, r_, c_):
        whole = (r_ < ng_r) | (c_ < ng_c) | g.inside_band(r_, c_, lo, window) \
            | torch.isin((lid_ * g.R + r_) * g.C + c_, rand)
        return whole & ((g.k_hi(c_) <= g.q_lo(r_)) if causal else True)

    def key(lid_, r_, c_):  # remaining blocks are band blocks, partial by their offset alone
        return g.d0(r_, c_).clamp(lo - g.bq, window + g.bk)[:, None]

    tag = f"w={window},g={num_global},r={num_random},seed={seed}"
    return _build(g, lid, r, c, elem, full=full, key=key, layout_heads=H, name=_tag("bigbird", tag, causal))


def random(seqlen, block_size, density: float = 0.1, *, seed: int = 0, num_heads: int = 1,
           causal: bool = False) -> BlockSparseLayout:
    """Exactly ``round(density * n)`` blocks per head (Python ``round``), chosen uniformly without
    replacement from the ``n`` allowed blocks (all blocks, or those holding an element with
    ``k <= q`` with ``causal``), with ``torch.Generator().manual_seed(seed)``; heads differ when
    ``num_heads > 1``. Chosen blocks are whole (intersected with ``k <= q`` under ``causal``)."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    g = _Grid(seqlen, block_size)
    H = _heads(num_heads)
    _bool(causal, "causal")
    if causal:
        ar, ac = g.band(0, math.inf)
    else:
        ar, ac = g.ranges(g.rows(), _zeros(g.R), torch.full((g.R,), g.C - 1))
    k = round(density * ar.numel())
    gen = _generator(seed)
    picks = [torch.randperm(ar.numel(), generator=gen)[:k] for _ in range(H)]
    lid = torch.arange(H).repeat_interleave(k)
    idx = torch.cat(picks)
    r, c = ar[idx], ac[idx]
    elem = (lambda lid_, q, k_: k_ <= q) if causal else (lambda lid_, q, k_: q >= 0)
    return _build(g, lid, r, c, elem,
                  full=lambda lid_, r_, c_: (g.k_hi(c_) <= g.q_lo(r_)) if causal else torch.ones_like(r_, dtype=torch.bool),
                  key=lambda lid_, r_, c_: g.d0(r_, c_).clamp(-g.bq, g.bk)[:, None], layout_heads=H,
                  name=_tag("random", f"d={density},seed={seed}", causal))


def _cu_seqlens(cu_seqlens) -> torch.Tensor:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of "
                            f"shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.detach().cpu().to(torch.int64)
    elif isinstance(cu_seqlens, Sequence) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        if any(abs(x) > MAX_SEQLEN for x in cu_seqlens):
            raise ValueError(f"cu_seqlens entries must be at most {MAX_SEQLEN}")
        cu = torch.tensor(list(cu_seqlens), dtype=torch.int64)
    else:
        raise TypeError(f"cu_seqlens must be a sequence of ints or a 1-D integer tensor, got "
                        f"{type(cu_seqlens).__name__}")
    if cu.numel() < 2 or cu[0] != 0 or (cu[1:] < cu[:-1]).any() or cu[-1] <= 0:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the total "
                         f"length > 0 (e.g. [0, 100, 300]), got {cu.tolist()[:8]}"
                         f"{'...' if cu.numel() > 8 else ''}")
    return cu


def document(cu_seqlens, block_size, *, causal: bool = False) -> BlockSparseLayout:
    """Packed variable-length sequences: document ``i`` holds positions ``[cu_seqlens[i],
    cu_seqlens[i+1])`` and attends only to itself (``causal``: ``k <= q`` within each document).
    ``cu_seqlens`` is a non-decreasing int sequence or 1-D int tensor starting at 0; ``seqlen =
    cu_seqlens[-1]`` for queries and keys. Blocks a document boundary crosses are partial, so no
    attention crosses documents."""
    cu = _cu_seqlens(cu_seqlens)
    n = int(cu[-1])
    g = _Grid(n, block_size)
    _bool(causal, "causal")
    bounds_ = cu[1:].contiguous()
    starts, ends = cu[:-1], cu[1:]
    nonempty = ends > starts
    starts, ends = starts[nonempty], ends[nonempty]
    r_first = torch.div(starts, g.bq, rounding_mode="floor")
    r_last = torch.div(ends - 1, g.bq, rounding_mode="floor")
    c_first = torch.div(starts, g.bk, rounding_mode="floor")
    c_last = torch.div(ends - 1, g.bk, rounding_mode="floor")
    # every (row, col) block pair of each document: rows of the document x its column range
    doc_of_row, rr = _expand(torch.arange(starts.numel()), r_first, r_last)
    r, c = g.ranges(rr, c_first[doc_of_row], c_last[doc_of_row])
    if causal:
        ok = g.k_lo(c) <= g.q_hi(r)
        r, c = r[ok], c[ok]

    def doc(x):  # document id of each position
        return torch.searchsorted(bounds_, x.contiguous(), right=True)

    def elem(lid, q, k):
        e = doc(q) == doc(k)
        return e & (k <= q) if causal else e

    # a row (column) block's document when one document holds all of it, else -1 (-2 for columns)
    first_doc, last_doc = doc(g.q_lo(g.rows())), doc(g.q_hi(g.rows()))
    row_doc = torch.where(first_doc == last_doc, first_doc, -1)
    first_doc, last_doc = doc(g.k_lo(g.cols())), doc(g.k_hi(g.cols()))
    col_doc = torch.where(first_doc == last_doc, first_doc, -2)

    def one_doc(r_, c_):
        return row_doc[r_] == col_doc[c_]

    def full(lid, r_, c_):
        one = one_doc(r_, c_)
        return one & ((g.k_hi(c_) <= g.q_lo(r_)) if causal else True)

    def key(lid, r_, c_):  # inside one document only the diagonal offset matters; else each block
        one = one_doc(r_, c_)
        own = torch.where(one, -1, r_ * g.C + c_)
        return torch.stack([own, torch.where(one, g.d0(r_, c_), 0)], 1)

    return _build(g, _zeros(r.numel()), r, c, elem, full=full, key=key,
                  name=_tag("document", f"n={int((cu[1:] > cu[:-1]).sum())}", causal))


block_diagonal = document


def prefix_lm(seqlen, block_size, prefix: int) -> BlockSparseLayout:
    """Prefix LM: the first ``prefix`` positions are attended by every query (bidirectional prefix),
    the rest causally: ``k < prefix`` or ``k <= q``."""
    g = _Grid(seqlen, block_size)
    prefix = min(_int(prefix, "prefix"), g.sk)
    pcols = g.cols()[: -(-prefix // g.bk)] if prefix else _zeros(0)
    _check_size(g.band_count(0, math.inf) + pcols.numel() * g.R)
    rc, cc = g.band(0, math.inf)
    r = torch.cat([rc, g.rows().repeat(pcols.numel())])
    c = torch.cat([cc, pcols.repeat_interleave(g.R)])

    def key(lid, r_, c_):
        return torch.stack([g.d0(r_, c_).clamp(-g.bq, g.bk), (prefix - g.k_lo(c_)).clamp(0, g.bk)], 1)

    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: (k < prefix) | (k <= q),
                  full=lambda lid, r_, c_: (g.k_hi(c_) < prefix) | (g.k_hi(c_) <= g.q_lo(r_)), key=key,
                  name=f"prefix_lm(prefix={prefix})")


# ---------------------------------------------------------------------------------------- specs
def _document_spec(seqlen, block_size, num_docs: int = 4, lengths=None, cu_seqlens=None, *,
                   causal: bool = False) -> BlockSparseLayout:
    """``document`` for specs: ``cu_seqlens``, document ``lengths`` or ``num_docs`` equal parts of
    ``seqlen`` (the last one takes the remainder)."""
    total = as_pair(seqlen, "seqlen")
    if total[0] != total[1]:
        raise ValueError(f"document needs seqlen_q == seqlen_k, got {total}")
    total = total[0]
    if cu_seqlens is None:
        if lengths is None:
            num_docs = _int(num_docs, "num_docs", 1)
            step = max(1, total // num_docs)
            lengths = [step] * (min(num_docs, total) - 1)
            lengths.append(total - sum(lengths))
        lengths = [lengths] if isinstance(lengths, int) else list(lengths)
        cu_seqlens = [0]
        for x in lengths:
            cu_seqlens.append(cu_seqlens[-1] + _int(x, "document length"))
    if list(cu_seqlens)[-1] != total:
        raise ValueError(f"the documents must cover seqlen = {total} positions, got "
                         f"{list(cu_seqlens)[-1]}")
    return document(list(cu_seqlens), block_size, causal=causal)


def _causal_spec(seqlen, block_size, flag) -> BlockSparseLayout:
    if flag is not True:
        raise ValueError(f"pattern 'causal' cannot be built with causal={flag!r}; use 'dense'")
    return causal(seqlen, block_size)


# name -> (builder taking (seqlen, block_size, **kw), positional spec parameters)
_REGISTRY: dict[str, tuple[Callable[..., BlockSparseLayout], tuple[str, ...]]] = {
    "dense": (dense, ()),
    "causal": (lambda seqlen, block_size, *, causal=True: _causal_spec(seqlen, block_size, causal), ()),
    "sliding_window": (sliding_window, ("window",)),
    "strided": (strided, ("stride",)),
    "fixed": (fixed, ("stride", "summary")),
    "longformer": (longformer, ("window", "global_tokens")),
    "bigbird": (bigbird, ("window", "num_global", "num_random")),
    "random": (random, ("density",)),
    "document": (_document_spec, ("num_docs",)),
    "prefix_lm": (lambda seqlen, block_size, prefix=None: prefix_lm(
        seqlen, block_size, as_pair(seqlen, "seqlen")[1] // 4 if prefix is None else prefix), ("prefix",)),
}
_NAME_ALIASES = {"block_diagonal": "document", "local": "sliding_window", "window": "sliding_window"}
#: positional parameters of each pattern in a spec, in order
SPEC_PARAMS = {name: params for name, (_, params) in _REGISTRY.items()}
#: short keys accepted in specs (pattern-specific ones first)
ALIASES = {"w": "window", "g": "num_global", "global": "num_global", "r": "num_random",
           "random": "num_random", "d": "density", "c": "summary", "heads": "num_heads",
           "n": "num_docs", "docs": "num_docs"}
_FLAGS = ("causal",)
_PER_PATTERN_ALIASES = {"longformer": {"g": "global_tokens", "global": "global_tokens"}}


def available() -> list[str]:
    """Pattern names accepted by :func:`get` and :func:`from_spec`."""
    return sorted(_REGISTRY) + sorted(_NAME_ALIASES)


def _builder(name: str):
    key = _NAME_ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown pattern {name!r}; known patterns: {', '.join(available())}")
    return key, _REGISTRY[key]


def _accepted(fn) -> set[str]:
    import inspect

    return {p for p in inspect.signature(fn).parameters if p not in ("seqlen", "block_size")}


def get(name: str, seqlen, block_size, **kwargs) -> BlockSparseLayout:
    """Build pattern ``name`` (see :func:`available`) for ``seqlen`` and ``block_size``.

    ``num_heads`` and ``seed`` are passed to the patterns that use them (``bigbird``, ``random``)
    and ignored by deterministic ones, whose single shared mask already broadcasts over heads.
    """
    key, (fn, _) = _builder(name)
    accepted = _accepted(fn)
    for ignorable in ("num_heads", "seed"):
        if ignorable in kwargs and ignorable not in accepted:
            kwargs.pop(ignorable)
    unknown = set(kwargs) - accepted
    if unknown:
        raise ValueError(f"pattern {key!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
                         f"{sorted(accepted) or 'none'}")
    return fn(seqlen, block_size, **kwargs)


def _parse_value(text: str, what: str):
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if "/" in t:
        return [_parse_value(x, what) for x in t.split("/")]
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"cannot read value {t!r} of {what}: expected an int, a float, true/false "
                         f"or ints separated by '/'") from None


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"bigbird:window=256,global=1"`` -> ``("bigbird", {"window": 256, "num_global": 1})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a pattern spec is a non-empty string like 'sliding_window:512', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    key, (fn, positional) = _builder(name)
    aliases = {**ALIASES, **_PER_PATTERN_ALIASES.get(key, {})}
    accepted = _accepted(fn) | {"num_heads", "seed"}
    kwargs: dict = {}
    n_pos = 0
    for raw in (a for a in rest.split(",") if a.strip()) if rest else ():
        if "=" in raw:
            k, _, v = raw.partition("=")
            k = aliases.get(k.strip(), k.strip())
            if k not in accepted:
                raise ValueError(f"pattern {key!r} has no parameter {k!r} (spec {spec!r}); it accepts "
                                 f"{sorted(accepted)}")
            kwargs[k] = _parse_value(v, f"{k} in {spec!r}")
        elif raw.strip() in _FLAGS and raw.strip() in accepted:
            kwargs[raw.strip()] = True  # a bare flag such as "causal"
        else:
            if n_pos >= len(positional):
                raise ValueError(f"pattern {key!r} takes {len(positional)} positional value(s) "
                                 f"{list(positional)}, got more in {spec!r}; use KEY=VALUE")
            kwargs[positional[n_pos]] = _parse_value(raw, f"{positional[n_pos]} in {spec!r}")
            n_pos += 1
    return key, kwargs


def from_spec(spec: str, seqlen, block_size, **kwargs) -> BlockSparseLayout:
    """Build a layout from a spec string (grammar in the module docstring), e.g.
    ``from_spec("bigbird", seqlen=4096, block_size=64)`` or ``from_spec("sliding_window:512", 4096,
    64)``. ``kwargs`` (such as ``num_heads``, ``seed``, ``causal``) are defaults the spec overrides."""
    key, spec_kwargs = parse_spec(spec)
    return get(key, seqlen, block_size, **{**kwargs, **spec_kwargs})
