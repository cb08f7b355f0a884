"""`Selection`: per-query-token choices of key blocks, the input of
:func:`sparse_io_attn.selection_attention` and what the per-token selectors return.

A selection lists, for every query token, up to ``K`` key blocks of ``block_size`` keys (block ``c``
holds keys ``c * block_size .. min((c + 1) * block_size, seqlen_k) - 1``; ``block_size = 1`` picks
single tokens). ``indices`` is ``[B, G, Nq, K]`` (one selection per batch element) or ``[G, Nq, K]``
(shared by the batch); query head ``h`` of ``Hq`` uses selection ``h // (Hq // G)``, so ``G = 1``
shares one selection among all heads (DeepSeek Sparse Attention), ``G = Hkv`` one per GQA group
(NSA, MiniMax MSA) and ``G = Hq`` one per query head (MoBA).

Row semantics (what every backend, the reference and the converters implement): the allowed keys
of query ``t`` are the union of its listed blocks, intersected with causality when the attention
call asks for it. Negative entries are empty slots; a block listed twice counts once; with
``counts [B, G, Nq]`` (or ``[G, Nq]``) only the first ``counts`` entries of a row count. Entries
``>= ceil(seqlen_k / block_size)`` are refused by a checked call and count as empty slots
otherwise (no kernel reads outside its tensors either way).

Conversions with :class:`~sparse_io_attn.layout.core.BlockSparseLayout`, exact and on the device
(tensor operations, shapes fixed by the inputs' shapes, no host synchronisation):

* :func:`selection_from_layout`: a block layout is a selection whose query tokens share their
  query block's kept key blocks (``block_size = BLOCK_SIZE_KV``, ``G = layout_heads``).
* :func:`layout_from_selection`: a selection re-blocked into query blocks of ``block_size_q`` rows,
  each kept block carrying the element mask of the tokens that chose it (fixed capacity), e.g. for
  FlexAttention export or the context-parallel plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout._bits import WORD_BITS, num_words
from sparse_io_attn.layout._csr import INDEX_DTYPE, _absolute_crow, check_index_capacity, slot_entries
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout, inrange_words

_INT_DTYPES = (torch.int32, torch.int64)


def _int_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _INT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {got}")
    return x


@dataclass(frozen=True, eq=False)
class Selection:
    """Per-token key-block choices (see the module docstring for the meaning).

    Attributes:
        indices: int32/int64 ``[B, G, Nq, K]`` or ``[G, Nq, K]``: key-block indices, ``< 0`` = empty.
        block_size: keys per block (a positive int; 1 = single tokens; the last block may be ragged).
        counts: optional int32/int64 ``[B, G, Nq]`` / ``[G, Nq]``: entries of each row that count.

    Construction checks types and shapes only (no read of the data, so building one on a device
    never synchronises); :meth:`check` reads the values.

    :func:`selection_from_layout` turns a :class:`~sparse_io_attn.layout.core.BlockSparseLayout` into
    a selection and :func:`layout_from_selection` a selection into a layout with per-row element
    masks, both exact and on the device.
    """
    indices: torch.Tensor
    block_size: int
    counts: torch.Tensor | None = None

    def __post_init__(self):
        idx = _int_tensor(self.indices, "indices")
        if idx.dim() not in (3, 4):
            raise ValueError(f"indices must have shape [B, G, Nq, K] or [G, Nq, K] (G selections: 1, Hkv or "
                             f"Hq), got {tuple(idx.shape)}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"block_size must be a positive int (keys per selected block; 1 = single "
                             f"tokens), got {bs!r}")
        if idx.shape[-3] == 0:
            raise ValueError(f"indices has G = 0 selections (shape {tuple(idx.shape)}); pass at least one")
        if self.counts is not None:
            counts = _int_tensor(self.counts, "counts")
            if tuple(counts.shape) != tuple(idx.shape[:-1]):
                raise ValueError(f"counts must have shape {tuple(idx.shape[:-1])} (indices' shape without "
                                 f"its last dim), got {tuple(counts.shape)}")
            if counts.device != idx.device:
                raise ValueError(f"counts is on {counts.device} but indices on {idx.device}; put them on "
                                 f"one device")

    # ------------------------------------------------------------------ views
    @property
    def batch(self) -> int | None:
        """The batch size the selection was made for, or ``None`` when shared by the batch."""
        return self.indices.shape[0] if self.indices.dim() == 4 else None

    @property
    def num_selections(self) -> int:
        """``G``: query head ``h`` of ``Hq`` uses selection ``h // (Hq // G)``."""
        return self.indices.shape[-3]

    @property
    def seqlen_q(self) -> int:
        return self.indices.shape[-2]

    @property
    def max_blocks(self) -> int:
        """``K``: the slots per query row."""
        return self.indices.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def num_kv_blocks(self, seqlen_k: int) -> int:
        """Key blocks of a sequence of ``seqlen_k`` keys: ``ceil(seqlen_k / block_size)``."""
        return math.ceil(seqlen_k / self.block_size)

    def to(self, device) -> "Selection":
        device = torch.device(device)
        if device == self.device:
            return self
        return Selection(self.indices.to(device), self.block_size,
                         None if self.counts is None else self.counts.to(device))

    def check(self, seqlen_k: int) -> "Selection":
        """Read the values: raise ``ValueError`` for an entry ``>= ceil(seqlen_k / block_size)`` or a
        count outside ``[0, K]`` (one host synchronisation on CUDA)."""
        nkb = self.num_kv_blocks(seqlen_k)
        if self.indices.numel():
            top = int(self.indices.max())
            if top >= nkb:
                raise ValueError(f"indices holds key block {top} but seqlen_k {seqlen_k} with block_size "
                                 f"{self.block_size} has {nkb} key blocks (0..{nkb - 1}; negative entries are "
                                 f"empty slots)")
        if self.counts is not None and self.counts.numel():
            lo, hi = int(self.counts.min()), int(self.counts.max())
            if lo < 0 or hi > self.max_blocks:
                raise ValueError(f"counts must lie in [0, {self.max_blocks}] (K, the slots per row), got "
                                 f"values in [{lo}, {hi}]")
        return self

    def __repr__(self) -> str:
        lead = "shared by the batch" if self.batch is None else f"batch {self.batch}"
        return (f"Selection(G={self.num_selections}, seqlen_q={self.seqlen_q}, K={self.max_blocks}, "
                f"block_size={self.block_size}, {lead}, counts={'yes' if self.counts is not None else 'no'})")


# ------------------------------------------------------------------------------------- conversions
def selection_from_layout(layout: BlockSparseLayout, *, max_blocks: int | None = None,
                          check: bool = True) -> Selection:
    """The selection that computes exactly ``layout``: every query token of query-block row ``r``
    selects the kept key blocks of row ``r`` (``block_size = BLOCK_SIZE_KV``, ``G = layout_heads``;
    ``indices [layout_batch, G, seqlen_q, K]``, or ``[G, seqlen_q, K]`` when the layout is shared by
    the batch). ``selection_attention(q, k, v, sel, causal=c)`` then equals
    ``block_sparse_attention(q, k, v, layout, causal=c)``.

    A partial block is converted only when its element mask is, for each query row of the block,
    every in-range key or none (the token then selects the block or skips it); any other mask has
    no per-token block form, and ``ValueError`` says where. That check reads the masks (one host
    synchronisation on CUDA) and runs only when the layout stores element masks
    (``partial_masks.shape[0] > 0``); layouts of whole blocks convert without any synchronisation.

    ``K`` (slots per token) comes from the shapes: ``min(num_kv_blocks, stored slots)`` (each row's
    blocks fit, unused slots are ``-1``), or ``max_blocks`` when given: a tighter bound the caller
    knows (e.g. the ``k`` of a top-k layout). ``check=True`` verifies that no row keeps more than
    ``max_blocks`` blocks (one read of ``crow_indices``); ``check=False`` trusts it (a longer row
    would keep its first ``max_blocks`` blocks). Each token's blocks are ascending, ``-1`` in the
    slots of blocks it skips and after the row's last block. The result is on the layout's device.
    """
    if not isinstance(layout, BlockSparseLayout):
        raise TypeError(f"expected a BlockSparseLayout, got {type(layout).__name__}")
    (bq, bk), (sq, _) = layout.block_size, layout.seqlen
    L, R, C = layout.num_layouts, layout.num_q_blocks, layout.num_kv_blocks
    n = layout.col_slots.numel()
    if max_blocks is None:
        K = max(1, min(C, n))
    else:
        K = positive_int(max_blocks, "max_blocks (key blocks per query row)")
        if check and n and not torch.compiler.is_compiling():
            longest = int((layout.crow_indices[:, 1:] - layout.crow_indices[:, :-1]).max())
            if longest > K:
                raise ValueError(f"a query-block row of the layout keeps {longest} key blocks but max_blocks is "
                                 f"{K}; pass max_blocks >= {longest} (or leave it out)")
    dev = layout.device
    crow = layout.crow_indices.to(torch.int64)
    used, lid, r = slot_entries(crow, n)
    slot = torch.arange(n, device=dev)
    rank = slot - crow[lid.clamp(max=L - 1), r]                     # place of the block in its row
    keep = used & (rank < K)
    dest = torch.where(keep, (lid * R + r) * K + rank, L * R * K)   # row list position, spare slot last
    c = layout.col_slots.to(torch.int64)
    cols = torch.full((L * R * K + 1,), -1, dtype=INDEX_DTYPE, device=dev)
    cols = cols.scatter_(0, dest, c.to(INDEX_DTYPE))[:-1].view(L, R, K)
    t = torch.arange(sq, device=dev)
    indices = cols[:, t // bq]                                      # [L, sq, K]
    masks = layout.partial_masks
    if masks.shape[0]:
        pid = layout.partial_id_slots.to(torch.int64)
        part = used & (pid >= 0)
        inr = inrange_words(r, c, (bq, bk), layout.seqlen)                          # [n, bq, W]
        words = masks[pid.clamp(min=0, max=masks.shape[0] - 1)] & inr
        none, every = (words == 0).all(-1), (words == inr).all(-1)                    # [n, bq]
        mixed = part[:, None] & ~(none | every)
        if bool(mixed.any()):                                                         # the one read
            e, i = (int(x) for x in mixed.nonzero()[0])
            raise ValueError(
                f"the layout's partial block (query-block row {int(r[e])}, key block {int(c[e])}) of stored mask "
                f"{int(lid[e])} lets query {int(r[e]) * bq + i} attend some but not all of the block's keys; a "
                f"selection picks whole key blocks per token, so only masks whose every row allows all or "
                f"none of the block's keys convert; run this layout with block_sparse_attention, or rebuild it "
                f"with key blocks that its mask columns do not split")
        skips = part[:, None] & none                                                  # [n, bq]
        skip_list = torch.zeros(L * R * K + 1, bq, dtype=torch.bool, device=dev)
        skip_list = skip_list.index_copy_(0, dest, skips)[:-1].view(L, R, K, bq)
        skip = skip_list.transpose(2, 3).reshape(L, R * bq, K)[:, :sq]                  # [L, sq, K]
        indices = torch.where(skip, -1, indices)
    lead = (layout.layout_batch, layout.layout_heads) if layout.layout_batch > 1 else (layout.layout_heads,)
    return Selection(indices.reshape(*lead, sq, K).contiguous(), bk)


def _causal_words(r: torch.Tensor, c: torch.Tensor, block_size, delta: int) -> torch.Tensor:
    """``int32 [E, bq, W]`` (:mod:`._bits` format): element ``(a, b)`` of block ``(r[e], c[e])`` set iff
    key ``c * bk + b <= query r * bq + a + delta``."""
    bq, bk = block_size
    W = num_words(bk)
    last = (r * bq - c * bk + delta)[:, None] + torch.arange(bq, device=r.device)        # [E, bq]: last key b
    count = (last[:, :, None] + 1 - WORD_BITS * torch.arange(W, device=r.device)).clamp(0, WORD_BITS)
    word = (torch.ones((), dtype=torch.int64, device=r.device) << count) - 1
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def layout_from_selection(selection: Selection, seqlen_k: int, *, block_size_q: int,
                          causal=False) -> BlockSparseLayout:
    """The layout that computes exactly ``selection`` against ``seqlen_k`` keys: block size
    ``(block_size_q, selection.block_size)``, one stored mask per selection (``layout_batch`` the
    selection's batch or 1, ``layout_heads = G``).

    Block ``(r, c)`` is kept iff some token of query block ``r`` selected ``c`` (a valid entry inside
    ``counts``; out-of-range entries are empty slots, as for ``check=False``: call
    :meth:`Selection.check` first to refuse them); row ``t`` of its element mask allows the block's
    in-range keys iff token ``t`` selected ``c``, intersected with causality when ``causal`` is given
    (``False``, ``True``/``"top_left"``, ``"bottom_right"``, as the attention call's). So
    ``block_sparse_attention(q, k, v, layout, causal=c)`` equals ``selection_attention(q, k, v,
    selection, causal=c)``; pass the same ``causal`` to both.

    Fixed capacity (see :class:`BlockSparseLayout`): ``min(block_size_q * K, num_kv_blocks)`` slots
    per query-block row, each row's distinct blocks ascending at the front of the storage; one
    element mask per slot (not deduplicated: that would read the data); a block whose mask allows
    every in-range element is full, and no kept block has an empty mask. Built on the selection's
    device with tensor operations only (no host synchronisation) and valid by construction.
    """
    if not isinstance(selection, Selection):
        raise TypeError(f"expected a Selection, got {type(selection).__name__}")
    if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, int) or seqlen_k < 1:
        raise ValueError(f"seqlen_k must be a positive int (keys the selection's blocks index), got {seqlen_k!r}")
    bq = positive_int(block_size_q, "block_size_q (query rows per block)")
    bk, sq, sk = selection.block_size, selection.seqlen_q, seqlen_k
    if sq == 0:
        raise ValueError("the selection has no query rows (seqlen_q = 0); a layout needs at least one")
    delta = causal_offset(causal, sq, sk)
    lb, G, K = selection.batch or 1, selection.num_selections, selection.max_blocks
    L, R, nkb = lb * G, math.ceil(sq / bq), math.ceil(sk / bk)
    cap = max(1, min(bq * K, nkb))
    check_index_capacity(L * R * cap)
    dev = selection.device
    idx = selection.indices.reshape(L, sq, K).to(torch.int64)
    valid = (idx >= 0) & (idx < nkb)
    if selection.counts is not None:
        valid &= torch.arange(K, device=dev) < selection.counts.reshape(L, sq, 1).to(torch.int64)
    if delta is not None:          # blocks wholly in a token's causal future: nothing to allow
        valid &= idx * bk <= torch.arange(sq, device=dev)[:, None] + delta
    cand = torch.full((L, R * bq, K), nkb, dtype=torch.int64, device=dev)
    cand[:, :sq] = torch.where(valid, idx, nkb)
    ordered, order = torch.sort(cand.view(L * R, bq * K), dim=1, stable=True)          # invalid last
    first = ordered < nkb
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    rank = torch.cumsum(first, 1) - 1                            # the block's place among the row's blocks
    flat = torch.zeros(L * R + 1, dtype=torch.int64, device=dev)
    torch.cumsum(first.sum(1), 0, out=flat[1:])
    n = L * R * cap
    slot = torch.where(ordered < nkb, flat[:-1, None] + rank, n)                      # spare slot n
    col = torch.zeros(n + 1, dtype=INDEX_DTYPE, device=dev)
    col = col.scatter_(0, slot.view(-1), ordered.view(-1).to(INDEX_DTYPE))[:-1]       # equal values per slot
    chose = torch.zeros((n + 1) * bq, dtype=torch.bool, device=dev)                   # [slot, token row]
    chose = chose.index_fill_(0, (slot * bq + order // K).view(-1), True).view(n + 1, bq)[:-1]
    crow = _absolute_crow(flat, L, R).to(INDEX_DTYPE)
    used, _, r = slot_entries(crow, n)
    c = col.to(torch.int64)
    inr = inrange_words(r, c, (bq, bk), (sq, sk))
    words = torch.where(chose[:, :, None] & used[:, None, None], inr, 0)
    if delta is not None:
        words &= _causal_words(r, c, (bq, bk), delta)
    full = (words == inr).all(-1).all(-1)
    pid = torch.where(used & ~full, torch.arange(n, device=dev), -1).to(INDEX_DTYPE)
    layout = BlockSparseLayout(crow, col, block_size=(bq, bk), seqlen=(sq, sk), layout_batch=lb, layout_heads=G,
                               name=f"selection(block_size={bk})", validate=False, partial_ids=pid,
                               partial_masks=words, fixed_capacity=True)
    return layout._mark_checked()


def selection_from_flashmla(indices: torch.Tensor, seqlen_k: int, *, topk_length: torch.Tensor | None = None,
                            check: bool = True) -> Selection:
    """FlashMLA's sparse index format (deepseek-ai/FlashMLA ``flash_mla_sparse_fwd``, reference
    ``tests/ref.py::ref_sparse_attn_fwd`` at ``9241ae3e``) as a :class:`Selection` of single tokens.

    Args:
        indices: int32/int64 ``[s_q, h_kv, topk]``: key positions per query token and KV head; an
            entry is invalid iff ``< 0`` or ``>= seqlen_k`` (FlashMLA's rule: any negative value, not
            only -1).
        seqlen_k: ``s_kv``, the keys the indices address.
        topk_length: optional int ``[s_q]``: only the first ``topk_length[i]`` slots of row ``i`` count.
        check: refuse (``ValueError``) a row that lists one valid key twice: FlashMLA gathers, so such
            a key counts twice in its softmax, while a selection counts it once (reads the indices:
            one host synchronisation on CUDA). ``check=False`` skips the check (and the
            synchronisation); a repeated key then counts once.

    Returns ``Selection(indices [h_kv, s_q, topk], block_size=1)`` (shared by the batch; ``G = h_kv``,
    so with FlashMLA's ``h_kv = 1`` every query head uses it), invalid slots ``-1``. With FlashMLA's
    ``q [s_q, h_q, d_qk]`` and ``kv [s_kv, h_kv, d_qk]`` (``V = kv[..., :d_v]``),
    ``selection_attention(q.transpose(0, 1)[None], K, V, sel, causal=False, sm_scale=sm_scale)`` with
    ``K = kv.transpose(0, 1)[None]`` and ``V`` zero-padded to ``d_qk`` (selection_attention takes
    equal head dims; slice the output back to ``d_v``) computes FlashMLA's output. FlashMLA applies
    no causal mask (the indices alone decide); ``causal=True`` adds one. Differences: a row without a
    valid index has lse ``-inf`` here and ``+inf`` in FlashMLA (output 0 in both); ``attn_sink`` has
    no counterpart.
    """
    idx = _int_tensor(indices, "indices")
    if idx.dim() != 3:
        raise ValueError(f"FlashMLA indices must have shape [s_q, h_kv, topk], got {tuple(idx.shape)}")
    if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, int) or seqlen_k < 1:
        raise ValueError(f"seqlen_k must be a positive int (s_kv, the keys the indices address), got {seqlen_k!r}")
    s_q, _, topk = idx.shape
    valid = (idx >= 0) & (idx < seqlen_k)
    if topk_length is not None:
        length = _int_tensor(topk_length, "topk_length")
        if tuple(length.shape) != (s_q,):
            raise ValueError(f"topk_length must have shape [s_q] = [{s_q}], got {tuple(length.shape)}")
        valid &= torch.arange(topk, device=idx.device) < length.to(idx.device)[:, None, None]
    out = torch.where(valid, idx, -1).permute(1, 0, 2)
    if check and topk > 1 and not torch.compiler.is_compiling():
        ordered = torch.sort(out, dim=-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if bool(repeated.any()):
            g, t = (int(x) for x in repeated.any(-1).nonzero()[0])
            raise ValueError(f"FlashMLA indices list a key twice in row {t} (KV head {g}); FlashMLA counts it twice "
                             f"(it gathers), a Selection once, so the converted call would differ; remove the "
                             f"repeats, or pass check=False to count each key once")
    return Selection(out.contiguous(), 1)


__all__ = ["Selection", "layout_from_selection", "selection_from_flashmla", "selection_from_layout"]
