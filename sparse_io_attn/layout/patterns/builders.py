"""The pattern builders (element definitions in :mod:`sparse_io_attn.layout.patterns`): each
returns an element-exact :class:`~sparse_io_attn.BlockSparseLayout` with a name that states the
parameters asked for."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns._grid import (MAX_SEQLEN, _Grid, _bool, _build, _check_size, _default_window,
                                                  _expand, _generator, _heads, _int, _member, _reach, _span_lengths, _tag,
                                                  _zeros)

def dense(seqlen, block_size, *, causal: bool = False, rows=None) -> BlockSparseLayout:
    """Every element (``causal=True`` gives the same as :func:`causal`)."""
    if _bool(causal, "causal"):
        return causal_(seqlen, block_size, rows=rows)
    g = _Grid(seqlen, block_size, rows)
    r, c = g.ranges(g.rows(), _zeros(g.R), torch.full((g.R,), g.C - 1))
    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: q >= 0,
                  full=lambda lid, r, c: torch.ones(r.numel(), dtype=torch.bool), name="dense")


def causal(seqlen, block_size, *, rows=None) -> BlockSparseLayout:
    """Lower triangle ``k <= q`` (top-left aligned, also for rectangular blocks and ``seqlen_q !=
    seqlen_k``): blocks below the diagonal are full, blocks it crosses are partial."""
    g = _Grid(seqlen, block_size, rows)
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
                   causal: bool = False, rows=None) -> BlockSparseLayout:
    """Local band: ``|q - k| <= window`` (``0 <= q - k <= window`` with ``causal``), ``window`` in
    elements (default ``seqlen_k // 25``)."""
    asked = _default_window(seqlen) if window is None else _int(window, "window")
    window = _reach(asked, seqlen)
    g = _Grid(seqlen, block_size, rows)
    lo = 0 if _bool(causal, "causal") else -window
    return _band_layout(g, lo, window, _tag("sliding_window", f"w={asked}", causal))


def strided(seqlen, block_size, stride: int | None = None, *, causal: bool = False, rows=None) -> BlockSparseLayout:
    """Sparse Transformer "strided" (Child et al. 2019): a local window ``|q - k| < stride`` plus
    every ``stride``-th diagonal ``(q - k) % stride == 0``; ``causal`` keeps ``q - k >= 0`` only.
    Default ``stride = 8 * BLOCK_SIZE_KV``."""
    g = _Grid(seqlen, block_size, rows)
    asked = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    stride = _reach(asked, seqlen)
    lo = 0 if _bool(causal, "causal") else -(stride - 1)
    if stride < g.bq + g.bk:  # every block's range of q - k holds a multiple of the stride
        r, c = g.band(lo if causal else -math.inf, math.inf)
    else:                     # the local band plus one thin band per stride-th diagonal the rows meet
        m_first = -((g.sk - 1 - g.q_first) // stride)        # d = q - k >= q_first - (seqlen_k - 1)
        diagonals = torch.arange(max(m_first, 0) if causal else m_first, g.q_last // stride + 1) * stride
        _check_size(g.band_count(lo, stride - 1) + g.diagonals_count(diagonals))
        rb, cb = g.band(lo, stride - 1)
        rd, cd = g.thin_bands(diagonals)
        r, c = torch.cat([rb, rd]), torch.cat([cb, cd])

    def elem(lid, q, k):
        d = q - k
        e = (d.abs() < stride) | (torch.remainder(d, stride) == 0)
        return e & (d >= 0) if causal else e

    return _build(g, _zeros(r.numel()), r, c, elem,
                  full=lambda lid, r, c: g.inside_band(r, c, lo, stride - 1),
                  key=lambda lid, r, c: g.d0(r, c)[:, None], name=_tag("strided", f"stride={asked}", causal))


def fixed(seqlen, block_size, stride: int | None = None, summary: int | None = None, *,
          causal: bool = False, rows=None) -> BlockSparseLayout:
    """Sparse Transformer "fixed" (Child et al. 2019): attend within the same chunk of ``stride``
    positions (``q // stride == k // stride``) and to the last ``summary`` positions of every chunk
    (``k % stride >= stride - summary``). Defaults: ``stride = 8 * BLOCK_SIZE_KV``,
    ``summary = BLOCK_SIZE_KV`` (capped at ``stride``)."""
    g = _Grid(seqlen, block_size, rows)
    stride = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    summary = min(g.bk, stride) if summary is None else _int(summary, "summary", 1)
    if summary > stride:
        raise ValueError(f"summary must be <= stride ({stride}), got {summary}")
    asked = (stride, summary)
    if stride > g.sq + g.sk:   # one chunk holds every position: the pattern is dense, whatever summary
        stride, summary = g.sq + g.sk, 0
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
    first_row = g.row_of(first_summary[scols]).clamp(min=0) if causal else _zeros(scols.numel())
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
                  name=_tag("fixed", f"stride={asked[0]},c={asked[1]}", causal))


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
    per_col = (g.R - g.row_of(g.k_lo(gcols)).clamp(min=0)).clamp(min=0)
    return int(per_row.sum() + per_col.sum())


def _pattern_ids(pos: torch.Tensor, first: int, size: int):
    """Which of the sorted positions ``pos`` (``>= first``) each block of ``size`` positions from
    ``first`` holds, as ``(blocks, ids)``: the blocks holding one (ascending) and an id per block
    (equal ids: the same offsets held), from the positions only (O(len(pos))); other blocks have id
    0 (:func:`_pattern_id_of`)."""
    rel = pos[pos >= first] - first
    block, offset = torch.div(rel, size, rounding_mode="floor"), rel % size
    held, inverse = torch.unique(block, return_inverse=True)
    bits = torch.zeros(held.numel(), size, dtype=torch.bool)
    bits[inverse, offset] = True
    if not held.numel():
        return held, _zeros(0)
    return held, torch.unique(bits, dim=0, return_inverse=True)[1] + 1


def _pattern_id_of(table, block: torch.Tensor) -> torch.Tensor:
    """The :func:`_pattern_ids` id of each ``block`` (0 for a block holding none)."""
    held, ids = table
    if not held.numel():
        return torch.zeros_like(block)
    at = torch.searchsorted(held, block).clamp(max=held.numel() - 1)
    return torch.where(held[at] == block, ids[at], 0)


def longformer(seqlen, block_size, window: int | None = None, global_tokens: int | Sequence[int] = 1,
               *, causal: bool = False, rows=None) -> BlockSparseLayout:
    """Longformer: sliding window ``|q - k| <= window`` plus global tokens, whose rows (as queries)
    and columns (as keys) are complete. ``global_tokens`` is a count (the first ``n`` positions) or a
    sequence of positions; ``window`` in elements (default ``seqlen_k // 25``)."""
    g = _Grid(seqlen, block_size, rows)
    asked = _default_window(seqlen) if window is None else _int(window, "window")
    window = _reach(asked, seqlen)
    pos, count = _global_positions(global_tokens, g)
    _bool(causal, "causal")
    lo = 0 if causal else -window
    q_pos = pos[(pos >= g.q_first) & (pos <= g.q_last)]        # global queries of the rows listed
    k_pos = pos[pos < g.sk]
    grows = torch.unique(g.row_of(q_pos))
    gcols = torch.unique(torch.div(k_pos, g.bk, rounding_mode="floor"))
    _check_size(g.band_count(lo, window) + _global_count(g, grows, gcols, causal))
    rb, cb = g.band(lo, window)
    r1 = grows.repeat_interleave(g.C)         # global query rows: every key block (none listed when no row is)
    c1 = g.cols().repeat(grows.numel()) if grows.numel() else _zeros(0)
    r2, c2 = g.rows().repeat(gcols.numel()), gcols.repeat_interleave(g.R)
    r, c = torch.cat([rb, r1, r2]), torch.cat([cb, c1, c2])
    if causal:
        ok = g.k_lo(c) <= g.q_hi(r)
        r, c = r[ok], c[ok]
    row_ids, col_ids = _pattern_ids(q_pos, g.q_first, g.bq), _pattern_ids(k_pos, 0, g.bk)

    def elem(lid, q, k):
        e = (((q - k) >= lo) & ((q - k) <= window)) | _member(q, q_pos) | _member(k, k_pos)
        return e & (k <= q) if causal else e

    def full(lid, r, c):
        inside = g.inside_band(r, c, lo, window)
        return inside & ((g.k_hi(c) <= g.q_lo(r)) if causal else True)

    def key(lid, r, c):
        return torch.stack([g.d0(r, c).clamp(lo - g.bq, window + g.bk), _pattern_id_of(row_ids, r),
                            _pattern_id_of(col_ids, c)], 1)

    return _build(g, _zeros(r.numel()), r, c, elem, full=full, key=key,
                  name=_tag("longformer", f"w={asked},g={count}", causal))


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
    ok = (width[:, None] > 0) & ~_member(key, fixed_keys)
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
        keep = ~_member(r_out, short)
        extra_r, extra_c = [r_out[keep]], [c_out[keep]]
        for row in short.tolist():
            cols = torch.arange(int(width[row]))
            cols = cols[~_member(row * g.C + cols, fixed_keys)]
            sel = cols[torch.randperm(cols.numel(), generator=gen)[:num]]
            extra_r.append(torch.full_like(sel, row))
            extra_c.append(sel)
        r_out, c_out = torch.cat(extra_r), torch.cat(extra_c)
    return r_out, c_out


def bigbird(seqlen, block_size, *, window: int | None = None, num_global: int = 2, num_random: int = 3,
            seed: int = 0, num_heads: int = 1, causal: bool = False, rows=None) -> BlockSparseLayout:
    """BigBird (Zaheer et al. 2020): sliding window ``|q - k| <= window`` (elements, default
    ``BLOCK_SIZE_KV``), the first ``num_global`` query blocks attend everywhere and the first
    ``num_global`` key blocks are attended by all, plus ``num_random`` random key blocks per
    query-block row drawn uniformly from the allowed blocks the window and global parts do not
    touch (all of them if fewer remain). Random blocks come from ``torch.Generator().manual_seed(
    seed)`` and differ per head when ``num_heads > 1`` (a per-head layout). Global and random blocks
    are whole blocks (intersected with ``k <= q`` under ``causal``). Defaults give about 15%
    density at N = 4096, block 64.

    With ``rows=``, the random draws are still made for every row (they are one sequence of draws
    over all rows and heads, so a row's blocks depend on the rows before it): O(rows of the whole
    grid x (num_random + the window's blocks)); the evaluation and assembly cover the rows asked for."""
    g = _Grid(seqlen, block_size, rows, aligned=True)             # random blocks per block row
    gf = _Grid(seqlen, block_size) if g.restricted else g          # the whole grid: the random draws
    asked = g.bk if window is None else _int(window, "window")
    window = _reach(asked, seqlen)
    num_global = _int(num_global, "num_global")
    num_random = _int(num_random, "num_random")
    H = _heads(num_heads)
    _bool(causal, "causal")
    lo = 0 if causal else -window
    ng_r, ng_c = min(num_global, g.R_all), min(num_global, g.C)   # global rows of the whole grid

    def fixed(grid: _Grid):
        """Window, global rows and global columns of the grid's rows, causally allowed; the last
        allowed column of each row."""
        grows = grid.rows()[: max(0, ng_r - grid.r0)]
        rb, cb = grid.band(lo, window)
        r1, c1 = grows.repeat_interleave(grid.C), grid.cols().repeat(grows.numel())
        r2, c2 = grid.rows().repeat(ng_c), grid.cols()[:ng_c].repeat_interleave(grid.R)
        r_, c_ = torch.cat([rb, r1, r2]), torch.cat([cb, c1, c2])
        last = torch.div(grid.q_hi(grid.rows()), grid.bk, rounding_mode="floor").clamp(max=grid.C - 1) if causal \
            else torch.full((grid.R,), grid.C - 1)
        ok = c_ <= last[r_]
        return r_[ok], c_[ok], last

    def count(grid: _Grid) -> int:
        grows = grid.rows()[: max(0, ng_r - grid.r0)]
        return grid.band_count(lo, window) + _global_count(grid, grows, grid.cols()[:ng_c], causal)

    _check_size(H * (count(gf) + min(num_random, g.C) * gf.R) + (H * count(g) if g.restricted else 0))
    r, c, last = fixed(gf)
    fixed_keys = torch.unique(r * g.C + c)                  # sorted
    gen = _generator(seed)
    rand = []
    for h in range(H):
        rr, rc = _random_blocks(gf, min(num_random, g.C), fixed_keys, last + 1, gen)
        rand.append((h * g.R_all + rr) * g.C + rc)
    rand = torch.sort(torch.cat(rand)).values             # (head, row of the whole grid, column) keys
    if g.restricted:
        r, c, _ = fixed(g)
    h_, rest = torch.div(rand, g.R_all * g.C, rounding_mode="floor"), rand % (g.R_all * g.C)
    rr, rc = g.row_of(torch.div(rest, g.C, rounding_mode="floor") * g.bq), rest % g.C
    mine = (rr >= 0) & (rr < g.R)
    lid = torch.cat([torch.arange(H).repeat_interleave(r.numel()), h_[mine]])
    r, c = torch.cat([r.repeat(H), rr[mine]]), torch.cat([c.repeat(H), rc[mine]])
    gq, gk = ng_r * g.bq, ng_c * g.bk

    def elem(lid_, q, k):
        block = ((lid_ * g.R_all + torch.div(q, g.bq, rounding_mode="floor")) * g.C
                 + torch.div(k, g.bk, rounding_mode="floor"))
        e = (((q - k) >= lo) & ((q - k) <= window)) | (q < gq) | (k < gk) | _member(block, rand)
        return e & (k <= q) if causal else e

    def whole_block(lid_, r_, c_):   # a global or random block: every element (then causality)
        return (g.r0 + r_ < ng_r) | (c_ < ng_c) | _member((lid_ * g.R_all + g.r0 + r_) * g.C + c_, rand)

    def full(lid_, r_, c_):
        whole = whole_block(lid_, r_, c_) | g.inside_band(r_, c_, lo, window)
        return whole & ((g.k_hi(c_) <= g.q_lo(r_)) if causal else True)

    def key(lid_, r_, c_):  # band blocks by their offset; whole blocks cut by the causal diagonal by theirs
        return torch.stack([g.d0(r_, c_).clamp(lo - g.bq, window + g.bk), whole_block(lid_, r_, c_).long()], 1)

    tag = f"w={asked},g={num_global},r={num_random},seed={seed}"
    return _build(g, lid, r, c, elem, full=full, key=key, layout_heads=H, name=_tag("bigbird", tag, causal))


def random(seqlen, block_size, density: float = 0.1, *, seed: int = 0, num_heads: int = 1,
           causal: bool = False, rows=None) -> BlockSparseLayout:
    """Exactly ``round(density * n)`` blocks per head (Python ``round``), chosen uniformly without
    replacement from the ``n`` allowed blocks (all blocks, or those holding an element with
    ``k <= q`` with ``causal``), with ``torch.Generator().manual_seed(seed)``; heads differ when
    ``num_heads > 1``. Chosen blocks are whole (intersected with ``k <= q`` under ``causal``).
    With ``rows=``, the draw is still made over every block (one permutation of them all), then the
    rows asked for are kept."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    g = _Grid(seqlen, block_size, rows, aligned=True)             # the draw is per block of the whole grid
    gf = _Grid(seqlen, block_size) if g.restricted else g
    H = _heads(num_heads)
    _bool(causal, "causal")
    if causal:
        ar, ac = gf.band(0, math.inf)
    else:
        ar, ac = gf.ranges(gf.rows(), _zeros(gf.R), torch.full((gf.R,), gf.C - 1))
    k = round(density * ar.numel())
    gen = _generator(seed)
    picks = [torch.randperm(ar.numel(), generator=gen)[:k] for _ in range(H)]
    lid = torch.arange(H).repeat_interleave(k)
    idx = torch.cat(picks)
    r, c = ar[idx] - g.r0, ac[idx]
    mine = (r >= 0) & (r < g.R)
    lid, r, c = lid[mine], r[mine], c[mine]
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


def _boundary_ids(doc, first: torch.Tensor, crossed: torch.Tensor, size: int) -> torch.Tensor:
    """Per block of ``size`` positions (starting at ``first``), an id of where documents change
    inside it (0: none, the blocks not ``crossed``); blocks with equal ids see the same document
    boundaries at the same offsets (``doc``: position -> document id)."""
    ids = torch.zeros(crossed.numel(), dtype=torch.int64)
    blocks = crossed.nonzero().squeeze(1)
    if blocks.numel():
        docs = doc(first[blocks][:, None] + torch.arange(size)[None, :])          # [blocks, size]
        _, inverse = torch.unique(docs - docs[:, :1], dim=0, return_inverse=True)
        ids[blocks] = inverse + 1
    return ids


def document(cu_seqlens, block_size, *, causal: bool = False, rows=None) -> BlockSparseLayout:
    """Packed variable-length sequences: document ``i`` holds positions ``[cu_seqlens[i],
    cu_seqlens[i+1])`` and attends only to itself (``causal``: ``k <= q`` within each document).
    ``cu_seqlens`` is a non-decreasing int sequence or 1-D int tensor starting at 0; ``seqlen =
    cu_seqlens[-1]`` for queries and keys. Blocks a document boundary crosses are partial, so no
    attention crosses documents."""
    cu = _cu_seqlens(cu_seqlens)
    n = int(cu[-1])
    g = _Grid(n, block_size, rows)
    _bool(causal, "causal")
    bounds_ = cu[1:].contiguous()
    starts, ends = cu[:-1], cu[1:]
    nonempty = ends > starts
    starts, ends = starts[nonempty], ends[nonempty]
    r_first = g.row_of(starts).clamp(min=0)                      # the rows listed that each document meets
    r_last = g.row_of(ends - 1).clamp(max=g.R - 1)
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

    # a row (column) block's document when one document holds all of it, else -1 (-2 for columns);
    # columns: only the candidates' (a table of every column would be O(seqlen_k) for a few rows)
    first_doc, last_doc = doc(g.q_lo(g.rows())), doc(g.q_hi(g.rows()))
    row_doc = torch.where(first_doc == last_doc, first_doc, -1)
    row_pat = _boundary_ids(doc, g.q_lo(g.rows()), row_doc < 0, g.bq)
    row_first = first_doc
    held = torch.unique(c) if g.restricted else g.cols()     # the whole grid's candidates meet about every column
    first_doc, last_doc = doc(g.k_lo(held)), doc(g.k_hi(held))
    held_doc = torch.where(first_doc == last_doc, first_doc, -2)
    held_pat = _boundary_ids(doc, g.k_lo(held), held_doc < 0, g.bk)
    held_first = first_doc

    def col(table, c_):
        return table[torch.searchsorted(held, c_)] if g.restricted else table[c_]

    def one_doc(r_, c_):
        return row_doc[r_] == col(held_doc, c_)

    def full(lid, r_, c_):
        one = one_doc(r_, c_)
        return one & ((g.k_hi(c_) <= g.q_lo(r_)) if causal else True)

    def key(lid, r_, c_):
        # (q, k) allowed iff doc(q) == doc(k): fixed by where the documents change inside the row
        # block and inside the column block and by how their first documents differ (plus the
        # diagonal offset under causal, clipped where it no longer changes the block)
        parts = [row_pat[r_], col(held_pat, c_), col(held_first, c_) - row_first[r_]]
        if causal:
            parts.append(g.d0(r_, c_).clamp(-g.bq, g.bk))
        return torch.stack(parts, 1)

    return _build(g, _zeros(r.numel()), r, c, elem, full=full, key=key,
                  name=_tag("document", f"n={int((cu[1:] > cu[:-1]).sum())}", causal))


block_diagonal = document


def prefix_lm(seqlen, block_size, prefix: int, *, rows=None) -> BlockSparseLayout:
    """Prefix LM: the first ``prefix`` positions are attended by every query (bidirectional prefix),
    the rest causally: ``k < prefix`` or ``k <= q``."""
    g = _Grid(seqlen, block_size, rows)
    asked = _int(prefix, "prefix")
    prefix = min(asked, g.sk)     # keys past the sequence change nothing
    pcols = g.cols()[: -(-prefix // g.bk)] if prefix else _zeros(0)
    _check_size(g.band_count(0, math.inf) + pcols.numel() * g.R)
    rc, cc = g.band(0, math.inf)
    r = torch.cat([rc, g.rows().repeat(pcols.numel())])
    c = torch.cat([cc, pcols.repeat_interleave(g.R)])

    def key(lid, r_, c_):
        return torch.stack([g.d0(r_, c_).clamp(-g.bq, g.bk), (prefix - g.k_lo(c_)).clamp(0, g.bk)], 1)

    return _build(g, _zeros(r.numel()), r, c, lambda lid, q, k: (k < prefix) | (k <= q),
                  full=lambda lid, r_, c_: (g.k_hi(c_) < prefix) | (g.k_hi(c_) <= g.q_lo(r_)), key=key,
                  name=f"prefix_lm(prefix={asked})")
