"""The machinery every pattern builder shares: the block grid of a layout (bands, diagonals,
element spans), the memory check made before any block is listed, candidate enumeration and the
evaluation of a pattern's element definition on its possibly partial blocks."""
from __future__ import annotations

import math
from typing import Callable

import torch

from sparse_io_attn import _memory
from sparse_io_attn.layout import _bits, convert
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout._assemble import inrange_words
from sparse_io_attn.layout.core import BlockSparseLayout, assemble, assemble_ids

#: element evaluations per chunk when partial blocks are expanded (bounds the temporary memory)
_EVAL_CHUNK = 1 << 24
#: largest sequence length accepted (positions and block products stay far inside int64)
MAX_SEQLEN = 1 << 40



class _Grid:
    """Block extents of a ``seqlen`` x ``block_size`` grid: ``q_lo/q_hi [R]``, ``k_lo/k_hi [C]``
    (first and last in-range element of each block, int64).

    ``rows=(start, stop)`` lists only the query positions ``[start, stop)``, in ``R`` blocks of
    ``BLOCK_SIZE_Q`` from ``start`` (the layout :meth:`~sparse_io_attn.BlockSparseLayout.rows`
    returns): ``q_lo``/``q_hi`` stay absolute positions, so element definitions and block keys read as
    for the whole grid, and a builder lists the candidates of these rows only. Builders whose
    definition is tied to the whole grid's query blocks (random blocks per block row) pass
    ``aligned=True``: the rows are then the whole grid's block rows ``r0 ..`` holding the positions,
    and :func:`_build` re-blocks the result from ``start``."""

    def __init__(self, seqlen, block_size, rows=None, *, aligned: bool = False):
        self.sq, self.sk = as_pair(seqlen, "seqlen")
        self.bq, self.bk = as_pair(block_size, "block_size")
        if max(self.sq, self.sk) > MAX_SEQLEN:
            raise ValueError(f"seqlen must be at most {MAX_SEQLEN}, got {(self.sq, self.sk)}")
        self.R_all, self.C = math.ceil(self.sq / self.bq), math.ceil(self.sk / self.bk)
        self.start, self.stop = _row_range(rows, self.sq)
        self.restricted = rows is not None
        self.r0 = self.start // self.bq if aligned else 0       # aligned: the whole grid's first row listed
        self.q_first = self.r0 * self.bq if aligned else self.start      # first query position listed
        q_end = min(math.ceil(self.stop / self.bq) * self.bq, self.sq) if aligned else self.stop
        self.nq = q_end - self.q_first                                    # query positions listed
        self.q_last = q_end - 1
        self.R = math.ceil(self.nq / self.bq)
        self._q_hi = None

    def q_lo(self, r):
        return self.q_first + r * self.bq

    def q_hi(self, r):   # r, c: block indices in [0, R), [0, C)
        if self._q_hi is None:   # a table: one gather per call instead of four passes over r
            self._q_hi = torch.clamp(self.q_first + (self.rows() + 1) * self.bq, max=self.q_last + 1) - 1
        return self._q_hi[r]

    def k_lo(self, c):
        return c * self.bk

    def k_hi(self, c):           # computed, not tabled: a table would be O(seqlen_k) for a few rows
        return torch.clamp((c + 1) * self.bk, max=self.sk) - 1

    def rows(self) -> torch.Tensor:
        return torch.arange(self.R)

    def cols(self) -> torch.Tensor:
        return torch.arange(self.C)

    def row_of(self, q: torch.Tensor) -> torch.Tensor:
        """The listed row holding query position ``q`` (absolute): negative before the rows."""
        return torch.div(q - self.q_first, self.bq, rounding_mode="floor")

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
        qa = torch.clamp(d, min=self.q_first)
        qb = torch.clamp(d + self.sk - 1, max=self.q_last)
        a, b, e = qa - self.q_first, qb - self.q_first, d - self.q_first   # rows start at multiples of bq; k = a - e
        rows = torch.div(b, self.bq, rounding_mode="floor") - torch.div(a, self.bq, rounding_mode="floor") + 1
        cols = torch.div(b - e, self.bk, rounding_mode="floor") - torch.div(a - e, self.bk, rounding_mode="floor") + 1
        # boundaries crossed together: a = bq * j (j in [ja, jb]) with a = e (mod bk)
        g = math.gcd(self.bq, self.bk)
        m = self.bk // g
        inv = pow(self.bq // g, -1, m) if m > 1 else 0
        j0 = torch.remainder(torch.div(e, g, rounding_mode="floor"), m) * inv % m
        ja = torch.div(a, self.bq, rounding_mode="floor") + 1
        jb = torch.div(b, self.bq, rounding_mode="floor")
        both = torch.div(jb - j0, m, rounding_mode="floor") - torch.div(ja - 1 - j0, m, rounding_mode="floor")
        both = torch.where(torch.remainder(e, g) == 0, both, 0)
        cells = torch.where(qa <= qb, rows + cols - 1 - both, 0)
        return int(cells.sum())

    def thin_bands(self, offsets: torch.Tensor):
        """Blocks holding an in-range element of a thin band ``q - k = d``, for every ``d`` in
        ``offsets``: ``(r, c)``, listed without a loop over the bands (each band's rows, then each
        row's columns), O(the blocks returned)."""
        d = offsets.to(torch.int64)
        qa = torch.clamp(d, min=self.q_first)
        qb = torch.clamp(d + self.sk - 1, max=self.q_last)
        r_first = self.row_of(qa)
        r_last = torch.where(qa <= qb, self.row_of(qb), r_first - 1)
        d, r = _expand(d, r_first, r_last)
        a = torch.maximum(self.q_lo(r), d)
        b = torch.minimum(self.q_hi(r), d + self.sk - 1)
        return _expand(r, torch.div(a - d, self.bk, rounding_mode="floor"),
                       torch.div(b - d, self.bk, rounding_mode="floor"))

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


def _row_range(rows, seqlen_q: int) -> tuple[int, int]:
    """``rows=(start, stop)`` of a builder -> the query positions asked for (all for ``None``);
    ``ValueError`` naming the accepted form otherwise."""
    if rows is None:
        return 0, seqlen_q
    ok = isinstance(rows, (tuple, list)) and len(rows) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in rows)
    if not ok or not 0 <= rows[0] < rows[1] <= seqlen_q:
        raise ValueError(f"rows must be a pair of ints (start, stop) with 0 <= start < stop <= seqlen_q = "
                         f"{seqlen_q} (the query positions to build), got {rows!r}")
    return int(rows[0]), int(rows[1])


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
    """Candidate blocks (any superset of the kept ones, duplicates allowed; ``r`` the grid's listed
    rows) -> exact layout (of the rows asked for, when the grid is restricted).

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
    edge = ((r + 1) * g.bq > g.nq) | ((c + 1) * g.bk > g.sk)
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
        whole = inrange_words(r[reps], c[reps], (g.bq, g.bk), (g.nq, g.sk))
        words = _evaluate(g, elem, lid[reps], r[reps], c[reps]) & whole
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
    if not g.restricted:
        return assemble_ids(lid, r, c, ids, uniq, block_size=(g.bq, g.bk), seqlen=(g.sq, g.sk),
                            layout_batch=1, layout_heads=layout_heads, name=name)
    name = f"{name}[{g.start}:{g.stop}]"
    layout = assemble_ids(lid, r, c, ids, uniq, block_size=(g.bq, g.bk), seqlen=(g.nq, g.sk), layout_batch=1,
                          layout_heads=layout_heads, name=name)
    first = g.start - g.q_first
    if first == 0 and g.stop - g.start == g.nq:     # the rows listed are the rows asked for
        return layout
    return assemble(**convert.row_blocks(layout, first, g.stop - g.q_first)._asdict(), name=name)




def _member(x: torch.Tensor, sorted_keys: torch.Tensor) -> torch.Tensor:
    """``torch.isin(x, sorted_keys)`` for an ascending ``sorted_keys``, by binary search into the
    keys: O(|x| log |keys|), ``x`` is never sorted."""
    if sorted_keys.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    at = torch.searchsorted(sorted_keys, x).clamp(max=sorted_keys.numel() - 1)
    return sorted_keys[at] == x


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
        q = g.q_lo(r[sl])[:, None, None] + iq[None, :, None]
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


def _reach(distance: int, seqlen) -> int:
    """A distance in elements (window, stride) capped at the longest possible one, ``seqlen_q +
    seqlen_k``: a larger one changes nothing. Builders compute with the capped value and name the
    layout with the one asked for."""
    sq, sk = as_pair(seqlen, "seqlen")
    return min(distance, sq + sk)


def _zeros(n):
    return torch.zeros(n, dtype=torch.int64)
