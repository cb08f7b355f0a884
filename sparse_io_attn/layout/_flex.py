"""The ``mask_mod`` of the FlexAttention export (:func:`~sparse_io_attn.layout.convert.to_flex_block_mask`):
arithmetic where the layout's element masks are arithmetic, narrow tables where they are not.

Flex's Triton kernels inline the ``mask_mod`` into every score tile of a partial block (blocks in the
``full_kv_*`` lists skip it). A ``[BLOCK_M, BLOCK_N]`` gather from a table of 32-bit entries is a load
Triton's software pipeliner multi-buffers in shared memory, one tile per stage; two such loads (a block
table, then the mask words it points to) took Flex's sm_90 default tiles past the 232,448 B an H200
block may use (262,144 B at head dim 128). Triton does not multi-buffer loads narrower than 32 bits, and
a table indexed by the query alone is read as a ``[BLOCK_M, 1]`` column, not a tile. So the export uses
the first of three rules that computes the layout exactly:

* ``band``: every query ``q`` keeps the keys ``[q + lo, q + hi)`` inside the sequence (dense, causal
  in either alignment, sliding windows, with or without ``causal``): no table.
* ``rows``: every query keeps one interval of keys ``[first[q], end[q])`` (documents, prefix-LM, any
  layout whose rows are contiguous): two per-query tables (the narrowest integer type holding
  ``seqlen_k``), read as columns.
* ``blocks``: a per-block code, ``NOT_KEPT``, ``FULL``, ``INTERVAL`` (a partial block equal to the
  ``rows`` interval of the partial blocks: window edges, diagonals) or ``TABLE + m`` (a partial block
  with bit mask ``m``), in the narrowest of uint8 / int16 / int32 holding the codes (uint8 up to 253
  bit masks), and the bit masks as uint8 bytes: one narrow tile load, one narrow dependent load on
  blocks with a stored mask.

Each rule is checked against the layout's element masks before it is used. The sequence ends and the
causal diagonal are arithmetic in all three. :func:`mask_tables` lists what a ``mask_mod`` reads.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn.layout import _bits

#: block codes of the ``blocks`` rule (bit mask ``m`` is code ``TABLE + m``)
NOT_KEPT, FULL, INTERVAL, TABLE = 0, 1, 2, 3


def narrowest(top: int) -> torch.dtype:
    """The narrowest of uint8, int16 and int32 that holds every value in ``[0, top]``."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if top <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"a FlexAttention mask table holds values up to {top}, past int32")


class _Rows(NamedTuple):
    """Per kept block and block row (``[E, bq]``, int64): the mask ``lid``, the query ``q``, the
    first and last allowed key (absolute; ``seqlen_k`` and ``-1`` on a row without one) and the
    count of allowed keys."""
    lid: torch.Tensor
    q: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    count: torch.Tensor


def _block_rows(layout) -> _Rows:
    """:class:`_Rows` of every kept block: full blocks from their in-range extent, partial ones from
    their mask's rows (computed once per stored mask)."""
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    lid, r, c = layout.entries()
    ids = layout.partial_ids.to(torch.int64)
    cols_in = (sk - c * bk).clamp(max=bk)[:, None]
    first = torch.zeros(ids.numel(), bq, dtype=torch.int64, device=ids.device)
    last, count = (cols_in - 1).expand_as(first).clone(), cols_in.expand_as(first).clone()
    part = ids >= 0
    if bool(part.any()):
        mask_first, mask_last, mask_count = _bits.row_extents(layout.partial_masks, bk)
        first[part], last[part], count[part] = (t[ids[part]] for t in (mask_first, mask_last, mask_count))
    q = r[:, None] * bq + torch.arange(bq, device=ids.device)
    count = torch.where(q < sq, count, 0)
    start = c[:, None] * bk
    return _Rows(lid[:, None].expand_as(q), q, torch.where(count > 0, start + first, sk),
                 torch.where(count > 0, start + last, -1), count)


def _spans(rows: _Rows, sel: torch.Tensor, num_layouts: int, seqlen) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Over the blocks where ``sel`` (``[E]``): per ``(mask, query)`` the first allowed key, one past
    the last, and the count, ``int64 [L, seqlen_q]`` each (``seqlen_k``, ``0``, ``0`` on a query
    with none)."""
    sq, sk = seqlen
    inside = (rows.q < sq) & sel[:, None]
    at = (rows.lid * sq + rows.q)[inside]
    dev = at.device
    first = torch.full((num_layouts * sq,), sk, dtype=torch.int64, device=dev)
    last = torch.full((num_layouts * sq,), -1, dtype=torch.int64, device=dev)
    count = torch.zeros(num_layouts * sq, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, at, rows.first[inside], "amin")
    last.scatter_reduce_(0, at, rows.last[inside], "amax")
    count.scatter_add_(0, at, rows.count[inside])
    return first.view(-1, sq), (last + 1).view(-1, sq), count.view(-1, sq)


def _band(first: torch.Tensor, end: torch.Tensor, count: torch.Tensor, seqlen) -> tuple[int, int] | None:
    """``(lo, hi)`` such that query ``q`` of every mask keeps exactly the keys ``[q + lo, q + hi)``
    inside ``[0, seqlen_k)``, or None."""
    sq, sk = seqlen
    q = torch.arange(sq, device=first.device)[None, :]
    some = count > 0
    lo = (first - q)[some & (first > 0)]
    hi = (end - q)[some & (end < sk)]
    lo = int(lo[0]) if lo.numel() else -sq
    hi = int(hi[0]) if hi.numel() else sk
    band_first, band_end = (q + lo).clamp(min=0), (q + hi).clamp(max=sk)
    band_some = band_first < band_end
    ok = torch.where(some, band_some & (band_first == first) & (band_end == end), ~band_some)
    return (lo, hi) if bool(ok.all()) else None


def _tables(first: torch.Tensor, end: torch.Tensor, count: torch.Tensor, layout):
    """The per-query ``(first, end)`` tables, ``[layout_batch, layout_heads, seqlen_q]`` in the
    narrowest type holding ``seqlen_k`` (``0, 0`` on a query with no key)."""
    dtype = narrowest(layout.seqlen_k)
    shape = (layout.layout_batch, layout.layout_heads, layout.seqlen_q)
    return (torch.where(count > 0, first, 0).to(dtype).view(shape),
            torch.where(count > 0, end, 0).to(dtype).view(shape))


def _strides(layout) -> tuple[int, int]:
    """How FlexAttention's ``b`` and ``h`` index the tables: 0 where the layout is shared."""
    return int(layout.layout_batch > 1), int(layout.layout_heads > 1)


def _band_rule(lo: int, hi: int):
    def band(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + lo) & (kv_idx < q_idx + hi)
    return band


def _rows_rule(first: torch.Tensor, end: torch.Tensor, strides, seqlen_q: int):
    sb, sh = strides

    def rows(b, h, q_idx, kv_idx):
        q = torch.clamp(q_idx, max=seqlen_q - 1)
        return (first[b * sb, h * sh, q] <= kv_idx) & (kv_idx < end[b * sb, h * sh, q])
    return rows


def _blocks_rule(codes: torch.Tensor, interval, bits: torch.Tensor | None, block_size, seqlen, strides):
    (bq, bk), (sq, sk), (sb, sh) = block_size, seqlen, strides

    def blocks(b, h, q_idx, kv_idx):
        q, k = torch.clamp(q_idx, max=sq - 1), torch.clamp(kv_idx, max=sk - 1)
        code = codes[b * sb, h * sh, q // bq, k // bk]      # one narrow load per element, compared narrow
        keep = code == FULL
        if interval is not None:
            keep = keep | ((code == INTERVAL) & interval(b, h, q_idx, kv_idx))
        if bits is not None:
            col = k % bk
            byte = bits[torch.clamp(code.to(torch.int32) - TABLE, min=0), q % bq, col // 8]
            keep = keep | ((code >= TABLE) & (((byte >> (col % 8)) & 1) == 1))
        return keep
    return blocks


def _rule(layout):
    """The first rule of the module docstring that computes ``layout`` exactly."""
    rows = _block_rows(layout)
    L, seqlen = layout.num_layouts, layout.seqlen
    every = torch.ones(rows.q.shape[0], dtype=torch.bool, device=rows.q.device)
    first, end, count = _spans(rows, every, L, seqlen)
    if bool(((count == 0) | (count == end - first)).all()):          # every query keeps one interval
        band = _band(first, end, count, seqlen)
        if band is not None:
            return _band_rule(*band)
        return _rows_rule(*_tables(first, end, count, layout), _strides(layout), layout.seqlen_q)
    return _blocks(layout, rows)


def _blocks(layout, rows: _Rows):
    """The ``blocks`` rule: codes, the interval of the partial blocks, the bit masks left."""
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    R, C = layout.num_q_blocks, layout.num_kv_blocks
    lid, r, c = layout.entries()
    ids = layout.partial_ids.to(torch.int64)
    part = ids >= 0
    first, end, count = _spans(rows, part, layout.num_layouts, layout.seqlen)
    q = rows.q.clamp(max=sq - 1)
    a = torch.maximum(first[rows.lid, q], c[:, None] * bk)            # the interval inside the block
    z = torch.minimum(end[rows.lid, q], torch.clamp(c[:, None] * bk + bk, max=sk))
    agree = torch.where(rows.count > 0, (rows.first == a) & (rows.last == z - 1) & (rows.count == z - a), a >= z)
    interval = part & (agree | (rows.q >= sq)).all(1)
    stored = part & ~interval
    used, inverse = torch.unique(ids[stored], return_inverse=True)
    code = torch.where(part, INTERVAL, FULL)
    code[stored] = TABLE + inverse
    codes = torch.full((layout.num_layouts * R * C,), NOT_KEPT, dtype=narrowest(TABLE + max(used.numel() - 1, 0)),
                       device=ids.device)
    codes[(lid * R + r) * C + c] = code.to(codes.dtype)
    codes = codes.view(layout.layout_batch, layout.layout_heads, R, C)
    rule = None
    if bool(interval.any()):
        rule = _rows_rule(*_tables(first, end, count, layout), _strides(layout), sq)
    bits = _bits.to_bytes(layout.partial_masks[used], bk) if used.numel() else None
    return _blocks_rule(codes, rule, bits, layout.block_size, layout.seqlen, _strides(layout))


def mask_mod(layout, causal_offset: int | None):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` computing exactly ``layout``'s element mask,
    inside both sequence lengths and, with ``causal_offset`` ``delta``, ``kv_idx <= q_idx + delta``."""
    rule = _rule(layout)
    sq, sk = layout.seqlen
    delta = causal_offset

    def mask_mod(b, h, q_idx, kv_idx):
        keep = rule(b, h, q_idx, kv_idx) & (q_idx < sq) & (kv_idx < sk)
        return keep if delta is None else keep & (kv_idx <= q_idx + delta)
    return mask_mod


def mask_tables(fn) -> dict[str, torch.Tensor]:
    """Every tensor a ``mask_mod`` from :func:`mask_mod` reads, by name (its closure's and those of
    the rules it calls): what FlexAttention's kernels load."""
    out: dict[str, torch.Tensor] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif callable(value) and getattr(value, "__closure__", None) is not None:
            out.update(mask_tables(value))
    return out


def describe(fn) -> dict:
    """The rule a ``mask_mod`` from :func:`mask_mod` uses (``band``, ``rows`` or ``blocks``) and its
    tables as ``"dtype[shape]"``: what the benchmarks record next to a Flex time."""
    rule = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))["rule"]
    return {"rule": rule.__name__,
            "tables": {k: f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for k, t in mask_tables(fn).items()}}
