"""Traffic model of the selection Triton kernels: the bytes they count, predicted without running.

:func:`selection_forward` / :func:`selection_backward` / :func:`selection` return a
``TrafficReport(source="predicted")`` with the kernels' names and tensor names, equal (exactly, in
bytes) to what ``IOCounter`` records for ``backend="triton"``. Everything is computed from the
plan's normalised rows (counts and last blocks, vectorised over ``[L, Nq]``), per-block list lengths
and the shapes, so it works at sizes far beyond what the interpreter can run.

What a program moves (the kernels in :mod:`sparse_io_attn.selection.triton`; ``D`` = head dim,
``e`` = element bytes, plan entries are int32; ``R`` = heads sharing a selection and a KV head,
:func:`~sparse_io_attn.selection.tiles.sel_heads`):

* ``selection_fwd`` (per query token, per batch x unit of ``R`` heads, per chunk of ``BLOCK_H``
  heads): reads its heads' ``q`` rows, exactly the *allowed* keys of its row (``k`` and ``v``:
  every listed block whole, the last one clipped to the sequence and the diagonal:
  :func:`row_pairs`), 1 row count and ``count * TILES`` row entries (one per key step of a block
  of ``TILES`` steps, each gathered slot once); writes ``o`` rows, fp32 ``lse`` and ``stats``.
* ``selection_decode`` (``Nq <= 16``; per split of the forward's row program): the forward's reads
  split between the row's splits (every key step belongs to exactly one: keys and row entries do not
  depend on where the splits cut), plus the row count and the ``q`` rows once per split; one split
  writes ``o``, ``lse``, ``stats``, several write fp32 ``partial`` rows (``m``, ``l``, ``acc``: ``2 +
  D`` floats per head and split) that ``selection_decode_merge`` reads once before writing ``o``,
  ``lse``, ``stats`` (:func:`selection_decode_forward`).
* ``selection_bwd_preprocess``: reads ``o`` and ``do``, writes fp32 ``delta``, once per row.
* ``selection_bwd_dkdv`` (per key tile of a block, per batch x KV head): reads and writes its
  ``k``/``v``/``dk``/``dv`` rows once (every key once overall); per selection serving the group, 2
  list offsets and, per token of the block's list, ``R`` gathered rows of ``q``, ``do``, ``stats``
  (8 B) and ``delta`` (4 B) and the token's list entry (once per row tile it spans).
* ``selection_bwd_dq``: like the forward's reads, plus ``do``, ``stats`` and ``delta`` per row;
  writes ``dq``.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.tiles import element_size, tile_head_dim
from sparse_io_attn._attention.delta import residual_made
from sparse_io_attn._attention.traffic import (DECODE_MERGE_TENSORS, INDEX_BYTES, PREPROCESS_TENSORS, STAT_BYTES,
                                               add_decode, add_preprocess, output_bytes)
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import (DECODE_MAX_QUERIES, DECODE_SPLIT_KEYS, SelectionTiles, choose_tiles,
                                            decode_config, family_tiles, kernel_family, key_step)
from sparse_io_attn.selection.traffic_families import key_backward, key_forward, masked_backward, masked_forward
from sparse_io_attn.selection.traffic_terms import (DECODE_KERNEL_NAMES, DECODE_TENSORS, DKDV_TENSORS,
                                                    DQ_MERGE_TENSORS, DQ_TENSORS, FWD_TENSORS, KERNEL_NAMES,
                                                    MERGE_TENSORS, block_tokens, check_plan, dkdv_traffic, row_pairs,
                                                    selection_pairs, table_reads, usage)
from sparse_io_attn.tally.report import TrafficReport


def family(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int, dtype: torch.dtype,
           name: str | None = None) -> str:
    """The Triton kernel family of a call (:func:`~sparse_io_attn.selection.tiles.kernel_family`, as the
    launcher decides it): ``"query"``, ``"key"`` or ``"masked"``."""
    return kernel_family(plan.block_size, plan.max_blocks, plan.num_layouts, batch, num_heads_q, num_heads_kv,
                         plan.num_selections, plan.seqlen[0], plan.seqlen[1], head_dim, dtype, name)


def selection_flops(plan: SelectionPlan, batch: int, num_heads_q: int, head_dim: int, *,
                    backward: bool = False) -> int:
    """Matmul FLOPs over allowed pairs: forward ``4 * D`` per pair, backward ``10 * D`` (the
    FlashAttention convention, as :func:`~sparse_io_attn.block_sparse.traffic.block_sparse_flops`)."""
    return (10 if backward else 4) * head_dim * selection_pairs(plan, batch, num_heads_q)


def _row_reads(plan: SelectionPlan, batch, num_heads_q, num_heads_kv, block_h: int, block_n: int):
    """``(keys, entries)`` the query-major programs (forward, dQ) read in all, and ``rows`` (query rows)."""
    mult, hps, R = usage(plan, batch, num_heads_q, num_heads_kv)
    _, _, tiles = key_step(plan.block_size, block_n)
    programs = mult * (hps // R) * -(-R // block_h)     # per stored (selection, token)
    keys = int(row_pairs(plan).sum()) * programs
    counts = plan.row_counts.cpu().to(torch.int64)
    entries = (counts.numel() + int(counts.sum()) * tiles + table_reads(plan)) * programs
    return keys, entries


def selection_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                      dtype: torch.dtype, *, tiles: SelectionTiles | None = None, decode: bool | None = None,
                      family_name: str | None = None, head_dim_v: int | None = None,
                      residual: bool = False) -> TrafficReport:
    """Predicted bytes of one forward (``TrafficReport(source="predicted")``): the kernels of the family
    the launcher runs (:func:`family`; ``family_name`` as given to it): ``selection_fwd`` (query-major;
    ``tiles`` applies to it), ``selection_key_fwd`` + ``selection_key_merge`` (key-major) or
    ``selection_masked_fwd``; with ``decode`` (``None``: when ``Nq <= 16``, as the launcher decides) the
    decode kernels' (:func:`selection_decode_forward`). ``head_dim_v``: v's head dim when it is not q's.
    ``residual``: a gradient will be needed, so a 16-bit forward also writes its output's rounding
    residual (and never runs the decode kernels)."""
    check_plan(plan)
    res = residual_made(dtype, residual)
    if decode is None:
        decode = plan.seqlen[0] <= DECODE_MAX_QUERIES and not res
    if decode:
        return selection_decode_forward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype,
                                        head_dim_v=head_dim_v)
    es, D, Dv = element_size(dtype), head_dim, head_dim_v or head_dim
    fam = family(plan, batch, num_heads_q, num_heads_kv, tile_head_dim(D, Dv), dtype, family_name)
    if fam == "key":
        return key_forward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype, es, Dv, residual=res)
    if fam == "masked":
        return masked_forward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype, es, Dv, residual=res)
    R = usage(plan, batch, num_heads_q, num_heads_kv)[2]
    tiles = tiles or choose_tiles(plan.block_size, tile_head_dim(D, Dv), dtype, R)
    keys, entries = _row_reads(plan, batch, num_heads_q, num_heads_kv, *tiles.fwd)
    rows = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    if not rows:            # an empty grid is not launched
        return rep
    rep.add("selection_fwd", {"q": rows * D * es, "k": keys * D * es, "v": keys * Dv * es,
                              "plan": entries * INDEX_BYTES},
            output_bytes(rows, Dv, es, res))
    return rep


def selection_decode_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                             dtype: torch.dtype, *, split_keys: int = DECODE_SPLIT_KEYS,
                             head_dim_v: int | None = None) -> TrafficReport:
    """Predicted bytes of the decode forward (``selection_decode``, and ``selection_decode_merge``
    when the rows are split): the launch of :func:`~sparse_io_attn.selection.tiles.decode_config`
    (``split_keys`` as given to the launcher). Per row program and split: the ``q`` rows and the row
    count; per row program: the allowed keys (:func:`row_pairs`) and ``count * TILES`` row entries,
    wherever the splits cut. O(plan rows), no launch."""
    check_plan(plan)
    es, D, Dv = element_size(dtype), head_dim, head_dim_v or head_dim
    mult, hps, R = usage(plan, batch, num_heads_q, num_heads_kv)
    cfg = decode_config(plan.block_size, plan.max_blocks, batch, num_heads_q, num_heads_kv, plan.num_selections,
                        plan.seqlen[0], tile_head_dim(D, Dv), dtype, split_keys=split_keys)
    S = cfg.splits
    programs = mult * (hps // R) * -(-R // cfg.block_h)          # row programs per stored (selection, token)
    counts = plan.row_counts.cpu().to(torch.int64)
    keys = int(row_pairs(plan).sum()) * programs
    entries = (counts.numel() * S + int(counts.sum()) * cfg.tiles + table_reads(plan, S)) * programs
    rows = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    if not rows:            # an empty grid is not launched
        return rep
    reads = {"q": S * rows * D * es, "k": keys * D * es, "v": keys * Dv * es, "plan": entries * INDEX_BYTES}
    add_decode(rep, "selection_decode", reads, rows, S, Dv, es)
    return rep


def selection_backward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                       dtype: torch.dtype, *, tiles: SelectionTiles | None = None,
                       family_name: str | None = None, head_dim_v: int | None = None,
                       residual: bool = False) -> TrafficReport:
    """Predicted bytes of one backward: ``selection_bwd_preprocess``, then ``selection_bwd_dkdv`` +
    ``selection_bwd_dq`` (query-major), ``selection_key_bwd`` + ``selection_key_dq_merge`` (key-major:
    the dK/dV kernel at the family's tiles writing dQ partials) or ``selection_masked_dkdv`` +
    ``selection_masked_dq``. ``residual``: the forward wrote a rounding residual (16-bit, through
    autograd), which the preprocess reads."""
    check_plan(plan)
    res = residual_made(dtype, residual)
    es, D, Dv = element_size(dtype), head_dim, head_dim_v or head_dim
    R = usage(plan, batch, num_heads_q, num_heads_kv)[2]
    tiles = tiles or choose_tiles(plan.block_size, tile_head_dim(D, Dv), dtype, R)
    fam = family(plan, batch, num_heads_q, num_heads_kv, tile_head_dim(D, Dv), dtype, family_name)
    if fam == "key":
        t = family_tiles("key", plan.block_size, tile_head_dim(D, Dv), dtype, R)
        return key_backward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype, es, (t.dkdv_m, t.block_n), Dv,
                            residual=res)
    if fam == "masked":
        return masked_backward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype, es, Dv, residual=res)
    rows_q = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    add_preprocess(rep, "selection_bwd_preprocess", rows_q, Dv, es, res)
    if batch * num_heads_kv * plan.seqlen[1]:
        rep.add("selection_bwd_dkdv", *dkdv_traffic(plan, batch, num_heads_q, num_heads_kv, D, es, *tiles.dkdv,
                                                    store_dq=False, head_dim_v=Dv))
    if rows_q:
        keys, entries = _row_reads(plan, batch, num_heads_q, num_heads_kv, *tiles.dq)
        rep.add("selection_bwd_dq",
                {"q": rows_q * D * es, "do": rows_q * Dv * es, "stats": rows_q * 2 * STAT_BYTES,
                 "delta": rows_q * STAT_BYTES, "k": keys * D * es, "v": keys * Dv * es,
                 "plan": entries * INDEX_BYTES},
                {"dq": rows_q * D * es})
    return rep


def selection(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
              dtype: torch.dtype, *, tiles: SelectionTiles | None = None,
              family_name: str | None = None, head_dim_v: int | None = None) -> TrafficReport:
    """Predicted bytes of forward + backward (what ``IOCounter`` sees around the forward and
    ``out.backward(...)``: a 16-bit forward writes its rounding residual, the preprocess reads it)."""
    args = (plan, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    kw = dict(tiles=tiles, family_name=family_name, head_dim_v=head_dim_v, residual=True)
    return selection_forward(*args, **kw) + selection_backward(*args, **kw)


__all__ = ["DECODE_KERNEL_NAMES", "DECODE_MERGE_TENSORS", "DECODE_TENSORS", "DKDV_TENSORS", "DQ_MERGE_TENSORS",
           "DQ_TENSORS", "FWD_TENSORS", "KERNEL_NAMES", "MERGE_TENSORS", "PREPROCESS_TENSORS", "block_tokens", "family",
           "row_pairs", "selection", "selection_backward", "selection_decode_forward", "selection_flops",
           "selection_forward", "selection_pairs"]
