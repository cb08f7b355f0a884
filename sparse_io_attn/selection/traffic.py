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

from sparse_io_attn._attention.tiles import element_size
from sparse_io_attn._attention.traffic import (DECODE_BASE, DECODE_MERGE_TENSORS, DKDV_BASE, DQ_BASE, FWD_BASE,
                                               INDEX_BYTES, PREPROCESS_TENSORS, STAT_BYTES, add_decode, add_preprocess)
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import (DECODE_MAX_QUERIES, DECODE_SPLIT_KEYS, SelectionTiles, choose_tiles,
                                            decode_config, key_step, key_tile, sel_heads)
from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.tally.report import TrafficReport

# Tensor names of each kernel's I/O counter, in slot order: the kit's tensors of the kernel's kind,
# then the plan's rows (the kernels' named slots are built from these tuples in :mod:`.triton.slots`;
# the preprocess and merge kernels are the attention kit's).
FWD_TENSORS = FWD_BASE + ("plan",)
DKDV_TENSORS = DKDV_BASE + ("plan",)
DQ_TENSORS = DQ_BASE + ("plan",)
DECODE_TENSORS = DECODE_BASE + ("plan",)
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


def _usage(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int):
    """``(mult, hps, R)``: batch elements using each stored selection, heads per selection, heads per tile."""
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")
    hm = plan.head_map(batch, num_heads_q, num_heads_kv)
    mult = 1 if plan.batched else batch
    return mult, hm.heads_per_selection, sel_heads(num_heads_q, num_heads_kv, plan.num_selections)


def _check(plan) -> None:
    if not isinstance(plan, SelectionPlan):
        raise TypeError(f"plan must be a SelectionPlan, got {type(plan).__name__}")


def selection_pairs(plan: SelectionPlan, batch: int, num_heads_q: int) -> int:
    """Allowed ``(query, key)`` pairs summed over batch and query heads: the score elements the
    kernels compute (``Z_QK`` of Theorem 1.2)."""
    _check(plan)
    G = plan.num_selections
    if num_heads_q % G:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of G ({G})")
    mult = 1 if plan.batched else batch
    if plan.batched and plan.layout_batch != batch:
        raise ValueError(f"the selection was made for batch {plan.layout_batch}, got batch {batch}")
    return int(row_pairs(plan).sum()) * mult * (num_heads_q // G)


def selection_flops(plan: SelectionPlan, batch: int, num_heads_q: int, head_dim: int, *,
                    backward: bool = False) -> int:
    """Matmul FLOPs over allowed pairs: forward ``4 * D`` per pair, backward ``10 * D`` (the
    FlashAttention convention, as :func:`~sparse_io_attn.block_sparse.traffic.block_sparse_flops`)."""
    return (10 if backward else 4) * head_dim * selection_pairs(plan, batch, num_heads_q)


def _row_reads(plan: SelectionPlan, batch, num_heads_q, num_heads_kv, block_h: int, block_n: int):
    """``(keys, entries)`` the query-major programs (forward, dQ) read in all, and ``rows`` (query rows)."""
    mult, hps, R = _usage(plan, batch, num_heads_q, num_heads_kv)
    _, _, tiles = key_step(plan.block_size, block_n)
    programs = mult * (hps // R) * -(-R // block_h)     # per stored (selection, token)
    keys = int(row_pairs(plan).sum()) * programs
    counts = plan.row_counts.cpu().to(torch.int64)
    entries = (counts.numel() + int(counts.sum()) * tiles) * programs
    return keys, entries


def selection_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                      dtype: torch.dtype, *, tiles: SelectionTiles | None = None,
                      decode: bool | None = None) -> TrafficReport:
    """Predicted bytes of one forward (``TrafficReport(source="predicted")``): the ``selection_fwd``
    launch, or, with ``decode`` (``None``: when ``Nq <= 16``, as the launcher decides), the decode
    kernels' (:func:`selection_decode_forward`; ``tiles`` does not apply to them)."""
    _check(plan)
    if decode is None:
        decode = plan.seqlen[0] <= DECODE_MAX_QUERIES
    if decode:
        return selection_decode_forward(plan, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    es, D = element_size(dtype), head_dim
    R = _usage(plan, batch, num_heads_q, num_heads_kv)[2]
    tiles = tiles or choose_tiles(plan.block_size, head_dim, dtype, R)
    keys, entries = _row_reads(plan, batch, num_heads_q, num_heads_kv, *tiles.fwd)
    rows = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    if not rows:            # an empty grid is not launched
        return rep
    rep.add("selection_fwd", {"q": rows * D * es, "k": keys * D * es, "v": keys * D * es,
                              "plan": entries * INDEX_BYTES},
            {"o": rows * D * es, "lse": rows * STAT_BYTES, "stats": rows * 2 * STAT_BYTES})
    return rep


def selection_decode_forward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                             dtype: torch.dtype, *, split_keys: int = DECODE_SPLIT_KEYS) -> TrafficReport:
    """Predicted bytes of the decode forward (``selection_decode``, and ``selection_decode_merge``
    when the rows are split): the launch of :func:`~sparse_io_attn.selection.tiles.decode_config`
    (``split_keys`` as given to the launcher). Per row program and split: the ``q`` rows and the row
    count; per row program: the allowed keys (:func:`row_pairs`) and ``count * TILES`` row entries,
    wherever the splits cut. O(plan rows), no launch."""
    _check(plan)
    es, D = element_size(dtype), head_dim
    mult, hps, R = _usage(plan, batch, num_heads_q, num_heads_kv)
    cfg = decode_config(plan.block_size, plan.max_blocks, batch, num_heads_q, num_heads_kv, plan.num_selections,
                        plan.seqlen[0], head_dim, dtype, split_keys=split_keys)
    S = cfg.splits
    programs = mult * (hps // R) * -(-R // cfg.block_h)          # row programs per stored (selection, token)
    counts = plan.row_counts.cpu().to(torch.int64)
    keys = int(row_pairs(plan).sum()) * programs
    entries = (counts.numel() * S + int(counts.sum()) * cfg.tiles) * programs
    rows = batch * num_heads_q * plan.seqlen[0]
    rep = TrafficReport(source="predicted")
    if not rows:            # an empty grid is not launched
        return rep
    reads = {"q": S * rows * D * es, "k": keys * D * es, "v": keys * D * es, "plan": entries * INDEX_BYTES}
    add_decode(rep, "selection_decode", reads, rows, S, D, es)
    return rep


def selection_backward(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                       dtype: torch.dtype, *, tiles: SelectionTiles | None = None) -> TrafficReport:
    """Predicted bytes of one backward (``selection_bwd_preprocess``, ``selection_bwd_dkdv``,
    ``selection_bwd_dq``)."""
    _check(plan)
    es, D = element_size(dtype), head_dim
    mult, hps, R = _usage(plan, batch, num_heads_q, num_heads_kv)
    tiles = tiles or choose_tiles(plan.block_size, head_dim, dtype, R)
    bs, (Nq, Nk) = plan.block_size, plan.seqlen
    rows_q = batch * num_heads_q * Nq
    rows_k = batch * num_heads_kv * Nk
    rep = TrafficReport(source="predicted")
    add_preprocess(rep, "selection_bwd_preprocess", rows_q, D, es)

    # dK/dV: live key tiles per block (a tile starting inside the block and the sequence)
    block_m, block_n = tiles.dkdv
    _, key_tiles = key_tile(bs, block_n)
    starts = torch.arange(plan.num_kv_blocks, dtype=torch.int64)[:, None] * bs \
        + torch.arange(key_tiles, dtype=torch.int64)[None, :] * block_n
    live = (starts < torch.clamp((torch.arange(plan.num_kv_blocks)[:, None] + 1) * bs, max=Nk)).sum(1)  # [nkb]
    n = block_tokens(plan)                                                   # [L, nkb]
    per_entry = max(1, next_pow2(R) // block_m)
    sel_slots = mult * (hps // R)        # (batch element, KV head, selection slot) triples per stored selection
    gathered = int((n * live).sum()) * sel_slots * R
    entries = int((2 * live[None, :] + n * live * per_entry).sum()) * sel_slots
    if rows_k:
        rep.add("selection_bwd_dkdv",
                {"q": gathered * D * es, "do": gathered * D * es, "stats": gathered * 2 * STAT_BYTES,
                 "delta": gathered * STAT_BYTES, "k": rows_k * D * es, "v": rows_k * D * es,
                 "plan": entries * INDEX_BYTES},
                {"dk": rows_k * D * es, "dv": rows_k * D * es})

    if rows_q:
        keys, entries = _row_reads(plan, batch, num_heads_q, num_heads_kv, *tiles.dq)
        rep.add("selection_bwd_dq",
                {"q": rows_q * D * es, "do": rows_q * D * es, "stats": rows_q * 2 * STAT_BYTES,
                 "delta": rows_q * STAT_BYTES, "k": keys * D * es, "v": keys * D * es,
                 "plan": entries * INDEX_BYTES},
                {"dq": rows_q * D * es})
    return rep


def selection(plan: SelectionPlan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
              dtype: torch.dtype, *, tiles: SelectionTiles | None = None) -> TrafficReport:
    """Predicted bytes of forward + backward (what ``IOCounter`` sees around ``out.backward(...)``)."""
    args = (plan, batch, num_heads_q, num_heads_kv, head_dim, dtype)
    return selection_forward(*args, tiles=tiles) + selection_backward(*args, tiles=tiles)


__all__ = ["DECODE_KERNEL_NAMES", "DECODE_MERGE_TENSORS", "DECODE_TENSORS", "DKDV_TENSORS", "DQ_TENSORS",
           "FWD_TENSORS", "KERNEL_NAMES", "PREPROCESS_TENSORS", "block_tokens", "row_pairs", "selection",
           "selection_backward", "selection_decode_forward", "selection_flops", "selection_forward",
           "selection_pairs"]
