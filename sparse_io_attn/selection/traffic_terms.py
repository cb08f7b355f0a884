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
    keys and to the causal diagonal: every other block of a normalised row is whole and allowed)."""
    rows, counts = plan.rows.cpu().to(torch.int64), plan.row_counts.cpu().to(torch.int64)
    bs, (Nq, Nk), delta = plan.block_size, plan.seqlen, plan.causal_offset
    last = rows.gather(-1, (counts - 1).clamp(min=0)[..., None])[..., 0]                  # [L, Nq]
    end = torch.clamp((last + 1) * bs, max=Nk)
    if delta is not None:
        end = torch.minimum(end, torch.arange(Nq, dtype=torch.int64) + delta + 1)
    return torch.where(counts > 0, (counts - 1) * bs + (end - last * bs).clamp(min=0), 0)


def block_tokens(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [L, num_kv_blocks]``: how many query tokens chose each key block (the key-major
    lists' lengths), counted from the rows."""
    rows = plan.rows.cpu().to(torch.int64)
    L, nkb = rows.shape[0], plan.num_kv_blocks
    used = rows >= 0
    ids = torch.where(used, torch.arange(L)[:, None, None] * nkb + rows, L * nkb)
    return torch.bincount(ids.reshape(-1), minlength=L * nkb + 1)[:-1].reshape(L, nkb)


def block_keys(plan: SelectionPlan) -> torch.Tensor:
    """``int64 [num_kv_blocks]``: keys of each block inside the sequence (the last may be ragged)."""
    bs, nk = plan.block_size, plan.seqlen[1]
    return torch.clamp(nk - torch.arange(plan.num_kv_blocks, dtype=torch.int64) * bs, max=bs)


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
    starts = torch.arange(plan.num_kv_blocks, dtype=torch.int64)[:, None] * bs \
        + torch.arange(key_tiles, dtype=torch.int64)[None, :] * block_n
    live = (starts < torch.clamp((torch.arange(plan.num_kv_blocks)[:, None] + 1) * bs, max=nk)).sum(1)  # [nkb]
    n = block_tokens(plan)                                                   # [L, nkb]
    per_entry = max(1, next_pow2(R) // block_m)
    sel_slots = mult * (hps // R)        # (batch element, KV head, selection slot) triples per stored selection
    gathered = int((n * live).sum()) * sel_slots * R
    lists = int((n * live).sum()) * per_entry * (2 if store_dq else 1)
    entries = (2 * int(live.sum()) * n.shape[0] + lists) * sel_slots
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
           "selection_pairs", "usage"]
