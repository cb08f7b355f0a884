"""Traffic model of the block-sparse Triton kernels: the bytes they count, predicted without running.

:func:`block_sparse_forward` / :func:`block_sparse_backward` / :func:`block_sparse` return a
``TrafficReport(source="predicted")`` with the kernels' names and tensor names, equal (exactly, in
bytes) to what ``IOCounter`` records for ``backend="triton"``. Everything is computed from the
layout's CSR/CSC counts and the shapes (vectorised over the stored entries), so it works at sizes
far beyond what the interpreter can run (e.g. ``n = 131072``).

What a program moves (the kernels in :mod:`sparse_io_attn.block_sparse.triton`; ``D`` = head dim of
``q``/``k``/``dq``/``dk``, ``Dv`` = head dim of ``v``/``o``/``do``/``dv`` (``head_dim_v=``, default ``D``),
``e`` = element bytes, index entries are int32):

* ``attn_fwd`` (per query tile of ``BLOCK_M`` rows, per batch x query head): reads its ``q`` rows
  once, 2 + (kept blocks of its row) layout indices, and for every kept key block the key tiles of
  ``BLOCK_N`` it visits (``k`` and ``v`` rows that exist); writes ``o`` rows and fp32 ``lse``.
  Causal (top-left) skips key tiles starting at or after the query tile's end.
* ``attn_bwd_preprocess``: reads ``o`` and ``do``, writes fp32 ``delta``, once per row.
* ``attn_bwd_dkdv`` (per key tile, per batch x kv head, looping over the query heads of the group):
  reads its ``k``/``v`` rows once, writes ``dk``/``dv``; per query head 2 + (kept blocks of its
  column) indices and, per visited query tile (``BLOCK_M`` rows over full blocks, at most
  ``DKDV_PART_ROWS`` over partial ones), ``q``, ``do`` rows and fp32 ``lse``, ``delta``.
  Causal skips query tiles that end at or before the key tile's start.
* ``attn_bwd_dq`` (per query tile): reads ``q``, ``do``, ``lse``, ``delta`` once, the visited
  ``k``/``v`` tiles like the forward, and writes ``dq``.

The kernel tile sizes come from :func:`choose_tiles`, the same function the launcher calls.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._csr import csr_row_ids
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.tally.report import TrafficReport
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.block_sparse.plan import AttentionPlan, BlockLists, plan
from sparse_io_attn.block_sparse.tiles import KernelTiles, choose_tiles, decode_config, dkdv_part_rows
from sparse_io_attn._attention.tiles import DECODE_MAX_QUERIES, element_size, tile_head_dim
from sparse_io_attn._attention.delta import residual_made
from sparse_io_attn._attention.traffic import (DECODE_BASE, DECODE_MERGE_TENSORS, DKDV_BASE, DQ_BASE, FWD_BASE,
                                               INDEX_BYTES, PREPROCESS_TENSORS, STAT_BYTES, add_decode, add_preprocess,
                                               output_bytes)

# Tensor names of each kernel's I/O counter, in slot order: the kit's tensors of the kernel's kind,
# then the layout's lists and masks (the kernels' named slots are built from these tuples in
# :mod:`.triton.slots`; the preprocess and decode-merge kernels' are the kit's).
FWD_TENSORS = FWD_BASE + ("layout", "mask")
DKDV_TENSORS = DKDV_BASE + ("layout", "mask")
DQ_TENSORS = DQ_BASE + ("layout", "mask")
DECODE_TENSORS = DECODE_BASE + ("layout", "mask")


def _layout_multiplicity(layout, batch: int, num_heads_q: int) -> torch.Tensor:
    """How many (batch, query head) pairs use each stored mask of a layout or plan, ``int64 [L]``."""
    if layout.layout_batch not in (1, batch) or layout.layout_heads not in (1, num_heads_q):
        raise ValueError(f"layout has {layout.layout_batch}x{layout.layout_heads} (batch x head) masks, which do "
                         f"not broadcast over batch {batch} x {num_heads_q} query heads")
    per = (batch if layout.layout_batch == 1 else 1) * (num_heads_q if layout.layout_heads == 1 else 1)
    return torch.full((layout.num_layouts,), per, dtype=torch.int64)


def _walk(layout: AttentionPlan, lists: BlockLists, tile_own: int, tile_other: int, delta: int | None,
          transposed: bool, tile_part: int | None = None):
    """What the programs of one kernel kind read, summed per stored mask (``int64 [L]`` each):
    ``index`` (int32 schedule entries: 4 list offsets per program, then per loop iteration 2 for a
    partial tile and 1 for a full tile), ``loaded`` (elements of the other axis: keys for the
    forward and dQ, queries for dK/dV) and ``mask_rows`` (rows of element-mask words read). The loop
    over partial blocks steps ``tile_part`` along the other axis (dK/dV: :func:`dkdv_part_rows`),
    the one over full blocks ``tile_other``.

    Not transposed: programs are query tiles walking the CSR lists (attn_fwd, attn_bwd_dq).
    Transposed: programs are key tiles walking the CSC lists (attn_bwd_dkdv), per query head.
    Mirrors the kernels' loops: a partial tile is *live* (loaded) when it starts inside the other
    axis and, under a causal offset, holds an element on the allowed side of the diagonal.
    """
    L = layout.num_layouts
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    blk_own, blk_other, len_own, len_other = (bk, bq, sk, sq) if transposed else (bq, bk, sq, sk)
    part_ptr, full_ptr = lists.part_ptr.cpu().to(torch.int64), lists.full_ptr.cpu().to(torch.int64)
    n_own = part_ptr.shape[1] - 1
    tiles_own = math.ceil(len_own / tile_own)
    tile_part = tile_part or tile_other
    per_own, per_other, per_part = blk_own // tile_own, blk_other // tile_other, blk_other // tile_part
    first = torch.arange(n_own, dtype=torch.int64) * per_own
    programs_in_block = torch.clamp(tiles_own - first, min=0, max=per_own)          # [n_own]
    n_part = part_ptr[:, 1:] - part_ptr[:, :-1]                                      # [L, n_own]
    n_full = full_ptr[:, 1:] - full_ptr[:, :-1]
    index = 4 * tiles_own + (programs_in_block * (2 * per_part * n_part + per_other * n_full)).sum(1)
    loaded = (programs_in_block * n_full).sum(1) * blk_other

    # partial entries x (own tile i, other tile j)
    flat = csr_row_ids(lists.part_ptr.cpu())
    lid, own_blk = flat // n_own, flat % n_own
    other_blk = lists.part_idx.cpu()[:flat.numel()].to(torch.int64)   # the lists' used slots
    has_bits = lists.part_mask.cpu()[:flat.numel()] >= 0
    i = torch.arange(per_own, dtype=torch.int64)
    j = torch.arange(per_part, dtype=torch.int64)
    own_start = (own_blk * blk_own)[:, None, None] + (i * tile_own)[None, :, None]       # [E, I, 1]
    other_start = (other_blk * blk_other)[:, None, None] + (j * tile_part)[None, None, :]  # [E, 1, J]
    program = own_start < len_own
    live = program & (other_start < len_other)
    if delta is not None:
        if transposed:  # query tile [other_start, ...) against key tile starting at own_start
            live = live & (torch.clamp(other_start + tile_part, max=len_other) - 1 + delta >= own_start)
        else:           # key tile starting at other_start against the query tile's last row
            live = live & (other_start <= torch.clamp(own_start + tile_own, max=len_own) - 1 + delta)
    other_n = torch.clamp(len_other - other_start, max=tile_part)
    own_n = torch.clamp(len_own - own_start, max=tile_own)
    got = torch.where(live, other_n, 0)
    rows = torch.where(live & has_bits[:, None, None], other_n if transposed else own_n, 0)
    loaded += torch.zeros(L, dtype=torch.int64).index_add_(0, lid, got.sum((1, 2)))
    mask_rows = torch.zeros(L, dtype=torch.int64).index_add_(0, lid, rows.sum((1, 2)))
    return index, loaded, mask_rows


def _planned(layout, causal, batch, num_heads_q, num_heads_kv, head_dim, dtype):
    """``(plan for the query heads, element bytes)`` of a layout (planned under ``causal``) or a plan."""
    if isinstance(layout, AttentionPlan):
        if causal_offset(causal, *layout.seqlen) != layout.causal_offset:
            raise ValueError(f"the plan was built with causal={layout.causal!r} but causal={causal!r} was passed")
        p = layout
    elif isinstance(layout, BlockSparseLayout):
        p = plan(layout, causal=causal)
    else:
        raise TypeError(f"layout must be a BlockSparseLayout or an AttentionPlan, got {type(layout).__name__}")
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")
    return p.to("cpu").for_heads(num_heads_q, num_heads_kv), element_size(dtype)


def block_sparse_forward(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int,
                         head_dim: int, dtype: torch.dtype, *, causal=False,
                         tiles: KernelTiles | None = None, head_dim_v: int | None = None,
                         residual: bool = False) -> TrafficReport:
    """Predicted bytes of one ``attn_fwd`` launch (``TrafficReport(source="predicted")``);
    ``causal`` as in :func:`~sparse_io_attn.block_sparse_attention`; ``head_dim_v``: v's head dim
    when it is not q's; ``residual``: a gradient will be needed, so a 16-bit forward also writes its
    output's rounding residual (:mod:`sparse_io_attn._attention.delta`). For ``seqlen_q <= 16`` the
    forward runs the decode kernels (:func:`block_sparse_decode_forward`), but not one that writes a
    residual."""
    layout, es = _planned(layout, causal, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    res = residual_made(dtype, residual)
    if layout.seqlen_q <= DECODE_MAX_QUERIES and not res:
        return block_sparse_decode_forward(layout, batch, num_heads_q, num_heads_kv, head_dim, dtype, causal=causal,
                                           head_dim_v=head_dim_v)
    D, Dv, delta = head_dim, head_dim_v or head_dim, layout.causal_offset
    tiles = tiles or choose_tiles(layout.block_size, tile_head_dim(D, Dv), dtype)
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    index, keys, mask_rows = _walk(layout, layout.rows, tiles.fwd[0], tiles.fwd[1], delta, transposed=False)
    rows = batch * num_heads_q * layout.seqlen_q
    kv = int((mult * keys).sum()) * es
    rep = TrafficReport(source="predicted")
    rep.add("attn_fwd", {"q": rows * D * es, "k": kv * D, "v": kv * Dv,
                         "layout": int((mult * index).sum()) * INDEX_BYTES,
                         "mask": int((mult * mask_rows).sum()) * _words(tiles.fwd[1]) * INDEX_BYTES},
            output_bytes(rows, Dv, es, res))
    return rep


def block_sparse_decode_forward(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int,
                                head_dim: int, dtype: torch.dtype, *, causal=False,
                                head_dim_v: int | None = None) -> TrafficReport:
    """Predicted bytes of the decode forward (``attn_decode``, and ``attn_decode_merge`` when the
    rows are split): the launch of :func:`~sparse_io_attn.block_sparse.tiles.decode_config`.

    Each program (split ``s`` of batch x head group x query block) reads its ``q`` rows, 4 list
    offsets and, per item of its range (a ``BLOCK_N`` key tile of a kept block), 2 index entries for
    a partial tile and 1 for a full tile, the tile's ``k``/``v`` rows when it is live (the forward's
    rule, against the block's last decoded token), and the element-mask words of its rows for a
    live tile of a masked block. Every item belongs to exactly one split, so the sums do not
    depend on where the splits cut. One split: ``o``, ``lse``, ``stats`` written directly; else each
    split writes fp32 ``partial`` rows (``m``, ``l``, ``acc``: ``2 + Dv`` floats) that the merge reads
    once before writing ``o``, ``lse``, ``stats``. O(kept blocks + programs), no launch."""
    layout, es = _planned(layout, causal, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    cfg = decode_config(layout, batch, num_heads_q, num_heads_kv, tile_head_dim(head_dim, head_dim_v), dtype)
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    D, delta, S, tiles = head_dim, layout.causal_offset, cfg.splits, bk // cfg.block_n
    L, nqb = layout.num_layouts, layout.num_q_blocks
    stride_lb, stride_lh = layout.layout_strides(batch, num_heads_q)
    z = torch.arange(batch, dtype=torch.int64)[:, None]
    h0 = torch.arange(0, num_heads_q, cfg.heads, dtype=torch.int64)[None, :]
    programs = torch.bincount((z * stride_lb + h0 * stride_lh).reshape(-1), minlength=L)   # [L] per query block
    lists = layout.rows
    part_ptr, full_ptr = lists.part_ptr.cpu().to(torch.int64), lists.full_ptr.cpu().to(torch.int64)
    n_part, n_full = part_ptr[:, 1:] - part_ptr[:, :-1], full_ptr[:, 1:] - full_ptr[:, :-1]   # [L, nqb]
    r = torch.arange(nqb, dtype=torch.int64)
    tokens = torch.clamp(sq - r * bq, max=bq)                                   # [nqb]
    m_last = r * bq + tokens - 1
    index = 4 * S * nqb * programs + ((2 * n_part + n_full) * tiles).sum(1) * programs
    keys = (n_full.sum(1) * bk) * programs
    # partial entries x key tiles: live ones load their in-range keys (and mask words, when masked)
    flat = csr_row_ids(lists.part_ptr.cpu())
    lid, own = flat // nqb, flat % nqb
    blk = lists.part_idx.cpu()[:flat.numel()].to(torch.int64)
    has_bits = lists.part_mask.cpu()[:flat.numel()] >= 0
    start = (blk * bk)[:, None] + (torch.arange(tiles, dtype=torch.int64) * cfg.block_n)[None, :]   # [E, tiles]
    live = start < sk
    if delta is not None:
        live &= start <= (m_last[own] + delta)[:, None]
    got = torch.where(live, torch.clamp(sk - start, max=cfg.block_n), 0).sum(1)
    rows = torch.where(live & has_bits[:, None], (cfg.heads * tokens[own])[:, None], 0).sum(1)
    weight = programs[lid]
    keys_total = int(keys.sum()) + int((weight * got).sum())
    mask_rows = int((weight * rows).sum())
    n_rows = batch * num_heads_q * sq
    Dv = head_dim_v or D
    rep = TrafficReport(source="predicted")
    read = {"q": S * n_rows * D * es, "k": keys_total * D * es, "v": keys_total * Dv * es,
            "layout": int(index.sum()) * INDEX_BYTES, "mask": mask_rows * _words(cfg.block_n) * INDEX_BYTES}
    add_decode(rep, "attn_decode", read, n_rows, S, Dv, es)
    return rep


def block_sparse_backward(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int,
                          head_dim: int, dtype: torch.dtype, *, causal=False,
                          tiles: KernelTiles | None = None, head_dim_v: int | None = None,
                          residual: bool = False) -> TrafficReport:
    """Predicted bytes of one backward (``attn_bwd_preprocess``, ``attn_bwd_dkdv``, ``attn_bwd_dq``);
    ``residual``: the forward wrote a rounding residual (16-bit, through autograd), which the preprocess
    reads."""
    layout, es = _planned(layout, causal, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    D, Dv, delta = head_dim, head_dim_v or head_dim, layout.causal_offset
    tiles = tiles or choose_tiles(layout.block_size, tile_head_dim(D, Dv), dtype)
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    rows_q = batch * num_heads_q * layout.seqlen_q
    rows_k = batch * num_heads_kv * layout.seqlen_k
    rep = TrafficReport(source="predicted")
    add_preprocess(rep, "attn_bwd_preprocess", rows_q, Dv, es, residual_made(dtype, residual))

    # every query head of a group walks its own mask; summing over (b, h) covers all programs
    index, queries, mask_rows = _walk(layout, layout.cols, tiles.dkdv[1], tiles.dkdv[0], delta, transposed=True,
                                      tile_part=dkdv_part_rows(tiles.dkdv[0]))
    q_rows = int((mult * queries).sum())
    rep.add("attn_bwd_dkdv",
            {"q": q_rows * D * es, "do": q_rows * Dv * es, "stats": q_rows * 2 * STAT_BYTES,
             "delta": q_rows * STAT_BYTES,
             "k": rows_k * D * es, "v": rows_k * Dv * es, "layout": int((mult * index).sum()) * INDEX_BYTES,
             "mask": int((mult * mask_rows).sum()) * _words(tiles.dkdv[1]) * INDEX_BYTES},
            {"dk": rows_k * D * es, "dv": rows_k * Dv * es})

    index, keys, mask_rows = _walk(layout, layout.rows, tiles.dq[0], tiles.dq[1], delta, transposed=False)
    kv = int((mult * keys).sum()) * es
    rep.add("attn_bwd_dq",
            {"q": rows_q * D * es, "do": rows_q * Dv * es, "stats": rows_q * 2 * STAT_BYTES,
             "delta": rows_q * STAT_BYTES,
             "k": kv * D, "v": kv * Dv, "layout": int((mult * index).sum()) * INDEX_BYTES,
             "mask": int((mult * mask_rows).sum()) * _words(tiles.dq[1]) * INDEX_BYTES},
            {"dq": rows_q * D * es})
    return rep


def _words(block_n: int) -> int:
    """Element-mask words one row of a key tile of ``block_n`` keys reads."""
    return -(-block_n // 32)


def block_sparse(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                 dtype: torch.dtype, *, causal=False, tiles: KernelTiles | None = None,
                 head_dim_v: int | None = None) -> TrafficReport:
    """Predicted bytes of forward + backward (what ``IOCounter`` sees around the forward and
    ``out.backward(...)``: a 16-bit forward writes its rounding residual, the preprocess reads it)."""
    args = (layout, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    return (block_sparse_forward(*args, causal=causal, tiles=tiles, head_dim_v=head_dim_v, residual=True)
            + block_sparse_backward(*args, causal=causal, tiles=tiles, head_dim_v=head_dim_v, residual=True))


def kept_elements(layout: BlockSparseLayout, batch: int, num_heads_q: int, *, causal=False) -> int:
    """Score elements ``(i, j)`` attention computes: the layout's allowed elements (full blocks
    clipped to the lengths, partial blocks' mask bits), with ``causal`` only ``j <= i + delta``;
    summed over batch and query heads. Counted per kept block by :func:`~sparse_io_attn.layout._bits.block_counts`
    (stored masks popcounted once each, no element mask built): O(kept blocks + stored masks)."""
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    lo = layout.to("cpu")
    lid, r, c = lo.entries()
    delta = causal_offset(causal, *lo.seqlen)
    per_entry = _bits.block_counts(r, c, lo.partial_ids, lo.partial_masks, lo.block_size, lo.seqlen, delta)
    per_layout = torch.zeros(lo.num_layouts, dtype=torch.int64).index_add_(0, lid, per_entry)
    return int((mult * per_layout).sum())


def block_sparse_flops(layout: BlockSparseLayout, batch: int, num_heads_q: int, head_dim: int, *,
                       causal=False, backward: bool = False) -> int:
    """Matmul FLOPs over kept elements: forward ``4 * D`` per element (``QK^T`` and ``PV``), backward
    ``10 * D`` (``QK^T`` recomputed, ``dO V^T``, ``dV``, ``dQ``, ``dK``), the FlashAttention convention."""
    return (10 if backward else 4) * head_dim * kept_elements(layout, batch, num_heads_q, causal=causal)
