"""Traffic of the key-major (``"key"``) and element-masked (``"masked"``) Triton families: the bytes
their kernels count, predicted exactly from the plan's lists and the shapes (no launch).
:mod:`.traffic` dispatches to these by :func:`~sparse_io_attn.selection.tiles.kernel_family`.

``D`` = head dim, ``e`` = element bytes, plan entries int32 (tile bits int64); ``R`` heads per
selection and KV head (:func:`~.tiles.sel_heads`), ``U = (Hq / G) / R`` units of them per selection,
``mult`` batch elements per stored selection; tiles of :func:`~.tiles.family_tiles` (``T`` tokens x
``R`` heads as rows).

Key-major (:mod:`sparse_io_attn.selection.triton.key`):

* ``selection_key_fwd`` (per tile of ``T`` tokens of a key-major list ``(l, c)`` and per unit, and
  ``capacity`` = :func:`~.worklists.key_work_capacity` programs per unit in all): every program reads
  its work entry; a live one its tile index, 2 list offsets and 2 entries per token (token, slot),
  the tokens' ``q`` rows, block ``c``'s keys inside the sequence (``k``, ``v``: once per tile), and
  writes each row's fp32 partial ``(m, l, acc)`` (``2 + D`` floats) at its slot.
* ``selection_key_merge`` (per row): its row count, its ``count`` partials; writes ``o``, ``lse``,
  ``stats``.
* ``selection_bwd_preprocess`` (the kit's), ``selection_key_bwd``: the dK/dV kernel of the
  query-major family (:func:`~.traffic_terms.dkdv_traffic`) that also reads each entry's slot and
  writes each gathered row's fp32 dQ partial (``D`` floats) per key tile;
  ``selection_key_dq_merge`` (per row): its row count (and, with several key tiles per block, its
  slots' block ids), the partials of its slots' live key tiles; writes ``dq``.

Element-masked (:mod:`sparse_io_attn.selection.triton.masked`):

* ``selection_masked_fwd`` / ``selection_masked_dq`` (per query tile of ``T`` tokens and per batch x
  unit): the rows' ``q`` (dQ: ``do``, ``stats``, ``delta``), the tile's list count, per key tile of its
  list the entry, the union word (int64) and the union's keys (``k``, ``v``), one int64 bit word per
  token; writes ``o``, ``lse``, ``stats`` (dQ: ``dq``).
* ``selection_masked_dkdv`` (per key tile of 64 keys, batch x KV head): per selection serving the group
  its union word of the key tile; the keys of their union (``k``, ``v``) once; ``dk``/``dv`` rows of the
  whole tile (0 off the union); per selection, the tile's list count and, per query tile of its list,
  the entry (once per sub-tile of ``dkdv_m`` rows), the tokens' ``q``/``do`` rows (x ``R`` heads),
  ``stats``, ``delta`` and bit words.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.tiles import tile_head_dim
from sparse_io_attn._attention.traffic import INDEX_BYTES, STAT_BYTES, add_preprocess, output_bytes
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import family_tiles, key_tile
from sparse_io_attn.selection.traffic_terms import block_keys, dkdv_traffic, usage
from sparse_io_attn.selection.worklists import key_work_capacity, masked_tiles
from sparse_io_attn.tally.report import TrafficReport

BITS_BYTES = 8   # one int64 word of tile bits per query token


def _shape(plan, batch, num_heads_q, num_heads_kv):
    mult, hps, R = usage(plan, batch, num_heads_q, num_heads_kv)
    return mult * (hps // R), R


def key_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                dtype: torch.dtype, es: int, head_dim_v: int | None = None, residual: bool = False) -> TrafficReport:
    """``selection_key_fwd`` + ``selection_key_merge`` (see the module docstring; ``head_dim_v``: v's head
    dim when it is not q's; ``residual``: the merge also writes the output's rounding residual)."""
    units, R = _shape(plan, batch, num_heads_q, num_heads_kv)
    D, Dv, (Nq, _), K, L = head_dim, head_dim_v or head_dim, plan.seqlen, plan.max_blocks, plan.num_layouts
    t = family_tiles("key", plan.block_size, tile_head_dim(D, Dv), dtype, R)
    rows_out = batch * num_heads_q * Nq
    rep = TrafficReport(source="predicted")
    if not rows_out:
        return rep
    ptr = plan.keys().col_ptr.cpu().to(torch.int64)
    n = ptr[:, 1:] - ptr[:, :-1]                                             # [L, nkb]
    tiles = (n + t.block_t - 1) // t.block_t
    entries = int(n.sum())
    cap = key_work_capacity(L * Nq * K, L * plan.num_kv_blocks, t.block_t)
    keys = int((tiles * block_keys(plan)[None, :]).sum())
    if cap and units:
        rep.add("selection_key_fwd",
                {"q": units * R * entries * D * es, "k": units * keys * D * es, "v": units * keys * Dv * es,
                 "plan": units * (cap + (3 + _key_table(plan)) * int(tiles.sum()) + 2 * entries) * INDEX_BYTES},
                {"partial": units * R * entries * (2 + Dv) * STAT_BYTES})
    slots = int(plan.row_counts.cpu().to(torch.int64).sum()) * (rows_out // (plan.num_layouts * Nq))
    rep.add("selection_key_merge", {"partial": slots * (2 + Dv) * STAT_BYTES, "plan": rows_out * INDEX_BYTES},
            output_bytes(rows_out, Dv, es, residual))
    return rep


def _key_table(plan: SelectionPlan) -> int:
    """Block-table entries a live key-major forward tile reads: its block's start and end and, causal, its first
    token's row offset (0 without a table)."""
    return (2 + (plan.causal_offset is not None)) if plan.varlen else 0


def key_backward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                 dtype: torch.dtype, es: int, dkdv_tiles: tuple[int, int],
                 head_dim_v: int | None = None, residual: bool = False) -> TrafficReport:
    """``selection_bwd_preprocess`` + ``selection_key_bwd`` (the dK/dV kernel with ``dkdv_tiles =
    (BLOCK_M, BLOCK_N)``, writing dQ partials) + ``selection_key_dq_merge``."""
    D, Dv, (Nq, _) = head_dim, head_dim_v or head_dim, plan.seqlen
    rows_q = batch * num_heads_q * Nq
    rep = TrafficReport(source="predicted")
    add_preprocess(rep, "selection_bwd_preprocess", rows_q, Dv, es, residual)
    if batch * num_heads_kv * plan.seqlen[1]:
        reads, writes = dkdv_traffic(plan, batch, num_heads_q, num_heads_kv, D, es, *dkdv_tiles, store_dq=True,
                                     head_dim_v=Dv)
        rep.add("selection_key_bwd", reads, writes)
    if not rows_q:
        return rep
    block_n = dkdv_tiles[1]
    per_block = -(-block_keys(plan) // block_n)                              # [nkb] live key tiles
    rows = plan.rows.cpu().to(torch.int64)
    live = int(torch.where(rows >= 0, per_block[rows.clamp(min=0)], 0).sum())
    heads = rows_q // (plan.num_layouts * Nq)                                # (batch, head) rows per stored row
    n_slots = int(plan.row_counts.cpu().to(torch.int64).sum())
    ids = n_slots if key_tile(plan.block_size, block_n)[1] > 1 else 0      # block id per slot, several key tiles
    ids *= 3 if plan.varlen else 1                                          # (and its start and end)
    rep.add("selection_key_dq_merge",
            {"partial": heads * live * D * STAT_BYTES, "plan": (rows_q + heads * ids) * INDEX_BYTES},
            {"dq": rows_q * D * es})
    return rep


_POPCOUNT8 = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 word (CPU), through its bytes."""
    w = words.contiguous().cpu()
    return _POPCOUNT8[w.view(torch.uint8).to(torch.int64)].view(*w.shape, 8).sum(-1)


def _masked_terms(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                  dtype: torch.dtype):
    """Over stored selections: ``(q_tiles, entries, keys, tokens, k_tiles, col_entries, col_tokens)``: the
    query tiles, their list entries, the union keys those entries load, the tokens (entries x the query
    tile's tokens); the key tiles, their entries and tokens. And ``dkdv_keys``: the keys the dK/dV
    programs load, summed over (key tile, batch, KV head) (the union over the selections serving it)."""
    mult, hps, R = usage(plan, batch, num_heads_q, num_heads_kv)
    t = family_tiles("masked", plan.block_size, head_dim, dtype, R)
    Nq, Nk = plan.seqlen
    m = plan.derived(("masked", t.block_t), lambda: masked_tiles(plan.rows, plan.block_size, Nk, plan.causal_offset,
                                                                  t.block_t, t.block_n, plan.table))
    tokens = torch.clamp(Nq - torch.arange(m.row_counts.shape[1], dtype=torch.int64) * t.block_t, max=t.block_t)
    rc, cc = m.row_counts.cpu().to(torch.int64), m.col_counts.cpu().to(torch.int64)
    ct = m.col_tiles.cpu().to(torch.int64)
    col_tokens = int(torch.where(ct >= 0, tokens[ct.clamp(min=0)], 0).sum())
    keys = int(popcount(m.union).sum())            # (a tile off the list has an empty union)
    group, col_union = num_heads_q // num_heads_kv, m.col_union.cpu()
    stride_lb = plan.head_map(batch, num_heads_q, num_heads_kv).stride_lb
    dkdv_keys = 0
    for z in range(batch):
        for g in range(num_heads_kv):
            union = torch.zeros_like(col_union[0])
            for i in range(group // R):
                union |= col_union[z * stride_lb + (g * group + i * R) // hps]
            dkdv_keys += int(popcount(union).sum())
    return (rc.numel(), int(rc.sum()), keys, int((rc * tokens[None, :]).sum()), cc.numel(), int(cc.sum()),
            col_tokens, dkdv_keys)


def masked_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                   dtype: torch.dtype, es: int, head_dim_v: int | None = None,
                   residual: bool = False) -> TrafficReport:
    """``selection_masked_fwd`` (see the module docstring; ``head_dim_v``: v's head dim when it is not q's;
    ``residual``: it also writes the output's rounding residual)."""
    units, R = _shape(plan, batch, num_heads_q, num_heads_kv)
    rows = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    if not rows:
        return rep
    D, Dv = head_dim, head_dim_v or head_dim
    q_tiles, entries, keys, tokens, *_ = _masked_terms(plan, batch, num_heads_q, num_heads_kv, tile_head_dim(D, Dv),
                                                       dtype)
    rep.add("selection_masked_fwd",
            {"q": rows * D * es, "k": units * keys * D * es, "v": units * keys * Dv * es,
             "plan": units * ((q_tiles + entries) * INDEX_BYTES + (tokens + entries) * BITS_BYTES)},
            output_bytes(rows, Dv, es, residual))
    return rep


def masked_backward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                    dtype: torch.dtype, es: int, head_dim_v: int | None = None,
                    residual: bool = False) -> TrafficReport:
    """``selection_bwd_preprocess`` + ``selection_masked_dkdv`` + ``selection_masked_dq``."""
    units, R = _shape(plan, batch, num_heads_q, num_heads_kv)
    D, Dv, (Nq, Nk) = head_dim, head_dim_v or head_dim, plan.seqlen
    rows_q, rows_k = batch * num_heads_q * Nq, batch * num_heads_kv * Nk
    rep = TrafficReport(source="predicted")
    add_preprocess(rep, "selection_bwd_preprocess", rows_q, Dv, es, residual)
    if not rows_q:
        return rep
    q_tiles, entries, keys, tokens, k_tiles, col_entries, col_tokens, dkdv_keys = _masked_terms(
        plan, batch, num_heads_q, num_heads_kv, tile_head_dim(D, Dv), dtype)
    gathered = units * R * col_tokens
    t = family_tiles("masked", plan.block_size, tile_head_dim(D, Dv), dtype, R)
    subs = t.block_m // t.dkdv_m        # the dK/dV steps of a query tile, each re-reading its list entry
    if rows_k:
        rep.add("selection_masked_dkdv",
                {"q": gathered * D * es, "do": gathered * Dv * es, "stats": gathered * 2 * STAT_BYTES,
                 "delta": gathered * STAT_BYTES, "k": dkdv_keys * D * es, "v": dkdv_keys * Dv * es,
                 "plan": units * ((k_tiles + col_entries * subs) * INDEX_BYTES + (col_tokens + k_tiles) * BITS_BYTES)},
                {"dk": rows_k * D * es, "dv": rows_k * Dv * es})
    rep.add("selection_masked_dq",
            {"q": rows_q * D * es, "do": rows_q * Dv * es, "stats": rows_q * 2 * STAT_BYTES,
             "delta": rows_q * STAT_BYTES, "k": units * keys * D * es, "v": units * keys * Dv * es,
             "plan": units * ((q_tiles + entries) * INDEX_BYTES + (tokens + entries) * BITS_BYTES)},
            {"dq": rows_q * D * es})
    return rep


__all__ = ["BITS_BYTES", "key_backward", "key_forward", "masked_backward", "masked_forward"]
