"""The pieces every selection traffic model shares (:mod:`.traffic` for the query-major and decode
kernels, :mod:`.traffic_families` for the key-major and element-masked families): the tensor tuples
the kernels count under, the plan's pair counts, and the dK/dV kernel's bytes (that kernel serves the
query-major and the key-major backward).

Tensor tuples (slot order; the kernels' named slots are built from them in :mod:`.triton.slots`; the
preprocess and merge kernels of the decode path are the attention kit's): the kit's tensors of the
kernel's kind, then the plan's entries (``plan``: rows, key lists, work lists, tile bits) and, for the
key-major family, its fp32 per-pair work buffer (``partial``).
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.traffic import (DECODE_BASE, DECODE_MERGE_TENSORS, DKDV_BASE, DQ_BASE, FWD_BASE,
                                               INDEX_BYTES, STAT_BYTES)
from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import key_tile, sel_heads

FWD_TENSORS = FWD_BASE + ("plan",)
DKDV_TENSORS = DKDV_BASE + ("plan", "partial")     # "partial": the key-major backward's dQ per (row, slot)
DQ_TENSORS = DQ_BASE + ("plan",)
DECODE_TENSORS = DECODE_BASE + ("plan",)           # also the key-major forward's (it writes "partial")
MERGE_TENSORS = DECODE_MERGE_TENSORS + ("plan",)   # the key-major forward's merge (reads the row counts)
DQ_MERGE_TENSORS = ("partial", "dq", "plan")       # the key-major backward's dQ merge
KERNEL_NAMES = ("selection_fwd", "selection_bwd_preprocess", "selection_bwd_dkdv", "selection_bwd_dq")
DECODE_KERNEL_NAMES = ("selection_decode", "selection_decode_merge")


def row_pairs(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [L, Nq]``: the allowed keys of each query row (its blocks, the last one clipped to the
    keys (a packed sequence's ragged block) and to the causal diagonal: every other block of a
    normalised row is whole and allowed)."""
    rows, counts = plan.rows.to(torch.int64), plan.row_counts.to(torch.int64)
    last = rows.gather(-1, (counts - 1).clamp(min=0)[..., None])[..., 0].clamp(min=0)     # [L, Nq]
    start = plan.key_start(last)
    end = start + plan.key_count(last)
    if plan.causal_offset is not None:
        end = torch.minimum(end, plan.causal_limit(torch.arange(plan.seqlen[0], device=rows.device)) + 1)
    return torch.where(counts > 0, (counts - 1) * plan.block_size + (end - start).clamp(min=0), 0).cpu()


def table_reads(plan: SelectionPlan, splits: int = 1) -> int:
    """The int32 entries beyond the fixed grid's that the row programs of one stored selection's rows read
    in all (``splits`` programs per row; 0 without a table): per program of a row with blocks, its first
    and last row entries, their blocks' start and end and, causal, the row's offset."""
    if not plan.varlen:
        return 0
    counts = plan.row_counts.cpu().to(torch.int64)
    return int((counts > 0).sum()) * splits * (5 if plan.causal_offset is not None else 4)


def block_tokens(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [L, num_kv_blocks]``: how many query tokens chose each key block (the key-major
    lists' lengths), counted from the rows."""
    rows = plan.rows.cpu().to(torch.int64)
    L, nkb = rows.shape[0], plan.num_kv_blocks
    used = rows >= 0
    ids = torch.where(used, torch.arange(L)[:, None, None] * nkb + rows, L * nkb)
    return torch.bincount(ids.reshape(-1), minlength=L * nkb + 1)[:-1].reshape(L, nkb)


def block_keys(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [num_kv_blocks]``: keys of each block inside the sequence (the last may be ragged; a packed
    plan's from its table, unused slots empty)."""
    return plan.key_count(torch.arange(plan.num_kv_blocks, device=plan.device)).cpu()


def usage(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int):
    """``(mult, hps, R)``: batch elements using each stored selection, heads per selection, heads per
    tile (``R`` = :func:`~sparse_io_attn.selection.tiles.sel_heads`)."""
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")
    hm = plan.head_map(batch, num_heads_q, num_heads_kv)
    mult = 1 if plan.batched else batch
    return mult, hm.heads_per_selection, sel_heads(num_heads_q, num_heads_kv, plan.num_selections)


def check_plan(plan) -> None:
    if not isinstance(plan, SelectionPlan):
        raise TypeError(f"plan must be a SelectionPlan, got {type(plan).__name__}")


def selection_pairs(plan: SelectionPlan, batch: int, num_heads_q: int) -> int:
    """Allowed ``(query, key)`` pairs summed over batch and query heads: the score elements the
    kernels compute (``Z_QK`` of Theorem 1.2)."""
    check_plan(plan)
    G = plan.num_selections
    if num_heads_q % G:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of G ({G})")
    mult = 1 if plan.batched else batch
    if plan.batched and plan.layout_batch != batch:
        raise ValueError(f"the selection was made for batch {plan.layout_batch}, got batch {batch}")
    return int(row_pairs(plan).sum()) * mult * (num_heads_q // G)


def _masked_tiles(n: torch.Tensor, keys: torch.Tensor, rows: int, block_m: int, block_n: int, key_tiles: int) -> int:
    """The dK/dV kernel's causally masked row tiles (``MASKED`` under causality), summed over its programs
    (key tile ``kt`` of each block, ``keys`` per block) and the lists ``n [L, nkb]`` (``rows`` gathered
    rows per token): all of a ragged key tile's, else those of the first entries that may see past
    their diagonal (:func:`~.triton.bwd._sel_bwd_dkdv_kernel`)."""
    total = 0
    for kt in range(key_tiles):
        start = kt * block_n
        tiles = -(-n * rows // block_m)                                               # [L, nkb]
        edge = (torch.minimum(keys, torch.full_like(keys, start + block_n)) - 1)[None, :]   # [1, nkb]
        edge_tiles = -(-torch.minimum(n, edge).clamp(min=0) * rows // block_m)
        masked = torch.where((start + block_n > keys)[None, :], tiles, edge_tiles)
        total += int(torch.where((start < keys)[None, :], masked, 0).sum())
    return total


def dkdv_traffic(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int, es: int,
                 block_m: int, block_n: int, *, store_dq: bool, head_dim_v: int | None = None) -> tuple[dict, dict]:
    """``(reads, writes)`` of the key-major dK/dV kernel (one program per key tile of ``block_n`` keys
    of a block, per batch x KV head): its ``k``/``v``/``dk``/``dv`` rows once; per selection serving
    the group 2 list offsets and, per token of the block's list, ``R`` gathered rows of ``q``, ``do``,
    ``stats`` (8 B) and ``delta`` (4 B) and the token's list entry (once per row tile it spans; with
    ``store_dq`` also its slot entry, and each gathered row's fp32 dQ partial written). ``v``, ``do``,
    ``dv`` rows of ``head_dim_v`` (default ``head_dim``)."""
    mult, hps, R = usage(plan, batch, num_heads_q, num_heads_kv)
    bs, nk, D, Dv = plan.block_size, plan.seqlen[1], head_dim, head_dim_v or head_dim
    _, key_tiles = key_tile(bs, block_n)
    live = (torch.arange(key_tiles)[None, :] * block_n < block_keys(plan)[:, None]).sum(1)          # [nkb]
    n = block_tokens(plan)                                                   # [L, nkb]
    per_entry = max(1, next_pow2(R) // block_m)
    sel_slots = mult * (hps // R)        # (batch element, KV head, selection slot) triples per stored selection
    gathered = int((n * live).sum()) * sel_slots * R
    lists = int((n * live).sum()) * per_entry * (2 if store_dq else 1)
    entries = (2 * int(live.sum()) * n.shape[0] + lists) * sel_slots
    if plan.varlen:     # every program: its block's start and end; causal, per masked tile its list's offset
        entries += 2 * plan.num_kv_blocks * key_tiles * batch * num_heads_kv
        if plan.causal_offset is not None:
            entries += 2 * _masked_tiles(n, block_keys(plan), next_pow2(R), block_m, block_n, key_tiles) * sel_slots
    rows_k = batch * num_heads_kv * nk
    reads = {"q": gathered * D * es, "do": gathered * Dv * es, "stats": gathered * 2 * STAT_BYTES,
             "delta": gathered * STAT_BYTES, "k": rows_k * D * es, "v": rows_k * Dv * es,
             "plan": entries * INDEX_BYTES}
    writes = {"dk": rows_k * D * es, "dv": rows_k * Dv * es}
    if store_dq:
        writes["partial"] = gathered * D * STAT_BYTES
    return reads, writes


__all__ = ["DECODE_KERNEL_NAMES", "DECODE_TENSORS", "DKDV_TENSORS", "DQ_MERGE_TENSORS", "DQ_TENSORS", "FWD_TENSORS",
           "KERNEL_NAMES", "MERGE_TENSORS", "block_keys", "block_tokens", "check_plan", "dkdv_traffic", "row_pairs",
           "selection_pairs", "table_reads", "usage"]
