"""Device builders of what the key-major and element-masked families derive from a plan (``@triton.jit``
only; the host side is :mod:`.launch_plan`): the same tensors as the torch builders of
:mod:`sparse_io_attn.selection.plan` (``key_lists``) and :mod:`sparse_io_attn.selection.worklists`
(``key_work``, ``masked_tiles``), element for element, in a few launches and no host read.

Key-major lists (a counting sort of the plan's normalised rows by ``(l, c)``, tokens ascending in each
bucket):

* ``_key_count_kernel`` (one program per ``(l, chunk of chunk_tokens tokens)``): each kept entry adds 1 to
  ``counts[l, c, chunk]`` (integer atomics: the counts do not depend on their order).
* ``_key_scan_kernel`` (one program): the exclusive prefix sum of ``counts`` in ``(l, c, chunk)`` order
  (each bucket's chunks in token order), in place: every chunk's first position; ``col_ptr[l, c]`` (the
  lists' absolute offsets, packed as the torch builder packs them) and ``tile_end[l * nkb + c]`` (the
  cumulative count of ``BLOCK_T``-token tiles).
* ``_key_fill_kernel`` (one program per ``(l, chunk)``): the chunk's tokens in order, each kept entry
  written at its bucket's cursor (``col_query``: the token, ``col_slot``: its slot), the cursor advanced
  (a row's blocks are distinct, so its entries never share a cursor).
* ``_key_work_kernel``: each work tile's list by a binary search of ``tile_end`` (``-1`` past the last).

Element-masked tiles:

* ``_masked_bits_kernel`` (one program per ``(l, token)``): each selected, allowed key of the row sets its
  bit in the token's word and in its query tile's union (integer ``atomic_or``: order-free).
* ``_masked_lists_kernel`` (one program per ``(l, query tile)`` or ``(l, key tile)``): the key tiles whose
  union is not empty, ascending (a prefix sum over the row), or the query tiles of a key tile and the key
  tile's union over them.
"""
from __future__ import annotations

from sparse_io_attn._triton.runtime import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET before triton)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _chunk_rows(rows_ptr, row_counts_ptr, seqlen_q, t, K: tl.constexpr, KP: tl.constexpr):
    """``(c, ok)``: the kept entries of token ``t``'s row (``[KP]``, ``ok`` the first ``row_counts``)."""
    j = tl.arange(0, KP)
    cnt = tl.load(row_counts_ptr + t, mask=t < seqlen_q, other=0)
    ok = (j < cnt) & (j < K)
    c = tl.load(rows_ptr + t.to(tl.int64) * K + j, mask=ok, other=0)
    return c, ok, j


@triton.jit
def _key_count_kernel(rows_ptr, row_counts_ptr, counts_ptr, seqlen_q, num_kv_blocks, num_chunks, chunk_tokens,
                      K: tl.constexpr, KP: tl.constexpr):
    pid = tl.program_id(0)
    off_l = pid // num_chunks
    chunk = pid % num_chunks
    for i in range(0, chunk_tokens):
        t = chunk * chunk_tokens + i
        c, ok, _ = _chunk_rows(rows_ptr + off_l * seqlen_q * K, row_counts_ptr + off_l * seqlen_q, seqlen_q, t, K, KP)
        tl.atomic_add(counts_ptr + (off_l * num_kv_blocks + c) * num_chunks + chunk, 1, mask=ok)


@triton.jit
def _key_scan_kernel(counts_ptr, col_ptr_ptr, tile_end_ptr, num_layouts, num_kv_blocks, num_chunks,
                     BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``counts`` (``[L, nkb, chunks]``) replaced by its exclusive prefix sum; ``col_ptr`` and
    ``tile_end`` from it."""
    per_l = num_kv_blocks * num_chunks
    carry = tl.zeros([], dtype=tl.int32)
    tiles = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_layouts * per_l, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < num_layouts * per_l
        n = tl.load(counts_ptr + offs, mask=live, other=0)
        incl = tl.cumsum(n, 0)
        first = carry + incl - n  # [BLOCK] exclusive prefix: each chunk's first position
        tl.store(counts_ptr + offs, first, mask=live)
        tl.debug_barrier()  # (each bucket's start is read back below, maybe from another lane)
        # a bucket (l, c) starts at its chunk 0: its list offset; its length is its chunks' sum
        lc = offs // num_chunks
        bucket_start = (offs % num_chunks) == 0
        tl.store(col_ptr_ptr + (lc // num_kv_blocks) * (num_kv_blocks + 1) + lc % num_kv_blocks, first,
                 mask=live & bucket_start)
        carry += tl.sum(n, 0)
        # tiles: a bucket's length is known at its last chunk (first + n - its start)
        bucket_end = (offs % num_chunks) == num_chunks - 1
        start_of = tl.load(counts_ptr + offs - (num_chunks - 1), mask=live & bucket_end, other=0)
        n_tiles = tl.where(live & bucket_end, (first + n - start_of + BLOCK_T - 1) // BLOCK_T, 0)
        tile_incl = tl.cumsum(n_tiles, 0)
        tl.store(tile_end_ptr + lc, tiles + tile_incl, mask=live & bucket_end)
        tiles += tl.sum(n_tiles, 0)
        end_of_l = live & bucket_end & ((lc % num_kv_blocks) == num_kv_blocks - 1)
        tl.store(col_ptr_ptr + (lc // num_kv_blocks) * (num_kv_blocks + 1) + num_kv_blocks, first + n, mask=end_of_l)


@triton.jit
def _key_fill_kernel(rows_ptr, row_counts_ptr, cursor_ptr, col_query_ptr, col_slot_ptr, seqlen_q, num_kv_blocks,
                     num_chunks, chunk_tokens, K: tl.constexpr, KP: tl.constexpr):
    pid = tl.program_id(0)
    off_l = pid // num_chunks
    chunk = pid % num_chunks
    for i in range(0, chunk_tokens):  # tokens in order: each bucket's entries ascend
        t = chunk * chunk_tokens + i
        c, ok, j = _chunk_rows(rows_ptr + off_l * seqlen_q * K, row_counts_ptr + off_l * seqlen_q, seqlen_q, t, K,
                               KP)
        cur = cursor_ptr + (off_l * num_kv_blocks + c) * num_chunks + chunk
        pos = tl.load(cur, mask=ok, other=0)
        tl.store(col_query_ptr + pos, tl.zeros_like(pos) + t, mask=ok)
        tl.store(col_slot_ptr + pos, j, mask=ok)
        tl.store(cur, pos + 1, mask=ok)
        tl.debug_barrier()  # the next token reads the cursors this one wrote


@triton.jit
def _key_work_kernel(tile_end_ptr, work_ptr, num_lists, capacity, LOG_LISTS: tl.constexpr, BLOCK: tl.constexpr):
    """``work[0, p]``: the list whose tiles hold tile ``p`` (the first ``lc`` with ``tile_end[lc] > p``, by a
    binary search), ``-1`` past the last tile; ``work[1, p]`` its index in that list."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < capacity
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_lists
    for _ in tl.static_range(LOG_LISTS):
        active = lo < hi
        mid = (lo + hi) // 2
        go_right = tl.load(tile_end_ptr + mid, mask=live & active, other=0) <= p
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    used = lo < num_lists
    before = tl.load(tile_end_ptr + lo - 1, mask=live & used & (lo > 0), other=0)
    tl.store(work_ptr + p, tl.where(used, lo, -1), mask=live)
    tl.store(work_ptr + capacity + p, tl.where(used, p - before, 0), mask=live)


@triton.jit
def _masked_bits_kernel(rows_ptr, row_counts_ptr, table_ptr, bits_ptr, union_ptr, seqlen_q, seqlen_k, causal_offset,
                        num_kv_blocks, num_key_tiles, num_query_tiles, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                        IS_VARLEN: tl.constexpr):
    """IS_VARLEN: a block's keys ``[start, end)`` and the row's causal offset from the block table."""
    pid = tl.program_id(0)
    off_l = pid // seqlen_q
    t = pid % seqlen_q
    c, ok, _ = _chunk_rows(rows_ptr + off_l * seqlen_q * K, row_counts_ptr + off_l * seqlen_q, seqlen_q, t, K, KP)
    word_base = bits_ptr + (off_l * seqlen_q + t).to(tl.int64) * num_key_tiles
    union_base = union_ptr + (off_l * num_query_tiles + t // BLOCK_T).to(tl.int64) * num_key_tiles
    if IS_VARLEN:
        start = tl.load(table_ptr + c, mask=ok, other=0)  # [KP]
        end = tl.load(table_ptr + num_kv_blocks + c, mask=ok, other=0)
        causal_offset = tl.load(table_ptr + 2 * num_kv_blocks + t)
    else:
        start = c * BLOCK_SIZE
        end = seqlen_k
    for i in tl.static_range(BLOCK_SIZE):
        key = start + i  # [KP]
        allowed = ok & (key < end)
        if IS_CAUSAL:
            allowed = allowed & (key <= t + causal_offset)
        bit = tl.full([KP], 1, tl.int64) << (key % BLOCK_N).to(tl.int64)
        tl.atomic_or(word_base + key // BLOCK_N, bit, mask=allowed)
        tl.atomic_or(union_base + key // BLOCK_N, bit, mask=allowed)


@triton.jit
def _masked_lists_kernel(union_ptr, col_union_ptr, row_tiles_ptr, row_counts_ptr, col_tiles_ptr, col_counts_ptr,
                         num_layouts, num_query_tiles, num_key_tiles, BLOCK: tl.constexpr):
    """Programs ``[0, L * nqt)``: a query tile's key tiles with a non-empty union, ascending, ``-1`` after;
    programs ``[L * nqt, L * nqt + L * nkt)``: a key tile's query tiles, and its union over them."""
    pid = tl.program_id(0)
    is_row = pid < num_layouts * num_query_tiles  # else a key tile's column
    lanes = tl.zeros([BLOCK], dtype=tl.int32) + pid
    row_lanes = lanes < num_layouts * num_query_tiles  # (vector masks: the interpreter takes no scalar & vector)
    col_lanes = lanes >= num_layouts * num_query_tiles
    col = pid - num_layouts * num_query_tiles
    n = tl.where(is_row, num_key_tiles, num_query_tiles)
    stride = tl.where(is_row, 1, num_key_tiles).to(tl.int64)
    base = tl.where(is_row, pid.to(tl.int64) * num_key_tiles,
                    (col // num_key_tiles).to(tl.int64) * num_query_tiles * num_key_tiles + col % num_key_tiles)
    row_out = row_tiles_ptr + pid.to(tl.int64) * num_key_tiles
    col_out = col_tiles_ptr + col.to(tl.int64) * num_query_tiles
    kept = tl.zeros([], dtype=tl.int32)
    acc = tl.zeros([], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        word = tl.load(union_ptr + base + offs.to(tl.int64) * stride, mask=offs < n, other=0)
        present = (word != 0).to(tl.int32)
        pos = kept + tl.cumsum(present, 0) - present
        tl.store(row_out + pos, offs, mask=(present != 0) & row_lanes)
        tl.store(col_out + pos, offs, mask=(present != 0) & col_lanes)
        kept += tl.sum(present, 0)
        acc = acc | tl.reduce(word, 0, _or)
    for start in range(0, n, BLOCK):  # -1 after the kept entries
        offs = start + tl.arange(0, BLOCK)
        rest = (offs < n) & (offs >= kept)
        tl.store(row_out + offs, tl.full([BLOCK], -1, tl.int32), mask=rest & row_lanes)
        tl.store(col_out + offs, tl.full([BLOCK], -1, tl.int32), mask=rest & col_lanes)
    tl.store(row_counts_ptr + pid, kept, mask=is_row)
    tl.store(col_counts_ptr + col, kept, mask=pid >= num_layouts * num_query_tiles)
    tl.store(col_union_ptr + col, acc, mask=pid >= num_layouts * num_query_tiles)


@triton.jit
def _or(a, b):
    return a | b
