"""`ContextParallelStep`: the per-step half of a context-parallel plan.

A :class:`~sparse_io_attn.distributed.plan.ContextParallelPlan` fixes what is fixed for a sequence
length: which query rows and K/V tokens each rank owns. What a selection changes every step (MoBA,
NSA, DSA choose again in every layer) is built here, by :meth:`ContextParallelPlan.step`, on the
selection's device with tensor operations over **this rank's rows only** (a ``[masks, rows, slots]``
list: a layout's kept blocks of the rank's query-block rows, a selection's entries of the rank's
tokens):

* the **units** the rank reads from other ranks: a unit is one key block of one *unit group*
  ``u = (batch group, K/V head group)``, the K/V of the batch elements and K/V heads one selection
  serves (all of them for a selection shared by batch and heads, one K/V head for a selection per
  GQA group or per query head), so the bytes moved are exactly the blocks read, per head group. A
  flag grid ``[unit groups, key blocks]`` scattered from the rank's entries;
* the **received key space**: per unit group, the received blocks in ascending order at slots
  ``0, 1, ...`` (the sequence's ragged last block, if received, in the last slot, so that lengths
  cut it as they cut the sequence): K/V of ``[B, Hkv, received_seqlen, D]``, the slots a group does
  not use left zero and never read;
* the **local** and **received** parts re-indexed: for a layout, two fixed-capacity
  :class:`~sparse_io_attn.BlockSparseLayout` (rows in shard order; keys in shard order / slots), in
  CSR order without a sort (both re-indexings keep a row's order); for a per-token
  :class:`~sparse_io_attn.layout.selection.Selection`, two
  :class:`~sparse_io_attn.selection.plan.SelectionPlan` over rows normalised once (one sort of the
  rank's rows) and split without another. Causality: the local part keeps it (shard order keeps
  the order of a rank's tokens); a received block is never a row's own, so it lies wholly before
  the row (kept, no mask) or after it (dropped here);
* ``requests``: the unit ids this rank asks each source for, grouped by source; where each received
  unit lands (``recv_regular``: a full block's slot row; ``recv_ragged``: the unit group of a
  received ragged last block). Everything is indexed per unit, never per token.

One host synchronisation: one read of a small int64 tensor (units and tokens from each source rank,
slots; for a layout without fixed capacity its longest row is read before) that the exchange's
buffers and collectives are sized by. The call
(:func:`~sparse_io_attn.distributed.context_parallel_attention`) sends every rank's counts in its
agreement (one ``all_gather``), so each rank learns what it sends, then moves the requests
(``all_to_all_single`` of unit ids) and the K/V (``all_to_all_single``).
"""
from __future__ import annotations

import hashlib
import math
import struct

import torch
import torch.distributed as dist

from sparse_io_attn.layout._csr import INDEX_DTYPE, _absolute_crow
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import META_FIELDS, SelectionPlan

KINDS = ("layout", "selection")


class ContextParallelStep:
    """One step's selection on one rank, planned for
    :func:`~sparse_io_attn.distributed.context_parallel_attention` (build it with
    :meth:`ContextParallelPlan.step <sparse_io_attn.distributed.plan.ContextParallelPlan.step>`).

    Attributes:
        plan, rank: the plan of the sequence and the rank this step is for.
        kind: ``"layout"`` or ``"selection"`` (what :attr:`local` and :attr:`received` are:
            :class:`~sparse_io_attn.BlockSparseLayout` or
            :class:`~sparse_io_attn.selection.plan.SelectionPlan`).
        causal: the plan's causality.
        block_size: tokens per key block, the unit of the exchange (the layout's block, or the
            selection's key block, which divides the plan's).
        num_key_blocks: ``C``, key blocks of the sequence; ``last_tokens`` those of the last one.
        batch_groups, groups, kv_groups: ``Lb`` (1: shared by the batch, else the batch), ``G`` (the
            selection's masks per batch element) and ``Gk`` (unit groups per batch group:
            ``min(G, Hkv)``, or ``G`` when built without ``num_heads_kv``); unit group of mask ``l =
            lb * G + g`` is ``lb * Gk + g // (G // Gk)``.
        num_heads_kv: the K/V heads it was built for (``None``: any multiple of ``Gk``).
        local: the rank's rows x its own keys (``seqlen = (n_local, n_local)``, shard order).
        received: the rank's rows x the received keys (``seqlen = (n_local, received_seqlen)``), or
            ``None`` when the rank receives nothing.
        slots, full_slots, received_seqlen: key blocks per unit group in the received key space (of
            which full blocks: all but a received ragged last block), its tokens.
        requests: int64 ``[sum(recv_units)]``: unit ids ``u * num_key_blocks + c`` asked of each
            source rank, grouped by source, ascending inside.
        recv_units, recv_tokens: lists ``[world_size]`` of units and tokens from each source rank.
        recv_regular, recv_ragged: int64, for the received units in receive order, full blocks first
            (grouped by source) then ragged last blocks: the row ``u * full slots + slot`` of each
            full block in the received key space viewed as blocks, the unit group of each ragged one.
        digest: a 63-bit fingerprint of what every rank's step must share (the plan, the kind, the
            key block, ``Lb``, ``G``, ``Gk``), which the ranks compare before any exchange.
    """

    def __init__(self, plan, rank: int, kind: str, source, block_size: int, batch_groups: int, groups: int,
                 kv_groups: int, num_heads_kv: int | None):
        self.plan, self.rank, self.kind, self.source = plan, rank, kind, source
        self.causal = plan.causal
        self.block_size = block_size
        self.num_key_blocks = math.ceil(plan.seqlen / block_size)
        self.last_tokens = plan.seqlen - (self.num_key_blocks - 1) * block_size
        self.batch_groups, self.groups, self.kv_groups = batch_groups, groups, kv_groups
        self.num_heads_kv = num_heads_kv
        self.digest = _digest([KINDS.index(kind), block_size, batch_groups, groups, kv_groups, int(self.causal),
                               plan.digest])
        self.local = self.received = None
        self.slots = self.full_slots = self.received_seqlen = 0
        self.requests = self.recv_regular = self.recv_ragged = None
        self.recv_units = self.recv_tokens = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def num_unit_groups(self) -> int:
        """``U = Lb * Gk``."""
        return self.batch_groups * self.kv_groups

    @property
    def device(self) -> torch.device:
        return self.requests.device

    def unit_tokens(self) -> torch.Tensor:
        """Tokens of each key block (int64 ``[num_key_blocks]``, on the step's device)."""
        return _units(self.plan, self.block_size, self.device)[2]

    def ragged_units(self, units: list, tokens: list) -> list:
        """How many of ``units`` (per rank) are the ragged last block, from their ``tokens``."""
        short = self.block_size - self.last_tokens
        return [(u * self.block_size - t) // short if short else 0 for u, t in zip(units, tokens)]

    def check_heads(self, batch: int, num_heads_q: int, num_heads_kv: int) -> None:
        """``ValueError`` unless a call's ``[batch, heads]`` fit this step's unit groups."""
        Lb, G, Gk = self.batch_groups, self.groups, self.kv_groups
        if Lb not in (1, batch):
            raise ValueError(f"the step's selection was made for batch {Lb} but the inputs have batch {batch}; "
                             f"select for batch {batch} (or 1: shared by the batch)")
        if num_heads_q % G or (num_heads_kv % G and G % num_heads_kv):
            raise ValueError(f"the step's selection has {G} head groups but q has {num_heads_q} heads and k/v "
                             f"{num_heads_kv}; use 1, {num_heads_kv} (one per GQA group) or {num_heads_q}")
        if self.num_heads_kv is not None and self.num_heads_kv != num_heads_kv:
            raise ValueError(f"the step was built for num_heads_kv={self.num_heads_kv} but k/v have {num_heads_kv} "
                             f"heads; build it with plan.step(selection, num_heads_kv={num_heads_kv})")
        if num_heads_kv % Gk:
            raise ValueError(f"the step's selection has {G} head groups, more than the {num_heads_kv} K/V heads: "
                             f"build it with plan.step(selection, num_heads_kv={num_heads_kv}) so that each K/V "
                             f"head moves the union of its query heads' blocks")

    def split_asked(self, asked: torch.Tensor, ragged: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit ids other ranks asked of this one (grouped by asking rank) -> ``(rows, groups)``:
        the row ``u * full local blocks + local block`` of each full block (grouped by asking rank),
        the unit group of each ragged last block (``ragged`` of them, after: one stable partition)."""
        _, lstart, _ = _units(self.plan, self.block_size, asked.device)
        C, bs = self.num_key_blocks, self.block_size
        u, c = asked // C, asked % C
        full = self.plan.num_tokens(self.rank) // bs
        is_ragged = (c == C - 1) & (self.last_tokens < bs)
        order = torch.sort(is_ragged.to(torch.int8), stable=True).indices
        u, c = u[order], c[order]
        n = asked.numel() - ragged
        return u[:n] * full + lstart[c[:n]] // bs, u[n:]

    def floor_units(self) -> torch.Tensor:
        """The units this rank's rows read and it does not own, computed again from the source on
        the CPU (the layout's entries or the selection's indices, not the step's flag grid): int64
        ``u * num_key_blocks + c``, unique, ascending. The floor of the exchange; what
        :attr:`requests` holds, sorted."""
        plan, C = self.plan, self.num_key_blocks
        owner_u, _, _ = _units(plan, self.block_size, torch.device("cpu"))
        unit_of_l = _unit_of_mask(self.batch_groups, self.groups, self.kv_groups, torch.device("cpu"))
        if self.kind == "layout":
            lid, r, c = self.source.to("cpu").entries()
            keep = (plan.owner[r] == self.rank) & (owner_u[c] != self.rank)
            if self.causal:
                keep &= c <= r
            return torch.unique(unit_of_l[lid[keep]] * C + c[keep])
        sel = self.source.to("cpu")
        L = self.batch_groups * self.groups
        idx = sel.indices.reshape(L, sel.seqlen_q, -1).to(torch.int64)
        counts = None if sel.counts is None else sel.counts.reshape(L, sel.seqlen_q).to(torch.int64)
        t = plan.token_index(self.rank)
        if sel.seqlen_q != plan.num_tokens(self.rank):
            idx = idx[:, t]
            counts = None if counts is None else counts[:, t]
        keep = (idx >= 0) & (idx < C)
        if counts is not None:
            keep &= torch.arange(idx.shape[-1]) < counts[..., None]
        if self.causal:
            keep &= idx * self.block_size <= t[:, None]
        keep &= owner_u[idx.clamp(0, C - 1)] != self.rank
        u = unit_of_l[:, None, None].expand_as(idx)
        return torch.unique(u[keep] * C + idx[keep])

    def __repr__(self) -> str:
        return (f"ContextParallelStep(rank={self.rank}/{self.world_size}, kind={self.kind!r}, block={self.block_size}, "
                f"unit groups={self.batch_groups}x{self.kv_groups}, received units={sum(self.recv_units)}, "
                f"tokens={sum(self.recv_tokens)}, slots={self.slots})")


# ------------------------------------------------------------------------------------------- build
def build(plan, selection, *, rank: int | None = None, num_heads_kv: int | None = None) -> ContextParallelStep:
    """See :meth:`ContextParallelPlan.step <sparse_io_attn.distributed.plan.ContextParallelPlan.step>`."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    plan._check_rank(rank)
    if num_heads_kv is not None and (isinstance(num_heads_kv, bool) or not isinstance(num_heads_kv, int)
                                     or num_heads_kv < 1):
        raise ValueError(f"num_heads_kv must be a positive int (the K/V heads of the call) or None, got "
                         f"{num_heads_kv!r}")
    if isinstance(selection, BlockSparseLayout):
        return _from_layout(plan, selection, rank, num_heads_kv)
    if isinstance(selection, Selection):
        return _from_selection(plan, selection, rank, num_heads_kv)
    raise TypeError(f"plan.step takes a BlockSparseLayout or a Selection (sparse_io_attn.layout.selection), got "
                    f"{type(selection).__name__}")


def _kv_groups(G: int, num_heads_kv: int | None) -> int:
    if num_heads_kv is None:
        return G
    if G % num_heads_kv and num_heads_kv % G:
        raise ValueError(f"the selection has {G} head groups and the call {num_heads_kv} K/V heads: one must "
                         f"divide the other (1, num_heads_kv or num_heads_q groups)")
    return min(G, num_heads_kv)


def _from_layout(plan, layout: BlockSparseLayout, rank: int, num_heads_kv) -> ContextParallelStep:
    B, N, R = plan.block_size, plan.seqlen, plan.num_blocks
    if layout.block_size != (B, B) or layout.seqlen != (N, N):
        raise ValueError(f"the step's layout has block size {layout.block_size} and seqlen {layout.seqlen} but the "
                         f"plan shards {N} tokens in blocks of {B}: select with block_size={B} over the whole "
                         f"sequence (seqlen=({N}, {N}))")
    Lb, G = layout.layout_batch, layout.layout_heads
    step = ContextParallelStep(plan, rank, "layout", layout, B, Lb, G, _kv_groups(G, num_heads_kv), num_heads_kv)
    dev = layout.device
    t = plan.device_tensors(dev)
    L, n = Lb * G, layout.col_slots.numel()
    rows = _rank_tensor(plan, rank, "rows", dev)                            # the rank's query-block rows
    crow = layout.crow_indices.to(torch.int64)
    start, count = crow[:, rows], crow[:, rows + 1] - crow[:, rows]          # [L, R_r]
    K = n // (L * R) if layout.fixed_capacity and n % (L * R) == 0 else int(count.max()) if count.numel() else 0
    K = max(K, 1)
    j = torch.arange(K, device=dev)
    pos = (start[..., None] + j).clamp(max=max(n - 1, 0))                    # [L, R_r, K]
    valid = j < count[..., None]
    c = layout.col_slots[pos].to(torch.int64) if n else torch.zeros_like(pos)
    pid = layout.partial_id_slots[pos] if n else torch.full_like(pos, -1, dtype=INDEX_DTYPE)
    if plan.causal:
        valid &= c <= rows[:, None]
    local = t["owner"][c] == rank
    on_local, on_remote = valid & local, valid & ~local
    unit = _unit_of_mask(Lb, G, step.kv_groups, dev)[:, None, None]
    offsets = [_row_offsets(on_local), _row_offsets(on_remote)]
    (overflow, n_loc, n_rem), slot_of = _exchange(step, _grid(step, unit.expand_as(c), c, on_remote),
                                                  [(count > K).any(), offsets[0][-1], offsets[1][-1]])
    if overflow:
        raise ValueError(f"the layout {layout.name!r} is marked fixed-capacity with {n} slots for {L} x {R} rows, "
                         f"but a row keeps more than {K} blocks; build it with from_kv_indices or without "
                         f"fixed_capacity")
    n_local = plan.num_tokens(rank)

    def part(keep, flat, size, col, n_keys, what):
        crow_p, col_p, pid_p = _pack_rows(keep, flat, size, col, pid)
        return BlockSparseLayout(crow_p, col_p, block_size=(B, B), seqlen=(n_local, n_keys), layout_batch=Lb,
                                 layout_heads=G, name=f"{layout.name}@rank{rank}.{what}", validate=False,
                                 partial_ids=pid_p, partial_masks=layout.partial_masks)._mark_checked()
    step.local = part(on_local, offsets[0], n_loc, t["local_index"][c], n_local, "local")
    if step.received_seqlen:
        step.received = part(on_remote, offsets[1], n_rem, slot_of[unit, c], step.received_seqlen, "received")
    return step


def _from_selection(plan, selection: Selection, rank: int, num_heads_kv) -> ContextParallelStep:
    B, N = plan.block_size, plan.seqlen
    bs = selection.block_size
    if B % bs:
        raise ValueError(f"the selection's key blocks of {bs} tokens do not divide the plan's blocks of {B}: a key "
                         f"block must lie on one rank; select with a block size dividing {B} (or plan with "
                         f"block_size a multiple of {bs})")
    n_local = plan.num_tokens(rank)
    Nq = selection.seqlen_q
    if Nq not in (N, n_local):
        raise ValueError(f"the selection has {Nq} query rows but the plan shards {N} tokens and gives rank {rank} "
                         f"{n_local}: pass the whole sequence's selection (token order) or this rank's rows "
                         f"(shard order)")
    Lb, G = selection.batch or 1, selection.num_selections
    step = ContextParallelStep(plan, rank, "selection", selection, bs, Lb, G, _kv_groups(G, num_heads_kv),
                               num_heads_kv)
    dev = selection.device
    C, L, K = step.num_key_blocks, Lb * G, selection.max_blocks
    local_tab, remote_tab, block_tab = _selection_tables(plan, rank, bs, dev)
    # the rank's rows, int32, normalised once: valid, causally alive, each block once, ascending
    key = torch.empty((L, n_local, K), dtype=torch.int32, device=dev)
    _take_rows(plan, rank, selection.indices.reshape(L, Nq, K), key, Nq != n_local, (-1, C))
    bad = key < 0
    bad |= key > _rank_tensor(plan, rank, ("last block", bs), dev)         # out of range or in the causal future
    if selection.counts is not None:
        counts = torch.empty((L, n_local), dtype=torch.int32, device=dev)
        _take_rows(plan, rank, selection.counts.reshape(L, Nq), counts, Nq != n_local, (0, K))
        bad |= torch.arange(K, device=dev, dtype=torch.int32) >= counts[..., None]
    key.masked_fill_(bad, C)                                                  # C: no block (sorts last)
    key = torch.sort(key, dim=-1).values
    key[..., 1:].masked_fill_(key[..., 1:] == key[..., :-1], C)               # each block once
    on_local, on_remote = local_tab[key], remote_tab[key]                    # False for C
    base = (_unit_of_mask(Lb, G, step.kv_groups, dev) * (C + 1)).to(torch.int32)[:, None, None]
    flat = key + base                                                         # (unit group, block), C: a spare column
    grid = torch.zeros(step.num_unit_groups * (C + 1), dtype=torch.bool, device=dev)
    grid[flat] = True
    grid = grid.view(-1, C + 1)[:, :C] & remote_tab[:C]
    ranks = [torch.cumsum(on_local, -1, dtype=torch.int32), torch.cumsum(on_remote, -1, dtype=torch.int32)]
    longest, slot_of = _exchange(step, grid, [r[..., -1].max() for r in ranks])

    def part(flag, rank_in_row, slots, values, n_keys, delta):
        slots = max(slots, 1)
        dest = torch.where(flag, rank_in_row - 1, slots).to(torch.int64)
        rows = torch.full((L, n_local, slots + 1), -1, dtype=INDEX_DTYPE, device=dev).scatter_(-1, dest, values)
        meta = dict(block_size=bs, seqlen_q=n_local, seqlen_k=n_keys, num_selections=G, layout_batch=Lb,
                    batched=int(selection.batch is not None), num_kv_blocks=-(-n_keys // bs), checked=1)
        return SelectionPlan.from_op(rows[..., :slots].contiguous(), rank_in_row[..., -1].contiguous(), None,
                                     [meta[f] for f in META_FIELDS], delta)
    step.local = part(on_local, ranks[0], longest[0], block_tab[key], n_local, 0 if plan.causal else None)
    if step.received_seqlen:
        slots = torch.cat([slot_of, slot_of.new_zeros(slot_of.shape[0], 1)], 1).to(INDEX_DTYPE).view(-1)
        step.received = part(on_remote, ranks[1], longest[1], slots[flat], step.received_seqlen, None)
    return step


# ------------------------------------------------------------------------------------------- pieces
def _digest(values) -> int:
    """A 63-bit fingerprint (BLAKE2b) of Python ints."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{len(values)}q", *values))
    return int.from_bytes(h.digest(), "little") >> 1


def _units(plan, bs: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(owner, local token start, tokens)`` of each key block of ``bs`` tokens (int64 ``[C]``), kept
    with the plan's device tensors."""
    t = plan.device_tensors(device)
    key = ("units", bs)
    if key not in t:
        B, N = plan.block_size, plan.seqlen
        c = torch.arange(math.ceil(N / bs), device=device)
        cp = c * bs // B                                                    # the plan block holding it
        t[key] = (t["owner"][cp], t["local_start"][cp] + c * bs - cp * B, (N - c * bs).clamp(max=bs))
    return t[key]


def _rank_tensor(plan, rank: int, what, device) -> torch.Tensor:
    """Kept on ``device`` per rank: its query-block rows (``"rows"``), token positions
    (``"tokens"``), or (``("last block", bs)``) the last key block of ``bs`` tokens each token may
    read, int32 ``[n_local, 1]`` (its own under causality, else the sequence's last)."""
    t = plan.device_tensors(device)
    key = (what, rank)
    if key not in t:
        if what == "rows":
            t[key] = plan.rows(rank).to(device)
        elif what == "tokens":
            t[key] = plan.token_index(rank).to(device)
        else:
            bs = what[1]
            last = torch.full((plan.num_tokens(rank),), math.ceil(plan.seqlen / bs) - 1, dtype=torch.int64)
            if plan.causal:
                last = plan.token_index(rank) // bs
            t[key] = last.to(device=device, dtype=torch.int32)[:, None]
    return t[key]


def _take_rows(plan, rank: int, x: torch.Tensor, out: torch.Tensor, whole: bool, bounds: tuple) -> None:
    """Copy the rank's rows of ``x`` (``[L, rows, ...]``: the whole sequence's when ``whole``, else the
    rank's already) into the int32 ``out``: the rank's contiguous runs of tokens, one for contiguous
    ownership, two for zig-zag (no index per token). int64 values are clamped to ``bounds`` first (what
    lies outside means the same at the bounds; a value past int32 must not wrap into one that does not)."""
    def copy(dst, src):
        dst.copy_(src.clamp(*bounds) if src.dtype == torch.int64 else src)
    if not whole:
        copy(out, x)
        return
    t = plan.device_tensors("cpu")
    key = ("token runs", rank)
    if key not in t:                                                    # host ints, once per rank
        rows = plan.rows(rank).tolist()
        B, N = plan.block_size, plan.seqlen
        runs, start = [], rows[0]
        for prev, row in zip(rows, rows[1:] + [None]):
            if row != prev + 1:
                runs.append((start * B, min((prev + 1) * B, N) - start * B))
                start = row
        t[key] = runs
    pos = 0
    for begin, length in t[key]:
        copy(out[:, pos:pos + length], x[:, begin:begin + length])
        pos += length


def _selection_tables(plan, rank: int, bs: int, device):
    """Per key block of ``bs`` tokens and one spare entry ``C`` (no block): whether the rank owns it,
    whether another rank does, and its key-block index in the rank's shard (kept)."""
    t = plan.device_tensors(device)
    key = ("selection tables", rank, bs)
    if key not in t:
        owner, lstart, _ = _units(plan, bs, device)
        mine = torch.cat([owner == rank, owner.new_zeros(1, dtype=torch.bool)])
        other = torch.cat([owner != rank, owner.new_zeros(1, dtype=torch.bool)])
        t[key] = (mine, other, torch.cat([lstart // bs, lstart.new_zeros(1)]).to(INDEX_DTYPE))
    return t[key]


def _unit_of_mask(Lb: int, G: int, Gk: int, device) -> torch.Tensor:
    """The unit group ``lb * Gk + g // (G // Gk)`` of each mask ``l = lb * G + g`` (int64 ``[Lb * G]``)."""
    l = torch.arange(Lb * G, device=device)
    return (l // G) * Gk + (l % G) // (G // Gk)


def _grid(step: ContextParallelStep, unit: torch.Tensor, c: torch.Tensor, remote: torch.Tensor) -> torch.Tensor:
    """bool ``[U, C]``: the units (unit group, key block) the rank's rows read from other ranks."""
    U, C = step.num_unit_groups, step.num_key_blocks
    grid = torch.zeros(U * C + 1, dtype=torch.bool, device=c.device)
    grid[torch.where(remote, unit * C + c, U * C)] = True
    return grid[:-1].view(U, C)


def _exchange(step: ContextParallelStep, grid: torch.Tensor, extra: list) -> tuple[list, torch.Tensor]:
    """From the flag grid: the received key space (each unit group's blocks ascending at slots 0, 1,
    ..., the ragged last block in the last slot), the counts per source rank and the requests; the
    one host read (counts, slots, and ``extra``: device scalars the caller sizes its parts by).
    Returns the ``extra`` values as Python ints and ``slot_of [U, C]`` (a received block's slot)."""
    plan, W = step.plan, step.world_size
    U, C, bs = step.num_unit_groups, step.num_key_blocks, step.block_size
    dev = grid.device
    owner_u, _, tok = _units(plan, bs, dev)
    ragged = step.last_tokens < bs
    g = grid.to(torch.int64)
    slot_of = torch.cumsum(g, 1) - g
    rag_any = grid[:, -1].any().to(torch.int64) if ragged else torch.zeros((), dtype=torch.int64, device=dev)
    full_slots = (g[:, :-1] if ragged else g).sum(1).max()
    if ragged:
        slot_of[:, -1] = full_slots
    per_block = g.sum(0)
    units = torch.zeros(W, dtype=torch.int64, device=dev).index_add_(0, owner_u, per_block)
    tokens = torch.zeros(W, dtype=torch.int64, device=dev).index_add_(0, owner_u, per_block * tok)
    values = torch.stack([full_slots, rag_any] + [x.to(torch.int64) for x in extra])
    host = torch.cat([units, tokens, values]).tolist()
    step.recv_units, step.recv_tokens = host[:W], host[W:2 * W]
    full, rag = host[2 * W], host[2 * W + 1]
    step.slots, step.full_slots = full + rag, full
    step.received_seqlen = full * bs + (step.last_tokens if rag else 0)
    n_req = sum(step.recv_units)
    flat = torch.arange(U * C, device=dev)
    key = torch.where(grid.reshape(-1), owner_u[flat % C] * (U * C) + flat, W * U * C)
    ids = torch.sort(key).values[:n_req] % (U * C)                                   # by source, then (u, c)
    step.requests = ids
    n_rag = sum(step.ragged_units(step.recv_units, step.recv_tokens))
    u, c = ids // C, ids % C
    is_rag = (c == C - 1) & ragged
    order = torch.sort(is_rag.to(torch.int8), stable=True).indices                  # full blocks, then ragged
    u, c = u[order], c[order]
    n = n_req - n_rag
    step.recv_regular = u[:n] * full + slot_of[u[:n], c[:n]]
    step.recv_ragged = u[n:]
    return host[2 * W + 2:], slot_of


def _row_offsets(keep: torch.Tensor) -> torch.Tensor:
    """Flat CSR offsets ``[L * M + 1]`` (int64) of the kept entries of ``[L, M, K]`` per-row lists."""
    flat = torch.zeros(keep.shape[0] * keep.shape[1] + 1, dtype=torch.int64, device=keep.device)
    torch.cumsum(keep.sum(-1).reshape(-1), 0, out=flat[1:])
    return flat


def _pack_rows(keep: torch.Tensor, flat: torch.Tensor, size: int, col: torch.Tensor, pid: torch.Tensor):
    """Kept entries of ``[L, M, K]`` per-row lists (each row's kept entries in order; ``flat`` from
    :func:`_row_offsets`, ``size`` their number) -> a CSR ``(crow int32 [L, M + 1], col [size],
    partial_ids [size])``."""
    L, M, _ = keep.shape
    k = keep.to(torch.int64)
    dest = torch.where(keep, flat[:-1].view(L, M, 1) + torch.cumsum(k, -1) - k, size).reshape(-1)
    cols = torch.zeros(size + 1, dtype=INDEX_DTYPE, device=keep.device)
    pids = torch.full((size + 1,), -1, dtype=INDEX_DTYPE, device=keep.device)
    cols.scatter_(0, dest, col.reshape(-1).to(INDEX_DTYPE))
    pids.scatter_(0, dest, pid.reshape(-1).to(INDEX_DTYPE))
    return _absolute_crow(flat, L, M).to(INDEX_DTYPE), cols[:-1], pids[:-1]


__all__ = ["ContextParallelStep", "KINDS", "build"]
