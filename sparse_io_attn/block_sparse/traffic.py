"""Traffic model of the block-sparse Triton kernels: the bytes they count, predicted without running.

:func:`block_sparse_forward` / :func:`block_sparse_backward` / :func:`block_sparse` return a
``TrafficReport(source="predicted")`` with the kernels' names and tensor names, equal (exactly, in
bytes) to what ``IOCounter`` records for ``backend="triton"``. Everything is computed from the
layout's CSR/CSC counts and the shapes (vectorised over the stored entries), so it works at sizes
far beyond what the interpreter can run (e.g. ``n = 131072``).

What a program moves (the kernels in :mod:`sparse_io_attn.block_sparse.triton`; ``D`` = head dim, ``e`` =
element bytes, index entries are int32):

* ``attn_fwd`` (per query tile of ``BLOCK_M`` rows, per batch x query head): reads its ``q`` rows
  once, 2 + (kept blocks of its row) layout indices, and for every kept key block the key tiles of
  ``BLOCK_N`` it visits (``k`` and ``v`` rows that exist); writes ``o`` rows and fp32 ``lse``.
  Causal (top-left) skips key tiles starting at or after the query tile's end.
* ``attn_bwd_preprocess``: reads ``o`` and ``do``, writes fp32 ``delta``, once per row.
* ``attn_bwd_dkdv`` (per key tile, per batch x kv head, looping over the query heads of the group):
  reads its ``k``/``v`` rows once, writes ``dk``/``dv``; per query head 2 + (kept blocks of its
  column) indices and, per visited query tile, ``q``, ``do`` rows and fp32 ``lse``, ``delta``.
  Causal skips query tiles that end at or before the key tile's start.
* ``attn_bwd_dq`` (per query tile): reads ``q``, ``do``, ``lse``, ``delta`` once, the visited
  ``k``/``v`` tiles like the forward, and writes ``dq``.

The kernel tile sizes come from :func:`choose_tiles`, the same function the launcher calls.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.layout._csr import csr_row_ids
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.accounting.report import TrafficReport
from sparse_io_attn.block_sparse.tiles import KernelTiles, choose_tiles, element_size

INDEX_BYTES = 4  # int32 crow/col/ccol/row indices
STAT_BYTES = 4  # fp32 lse and delta

# Tensor names of each kernel's I/O counter, in slot order (the kernels' named slots are built
# from these tuples in :mod:`.triton.slots`).
FWD_TENSORS = ("q", "k", "v", "o", "lse", "layout")
PREPROCESS_TENSORS = ("o", "do", "delta")
DKDV_TENSORS = ("q", "k", "v", "do", "lse", "delta", "dk", "dv", "layout")
DQ_TENSORS = ("q", "k", "v", "do", "lse", "delta", "dq", "layout")


def _layout_multiplicity(layout: BlockSparseLayout, batch: int, num_heads_q: int) -> torch.Tensor:
    """How many (batch, query head) pairs use each stored mask, ``int64 [L]``."""
    layout.broadcast_strides(batch, num_heads_q)
    per = (batch if layout.layout_batch == 1 else 1) * (num_heads_q if layout.layout_heads == 1 else 1)
    return torch.full((layout.num_layouts,), per, dtype=torch.int64)


def _visited_extent(lo, hi, tile: int, seqlen: int):
    """Elements loaded by the tiles ``lo, lo + tile, ... < hi`` (the last clipped at ``seqlen``)."""
    n_tiles = torch.clamp(hi - lo, min=0).add(tile - 1).div(tile, rounding_mode="floor")
    return torch.where(n_tiles > 0, torch.minimum(n_tiles * tile, seqlen - lo), torch.zeros_like(lo))


def _walk(layout: BlockSparseLayout, tile_own: int, tile_other: int, causal: bool, transposed: bool):
    """Per stored mask, the sums over the programs of one kernel kind (``int64 [L]`` each):
    ``programs`` (tiles along the program axis), ``index_entries`` (2 + list length per program)
    and ``loaded`` (elements of the other axis loaded, summed over visited tiles).

    Not transposed: programs are query tiles walking CSR rows (attn_fwd, attn_bwd_dq).
    Transposed: programs are key tiles walking CSC columns (attn_bwd_dkdv), per query head.
    """
    L = layout.num_layouts
    if transposed:
        ptr, idx = layout.ccol_indices.cpu(), layout.row_indices.cpu()
        blk_own, blk_other = layout.BLOCK_SIZE_KV, layout.BLOCK_SIZE_Q
        len_own, len_other = layout.seqlen_k, layout.seqlen_q
    else:
        ptr, idx = layout.crow_indices.cpu(), layout.col_indices.cpu()
        blk_own, blk_other = layout.BLOCK_SIZE_Q, layout.BLOCK_SIZE_KV
        len_own, len_other = layout.seqlen_q, layout.seqlen_k
    nb = ptr.shape[1] - 1
    tiles_total = math.ceil(len_own / tile_own)
    per_block = blk_own // tile_own
    # programs per block row: tiles of that row that start before len_own
    first = torch.arange(nb, dtype=torch.int64) * per_block
    tiles_in_block = torch.clamp(tiles_total - first, min=0, max=per_block)
    counts = (ptr[:, 1:] - ptr[:, :-1]).to(torch.int64)  # [L, nb]
    programs = torch.full((L,), tiles_total, dtype=torch.int64)
    index_entries = 2 * programs + (counts * tiles_in_block).sum(dim=1)

    flat = csr_row_ids(ptr)  # l * nb + block row of each entry
    lid, own_blk = flat // nb, flat % nb
    other_blk = idx.to(torch.int64)
    sub = torch.arange(per_block, dtype=torch.int64)
    tile_start = ((own_blk * blk_own)[:, None] + sub[None, :] * tile_own)  # [nnz, per_block]
    keep = tile_start < len_own
    lo = (other_blk * blk_other)[:, None].expand_as(tile_start)
    hi = torch.clamp(lo + blk_other, max=len_other)
    if causal and not transposed:  # key tiles starting at or after the query tile's end are skipped
        hi = torch.minimum(hi, tile_start + tile_own)
    if causal and transposed:  # query tiles ending at or before the key tile's start are skipped
        lo = lo + torch.clamp(tile_start - lo, min=0).div(tile_other, rounding_mode="floor") * tile_other
    ext = torch.where(keep, _visited_extent(lo, hi, tile_other, len_other), torch.zeros_like(lo))
    loaded = torch.zeros(L, dtype=torch.int64).index_add_(0, lid, ext.sum(dim=1))
    return programs, index_entries, loaded


def _check(layout, batch, num_heads_q, num_heads_kv, head_dim, dtype):
    if not isinstance(layout, BlockSparseLayout):
        raise TypeError(f"layout must be a BlockSparseLayout, got {type(layout).__name__}")
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")
    return element_size(dtype), head_dim


def block_sparse_forward(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int,
                         head_dim: int, dtype: torch.dtype, *, causal: bool = False,
                         tiles: KernelTiles | None = None) -> TrafficReport:
    """Predicted bytes of one ``attn_fwd`` launch (``TrafficReport(source="predicted")``)."""
    es, D = _check(layout, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    tiles = tiles or choose_tiles(layout.block_size, head_dim, dtype)
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    Nq = layout.seqlen_q
    _, entries, keys = _walk(layout, tiles.fwd[0], tiles.fwd[1], causal, transposed=False)
    rows = batch * num_heads_q * Nq
    kv = int((mult * keys).sum()) * D * es
    rep = TrafficReport(source="predicted")
    rep.add("attn_fwd", {"q": rows * D * es, "k": kv, "v": kv, "layout": int((mult * entries).sum()) * INDEX_BYTES},
            {"o": rows * D * es, "lse": rows * STAT_BYTES})
    return rep


def block_sparse_backward(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int,
                          head_dim: int, dtype: torch.dtype, *, causal: bool = False,
                          tiles: KernelTiles | None = None) -> TrafficReport:
    """Predicted bytes of one backward (``attn_bwd_preprocess``, ``attn_bwd_dkdv``, ``attn_bwd_dq``)."""
    es, D = _check(layout, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    tiles = tiles or choose_tiles(layout.block_size, head_dim, dtype)
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    rows_q = batch * num_heads_q * layout.seqlen_q
    rows_k = batch * num_heads_kv * layout.seqlen_k
    rep = TrafficReport(source="predicted")
    rep.add("attn_bwd_preprocess", {"o": rows_q * D * es, "do": rows_q * D * es}, {"delta": rows_q * STAT_BYTES})

    _, entries, queries = _walk(layout, tiles.dkdv[1], tiles.dkdv[0], causal, transposed=True)
    # every query head of a group walks its own mask; summing over (b, h) covers all programs
    q_rows = int((mult * queries).sum())
    rep.add("attn_bwd_dkdv",
            {"q": q_rows * D * es, "do": q_rows * D * es, "lse": q_rows * STAT_BYTES, "delta": q_rows * STAT_BYTES,
             "k": rows_k * D * es, "v": rows_k * D * es, "layout": int((mult * entries).sum()) * INDEX_BYTES},
            {"dk": rows_k * D * es, "dv": rows_k * D * es})

    _, entries, keys = _walk(layout, tiles.dq[0], tiles.dq[1], causal, transposed=False)
    kv = int((mult * keys).sum()) * D * es
    rep.add("attn_bwd_dq",
            {"q": rows_q * D * es, "do": rows_q * D * es, "lse": rows_q * STAT_BYTES, "delta": rows_q * STAT_BYTES,
             "k": kv, "v": kv, "layout": int((mult * entries).sum()) * INDEX_BYTES},
            {"dq": rows_q * D * es})
    return rep


def block_sparse(layout: BlockSparseLayout, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                 dtype: torch.dtype, *, causal: bool = False, tiles: KernelTiles | None = None) -> TrafficReport:
    """Predicted bytes of forward + backward (what ``IOCounter`` sees around ``out.backward(...)``)."""
    args = (layout, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    return (block_sparse_forward(*args, causal=causal, tiles=tiles)
            + block_sparse_backward(*args, causal=causal, tiles=tiles))


def kept_elements(layout: BlockSparseLayout, batch: int, num_heads_q: int, *, causal: bool = False) -> int:
    """Score elements ``(i, j)`` inside kept blocks (clipped to the lengths; with ``causal`` only
    ``j <= i``), summed over batch and query heads."""
    mult = _layout_multiplicity(layout, batch, num_heads_q)
    crow = layout.crow_indices.cpu()
    flat = csr_row_ids(crow)
    nqb = layout.num_q_blocks
    lid, r = flat // nqb, flat % nqb
    c = layout.col_indices.cpu().to(torch.int64)
    bq, bk = layout.block_size
    r0, c0 = r * bq, c * bk
    rows = torch.clamp(layout.seqlen_q - r0, max=bq)
    cols = torch.clamp(layout.seqlen_k - c0, max=bk)
    if causal:
        def prefix(x):  # sum over i < x of clamp(i - c0 + 1, 0, cols)
            y = torch.clamp(x - c0, min=0)
            inside = torch.minimum(y, cols)
            return inside * (inside + 1) // 2 + torch.clamp(y - cols, min=0) * cols
        per_entry = prefix(r0 + rows) - prefix(r0)
    else:
        per_entry = rows * cols
    per_layout = torch.zeros(layout.num_layouts, dtype=torch.int64).index_add_(0, lid, per_entry)
    return int((mult * per_layout).sum())


def block_sparse_flops(layout: BlockSparseLayout, batch: int, num_heads_q: int, head_dim: int, *,
                       causal: bool = False, backward: bool = False) -> int:
    """Matmul FLOPs over kept elements: forward ``4 * D`` per element (``QK^T`` and ``PV``), backward
    ``10 * D`` (``QK^T`` recomputed, ``dO V^T``, ``dV``, ``dQ``, ``dK``), the FlashAttention convention."""
    return (10 if backward else 4) * head_dim * kept_elements(layout, batch, num_heads_q, causal=causal)
