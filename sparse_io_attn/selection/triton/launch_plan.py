"""Host side of the device plan builders (:mod:`.plan_kernels`): what the key-major and element-masked
families derive from a :class:`~sparse_io_attn.selection.plan.SelectionPlan`, built on its device in a
few launches with no host read (shapes from the plan's shapes only), the same tensors as the torch
builders (:func:`~sparse_io_attn.selection.plan.key_lists`,
:func:`~sparse_io_attn.selection.worklists.key_work`, :func:`~sparse_io_attn.selection.worklists.masked_tiles`):

* :func:`device_key_lists` / :func:`device_key_work`: one zero fill and three launches (count, scan, fill)
  for the lists, one more for the work tiles;
* :func:`device_masked_tiles`: one zero fill and two launches (bits and unions, lists).

The Triton backend uses them on CUDA (:func:`on_device`); under the interpreter it keeps the torch
builders (the tests compare both, element for element)."""
from __future__ import annotations

import torch

from sparse_io_attn._attention.triton.launch import Call
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.layout._csr import INDEX_DTYPE
from sparse_io_attn.selection.plan import KeyLists, SelectionPlan
from sparse_io_attn.selection.triton.plan_kernels import (_key_count_kernel, _key_fill_kernel, _key_scan_kernel,
                                                          _key_work_kernel, _masked_bits_kernel, _masked_lists_kernel)
from sparse_io_attn.selection.worklists import KeyWork, MaskedTiles, key_work_capacity

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

CHUNK = 64          # tokens per program of the key-list counting sort (at least; at most MAX_CHUNKS chunks)
MAX_CHUNKS = 64     # chunks per selection: the one-program scan walks L x num_kv_blocks x chunks counts
SCAN_BLOCK = 1024   # entries per step of the one-program scans
WORK_BLOCK = 1024   # work tiles per program of the binary search
LIST_BLOCK = 128    # tiles per step of the masked lists' prefix sums
PLAN_CONFIG = triton.Config({}, num_warps=4, num_stages=1)


def on_device(t: torch.Tensor) -> bool:
    """Whether the device builders run (CUDA tensors, Triton compiled)."""
    return t.device.type == "cuda" and not INTERPRET


def _run(calls) -> None:
    for c in calls:
        if 0 not in c.grid:
            c.kernel[c.grid](**c.kwargs, num_warps=PLAN_CONFIG.num_warps, num_stages=PLAN_CONFIG.num_stages)


def _key_calls(plan: SelectionPlan, block_t: int):
    """``(calls, keys, tile_end)``: the counting sort of the plan's rows into key-major lists, and each
    list's cumulative tiles of ``block_t`` tokens."""
    rows, counts = plan.rows, plan.row_counts
    L, Nq, K = rows.shape
    nkb, dev = plan.num_kv_blocks, rows.device
    chunk_tokens = max(CHUNK, -(-Nq // MAX_CHUNKS))
    chunks = -(-Nq // chunk_tokens)
    cursor = torch.zeros(L, nkb, chunks, dtype=INDEX_DTYPE, device=dev)
    col_ptr = torch.empty(L, nkb + 1, dtype=INDEX_DTYPE, device=dev)
    tile_end = torch.empty(max(L * nkb, 1), dtype=INDEX_DTYPE, device=dev)
    col_query = torch.empty(L * Nq * K, dtype=INDEX_DTYPE, device=dev)
    col_slot = torch.empty(L * Nq * K, dtype=INDEX_DTYPE, device=dev)
    rows_args = dict(rows_ptr=rows, row_counts_ptr=counts, seqlen_q=Nq, num_kv_blocks=nkb, num_chunks=chunks,
                     chunk_tokens=chunk_tokens, K=K, KP=next_pow2(max(K, 1)))
    calls = [Call("selection_plan_key_count", _key_count_kernel, (L * chunks,), (), [PLAN_CONFIG],
                  dict(counts_ptr=cursor, **rows_args)),
             Call("selection_plan_key_scan", _key_scan_kernel, (1,), (), [PLAN_CONFIG],
                  dict(counts_ptr=cursor, col_ptr_ptr=col_ptr, tile_end_ptr=tile_end, num_layouts=L,
                       num_kv_blocks=nkb, num_chunks=chunks, BLOCK_T=block_t, BLOCK=SCAN_BLOCK)),
             Call("selection_plan_key_fill", _key_fill_kernel, (L * chunks,), (), [PLAN_CONFIG],
                  dict(cursor_ptr=cursor, col_query_ptr=col_query, col_slot_ptr=col_slot, **rows_args))]
    return calls, KeyLists(col_ptr, col_query, col_slot), tile_end


def device_key_lists(plan: SelectionPlan) -> KeyLists:
    """The plan's key-major lists (:func:`~sparse_io_attn.selection.plan.key_lists`'s), built on its
    device: the used entries equal, unused capacity undefined."""
    calls, keys, _ = _key_calls(plan, 1)
    _run(calls)
    return keys


def device_key_work(plan: SelectionPlan, block_t: int) -> KeyWork:
    """The plan's key-major work tiles of ``block_t`` tokens (:func:`~sparse_io_attn.selection.worklists.key_work`'s),
    built on its device with the lists, which become the plan's (:meth:`SelectionPlan.keys`)."""
    calls, keys, tile_end = _key_calls(plan, block_t)
    L, Nq, K = plan.rows.shape
    lists = L * plan.num_kv_blocks
    cap = key_work_capacity(L * Nq * K, lists, block_t)
    work = torch.empty(2, cap, dtype=INDEX_DTYPE, device=plan.device)
    calls.append(Call("selection_plan_key_work", _key_work_kernel, (triton.cdiv(cap, WORK_BLOCK),), (), [PLAN_CONFIG],
                      dict(tile_end_ptr=tile_end, work_ptr=work, num_lists=lists, capacity=cap,
                           LOG_LISTS=max(lists, 1).bit_length(), BLOCK=WORK_BLOCK)))
    _run(calls)
    plan.keys(build=lambda _: keys)
    return KeyWork(work, block_t)


def device_masked_tiles(plan: SelectionPlan, block_t: int, block_n: int) -> MaskedTiles:
    """The plan's element-masked tiles (:func:`~sparse_io_attn.selection.worklists.masked_tiles`'s), built on
    its device."""
    rows, counts = plan.rows, plan.row_counts
    L, Nq, K = rows.shape
    Nk, dev, delta = plan.seqlen[1], rows.device, plan.causal_offset
    nkt, nqt = -(-Nk // block_n), -(-Nq // block_t)
    words = torch.zeros(L * Nq * nkt + L * nqt * nkt, dtype=torch.int64, device=dev)
    bits, union = words[:L * Nq * nkt].view(L, Nq, nkt), words[L * Nq * nkt:].view(L, nqt, nkt)
    col_union = torch.empty(L, nkt, dtype=torch.int64, device=dev)
    row_tiles = torch.empty(L, nqt, nkt, dtype=INDEX_DTYPE, device=dev)
    row_counts = torch.empty(L, nqt, dtype=INDEX_DTYPE, device=dev)
    col_tiles = torch.empty(L, nkt, nqt, dtype=INDEX_DTYPE, device=dev)
    col_counts = torch.empty(L, nkt, dtype=INDEX_DTYPE, device=dev)
    _run([Call("selection_plan_masked_bits", _masked_bits_kernel, (L * Nq,), (), [PLAN_CONFIG], dict(
              rows_ptr=rows, row_counts_ptr=counts, table_ptr=counts if plan.table is None else plan.table,
              bits_ptr=bits, union_ptr=union, seqlen_q=Nq, seqlen_k=Nk,
              causal_offset=0 if delta is None else int(delta), num_kv_blocks=plan.num_kv_blocks, num_key_tiles=nkt,
              num_query_tiles=nqt, K=K, KP=next_pow2(max(K, 1)), BLOCK_SIZE=plan.block_size, BLOCK_T=block_t,
              BLOCK_N=block_n, IS_CAUSAL=delta is not None, IS_VARLEN=plan.varlen)),
          Call("selection_plan_masked_lists", _masked_lists_kernel, (L * nqt + L * nkt,), (), [PLAN_CONFIG], dict(
              union_ptr=union, col_union_ptr=col_union, row_tiles_ptr=row_tiles, row_counts_ptr=row_counts,
              col_tiles_ptr=col_tiles, col_counts_ptr=col_counts, num_layouts=L, num_query_tiles=nqt,
              num_key_tiles=nkt, BLOCK=LIST_BLOCK))])
    return MaskedTiles(bits, union, col_union, row_tiles, row_counts, col_tiles, col_counts, block_t, block_n)


__all__ = ["device_key_lists", "device_key_work", "device_masked_tiles", "on_device"]
