"""`BlockSparseLayout`: the attention mask, as full blocks and element-masked partial blocks.

This is the centre of the API: pattern builders return one, every backend consumes one, and the
traffic model and bound calculator read their counts from one.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from sparse_io_attn.layout import _assemble, _bits, convert
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout._assemble import inrange_words, lead_dims, validate_partial, words_at
from sparse_io_attn.layout._csr import (INDEX_DTYPE, check_fits_int32, check_index_capacity, csr_row_ids,
                                        csr_to_mask, csr_transpose, mask_to_csr, validate_csr)
from sparse_io_attn.layout._kv_indices import check_selection, csr_from_kv_lists, repeat_matrices

_DRAW_LIMIT = 64  # rows/cols drawn by __str__ before truncating


def _part(build: str, i: int, doc: str | None = None) -> property:
    """A read-only property: element ``i`` of the tuple the layout's method ``build`` returns (one
    cached build read by several properties)."""
    return property(lambda self: getattr(self, build)()[i], doc=doc)


class BlockSparseLayout:
    r"""The layout is the mask: full blocks and element-masked partial blocks.

    The score matrix of one (batch, head) is cut into blocks of ``BLOCK_SIZE_Q x BLOCK_SIZE_KV``
    elements. A *kept* block is stored; it is either **full** (every in-range element is allowed)
    or **partial** (an element mask says which of its elements are allowed). Query ``i`` attends to
    key ``j`` iff the block holding ``(i, j)`` is kept and, if partial, its mask bit is set. Nothing
    outside kept blocks is read. The last block of each axis may extend past ``seqlen``; elements
    past the ends do not exist.

    Layout heads: a layout holds ``L = layout_batch * layout_heads`` masks. ``layout_batch`` is 1
    (shared by the batch) or the batch size; ``layout_heads`` is 1 (shared by all heads) or the
    number of *query* heads. Mask ``l = b * layout_heads + h`` belongs to batch ``b``, head ``h``.

    Storage (see :mod:`sparse_io_attn.layout._csr` and :mod:`sparse_io_attn.layout._bits`):

    * ``crow_indices [L, num_q_blocks + 1]`` (int32, absolute offsets into ``col_indices``) and
      ``col_indices [nnz_blocks]``, sorted and unique per row: the kept blocks.
    * ``partial_ids [nnz_blocks]`` (int32): ``-1`` for a full block, else the index of its element
      mask in ``partial_masks [num_masks, BLOCK_SIZE_Q, ceil(BLOCK_SIZE_KV / 32)]`` (int32, bit
      ``j`` of word ``w`` in row ``r`` = element ``(r, 32 w + j)`` of the block). Masks are
      deduplicated (equal masks are stored once) and canonical: bits past the sequence ends are 0,
      a mask with every in-range bit set is a full block, an empty one is not kept.
    * the transposed copy ``ccol_indices [L, num_kv_blocks + 1]`` / ``row_indices`` (and
      ``csc_partial_ids``), built on first use and cached.
    * **Fixed capacity** (``fixed_capacity=True``; what :meth:`from_kv_indices` and
      :func:`~sparse_io_attn.layout.patterns.topk` build): ``col_slots`` / ``partial_id_slots`` hold
      a number of slots fixed by the shapes (e.g. ``K`` per query-block row), the kept blocks first
      in CSR order and unused slots after ``crow_indices[-1, -1]`` (column 0, partial id -1). The
      kernels' schedule reads the slots with tensor operations only, so a layout chosen on the
      device every step never synchronises with the host. ``col_indices`` / ``partial_ids`` are the
      used slots (reading them takes the count from ``crow_indices``: one synchronisation).

    One cache (:meth:`cached`) holds what is derived from the tensors (the used slots, the transposed
    copy, device copies, index validation, the kernels' :class:`~sparse_io_attn.AttentionPlan`\ s),
    keyed on the tensors' version counters: editing ``crow_indices``, ``col_slots``,
    ``partial_id_slots`` or ``partial_masks`` in place (a reused buffer) rebuilds them on the next
    use. Writes that bypass the version counters (through ``.numpy()``, ``.data``, DLPack, a CUDA
    graph replay) are not seen: call :meth:`mark_edited` after them.

    Rebuilding the dense element mask (what :meth:`to_dense_mask` returns)::

        mask = torch.zeros(L, num_q_blocks * BLOCK_SIZE_Q, num_kv_blocks * BLOCK_SIZE_KV, dtype=torch.bool)
        for l in range(L):
            for r in range(num_q_blocks):
                for e in range(crow_indices[l, r], crow_indices[l, r + 1]):
                    c, p = col_indices[e], partial_ids[e]
                    block = True if p < 0 else _bits.unpack(partial_masks[p], BLOCK_SIZE_KV)
                    mask[l, r*BLOCK_SIZE_Q:(r+1)*BLOCK_SIZE_Q, c*BLOCK_SIZE_KV:(c+1)*BLOCK_SIZE_KV] = block
        mask = mask[:, :seqlen_q, :seqlen_k]

    Constructors and conversions (round trips are exact, compare with :meth:`equal`):
    ``from_block_mask``/``to_block_mask`` (whole blocks), ``from_dense_mask``/``to_dense_mask``
    (element-exact), ``from_scipy_bsr``/``to_scipy_bsr``, ``from_torch_bsr``/``to_torch_bsr`` (block
    values carry the element masks) and ``from_flex_block_mask``/``to_flex_block_mask``
    (FlexAttention ``BlockMask`` with its ``mask_mod``). The SciPy and torch BSR forms cover whole
    blocks, so pass ``seqlen`` back when lengths are ragged.
    """

    def __init__(self, crow_indices: torch.Tensor, col_indices: torch.Tensor, *,
                 block_size, seqlen, layout_batch: int = 1, layout_heads: int | None = None,
                 name: str = "custom", validate: bool = True,
                 partial_ids: torch.Tensor | None = None, partial_masks: torch.Tensor | None = None,
                 fixed_capacity: bool = False):
        self.block_size = as_pair(block_size, "block_size")
        self.seqlen = as_pair(seqlen, "seqlen")
        bq, bk = self.block_size
        self.num_q_blocks = math.ceil(self.seqlen[0] / bq)
        self.num_kv_blocks = math.ceil(self.seqlen[1] / bk)
        if validate and not fixed_capacity:      # a fixed-capacity layout is checked once built (below)
            validate_csr(crow_indices, col_indices, self.num_q_blocks, self.num_kv_blocks)
        check_index_capacity(col_indices.numel())
        for what, t in (("crow_indices", crow_indices), ("col_indices", col_indices),
                        ("partial_ids", partial_ids), ("partial_masks", partial_masks)):
            if isinstance(t, torch.Tensor):
                check_fits_int32(t, what)
        L = crow_indices.shape[0]
        if layout_heads is None:
            layout_heads = L // layout_batch if layout_batch > 0 else L
        if layout_batch < 1 or layout_heads < 1 or layout_batch * layout_heads != L:
            raise ValueError(f"layout_batch * layout_heads must equal the number of stored masks "
                             f"{L}, got {layout_batch} * {layout_heads}")
        self.layout_batch = int(layout_batch)
        self.layout_heads = int(layout_heads)
        self.crow_indices = crow_indices.to(INDEX_DTYPE)
        self.col_slots = col_indices.to(INDEX_DTYPE)
        self.fixed_capacity = bool(fixed_capacity)
        dev = self.crow_indices.device
        if (partial_ids is None) != (partial_masks is None):
            raise ValueError("pass partial_ids and partial_masks together (or neither: all blocks full)")
        if partial_ids is None:
            partial_ids = torch.full((self.col_slots.numel(),), -1, dtype=INDEX_DTYPE, device=dev)
            partial_masks = torch.zeros(0, bq, _bits.num_words(bk), dtype=torch.int32, device=dev)
        elif validate and not fixed_capacity:
            validate_partial(partial_ids, partial_masks, self.col_slots.numel(), (bq, bk))
        self.partial_id_slots = partial_ids.to(INDEX_DTYPE)
        self.partial_masks = partial_masks.to(torch.int32)
        self.name = name
        self._edits = 0                  # mark_edited() calls: part of the version key
        self._cache: dict = {}           # key -> (version key, value): the layout's one cache
        if validate:
            if fixed_capacity:
                self.check()
            else:
                self._mark_checked()

    def version_key(self) -> tuple | None:
        """The version counters of the tensors everything cached is derived from: any in-place edit
        of ``crow_indices``, ``col_slots``, ``partial_id_slots`` or ``partial_masks`` changes it, and
        so does :meth:`mark_edited`. ``None`` while ``torch.compile`` traces (the tensors are then
        fake; nothing is cached)."""
        if torch.compiler.is_compiling():
            return None
        return (self.crow_indices._version, self.col_slots._version, self.partial_id_slots._version,
                self.partial_masks._version, self._edits)

    def cached(self, key, build):
        """The layout's one cache: ``build()``, kept under ``key`` until a tensor is edited in place
        (its :meth:`version_key` changes). While ``torch.compile`` traces, an entry built before is
        used as it is (build plans eagerly, outside the trace) and nothing new is stored."""
        version = self.version_key()
        hit = self._cache.get(key)
        if hit is not None and (version is None or hit[0] == version):
            return hit[1]
        value = build()
        if version is not None:
            self._cache[key] = (version, value)
        return value

    def __getstate__(self) -> dict:
        """Pickle the tensors and sizes; what the cache derived from them is rebuilt on use."""
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def mark_edited(self) -> "BlockSparseLayout":
        """Declare that the tensors were written through a path that bypasses PyTorch's version
        counters (``.numpy()``, ``.data``, DLPack, a CUDA graph replay): everything derived from them
        (validation, transposed copy, device copies, plans) is rebuilt on the next use, and the
        indices are validated again unless the layout was built by the library."""
        self._edits += 1
        return self

    col_indices = _part("_used_slots", 0, "Column (key-block) index of every kept block, ``int32 [nnz_blocks]``, "
                                          "sorted inside each row.")
    partial_ids = _part("_used_slots", 1, "``-1`` (full block) or the element-mask id of every kept block, "
                                          "``int32 [nnz_blocks]``.")

    def _used_slots(self):
        """``(col_indices, partial_ids)``: the used slots (cached for a fixed-capacity layout)."""
        if not self.fixed_capacity:
            return self.col_slots, self.partial_id_slots

        def used():
            nnz = int(self.crow_indices[-1, -1])            # the one read of data: a sync on CUDA
            return self.col_slots[:nnz], self.partial_id_slots[:nnz]
        return self.cached("used_slots", used)

    @property
    def checked(self) -> bool:
        """Whether the index ranges are known valid for the tensors as they are now (validated, or
        valid by construction)."""
        version = self.version_key()
        hit = self._cache.get("checked")
        return version is None or (hit is not None and hit[0] == version)

    def check(self) -> "BlockSparseLayout":
        """Validate the index ranges (cached until a tensor is edited in place): every column and
        partial id inside its tensors. Layouts built with ``validate=False`` from outside data (e.g.
        inside the custom op) are checked here before any kernel reads them; raises ``ValueError``
        naming the bad entries. Layouts the library builds are valid by construction and skip it."""
        if torch.compiler.is_compiling() or self.checked:
            return self   # traced code: the custom op checks the real tensors it receives
        validate_csr(self.crow_indices, self.col_indices, self.num_q_blocks, self.num_kv_blocks)
        validate_partial(self.partial_ids, self.partial_masks, self.col_indices.numel(), self.block_size)
        return self._mark_checked()

    def _mark_checked(self) -> "BlockSparseLayout":
        """Record that the tensors, as they are now, are valid by construction."""
        self._cache["checked"] = (self.version_key(), True)
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_block_mask(cls, block_mask: torch.Tensor, block_size, seqlen=None, *,
                        name: str = "custom") -> "BlockSparseLayout":
        """Build from a boolean block mask ``[nqb, nkb]``, ``[H, nqb, nkb]`` or ``[B, H, nqb, nkb]``:
        every kept block is full.

        ``block_size`` is an int or ``(q, kv)`` pair; ``seqlen`` an int or ``(seqlen_q, seqlen_kv)``
        pair, defaulting to the full block extent ``(nqb * q, nkb * kv)``.
        """
        if not isinstance(block_mask, torch.Tensor):
            raise TypeError(f"block_mask must be a torch.Tensor, got {type(block_mask).__name__}")
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask must have dtype torch.bool, got {block_mask.dtype}; "
                            f"use mask.bool() or mask != 0")
        if block_mask.dim() not in (2, 3, 4):
            raise ValueError(f"block_mask must have shape [nqb, nkb], [H, nqb, nkb] or "
                             f"[B, H, nqb, nkb], got {tuple(block_mask.shape)}")
        bq, bk = as_pair(block_size, "block_size")
        lb, lh = lead_dims(block_mask.shape[:-2])
        nqb, nkb = block_mask.shape[-2:]
        if nqb == 0 or nkb == 0:
            raise ValueError(f"block_mask needs at least one block per axis, got {nqb} x {nkb}")
        if seqlen is None:
            seqlen = (nqb * bq, nkb * bk)
        sq, sk = as_pair(seqlen, "seqlen")
        if math.ceil(sq / bq) != nqb or math.ceil(sk / bk) != nkb:
            raise ValueError(f"seqlen {(sq, sk)} with block_size {(bq, bk)} needs a block mask of "
                             f"{math.ceil(sq / bq)} x {math.ceil(sk / bk)} blocks, got {nqb} x {nkb}")
        crow, col = mask_to_csr(block_mask.reshape(lb * lh, nqb, nkb))
        return cls(crow, col, block_size=(bq, bk), seqlen=(sq, sk), layout_batch=lb,
                   layout_heads=lh, name=name, validate=False)

    @classmethod
    def from_kv_indices(cls, kv_indices: torch.Tensor, block_size, seqlen, *, kv_counts: torch.Tensor | None = None,
                        check: bool = True, name: str = "kv_indices") -> "BlockSparseLayout":
        """Build from per-row lists of key blocks: what a data-dependent selection produces.

        ``kv_indices`` (int32 or int64) ``[Mq, K]``, ``[H, Mq, K]`` or ``[B, H, Mq, K]`` lists up to
        ``K`` key blocks for each of the ``Mq = ceil(seqlen_q / BLOCK_SIZE_Q)`` query-block rows, in
        any order, possibly repeated; entries ``< 0`` are empty slots. With ``kv_counts`` (int, shape
        ``kv_indices.shape[:-1]``) only the first ``kv_counts[..., r]`` entries of row ``r`` count
        (the convention of FlexAttention's ``BlockMask.from_kv_blocks``). Every listed block is full;
        causality comes from the attention call's ``causal=`` (which makes the diagonal block partial).
        ``H`` may be the number of query heads or of KV heads (one selection per GQA group).

        The layout is built on ``kv_indices``' device with tensor operations only, with fixed
        capacity (``K`` slots per row, see the class docstring), and is valid by construction: the
        attention call does not re-check it. ``check=True`` raises ``ValueError`` for entries
        ``>= ceil(seqlen_k / BLOCK_SIZE_KV)`` and ``kv_counts`` outside ``[0, K]``, which reads the
        values (one synchronisation on CUDA); ``check=False``, and code traced by ``torch.compile``,
        skip that: such entries then count as empty slots and are never read.
        """
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype not in (torch.int32, torch.int64):
            got = kv_indices.dtype if isinstance(kv_indices, torch.Tensor) else type(kv_indices).__name__
            raise TypeError(f"kv_indices must be an int32 or int64 tensor of key-block indices, got {got}")
        if kv_indices.dim() not in (2, 3, 4):
            raise ValueError(f"kv_indices must have shape [Mq, K], [H, Mq, K] or [B, H, Mq, K], got "
                             f"{tuple(kv_indices.shape)}")
        check_selection(kv_indices, "kv_indices")
        (bq, bk), (sq, sk) = as_pair(block_size, "block_size"), as_pair(seqlen, "seqlen")
        nqb, nkb = math.ceil(sq / bq), math.ceil(sk / bk)
        lb, lh = lead_dims(kv_indices.shape[:-2])
        if kv_indices.shape[-2] != nqb:
            raise ValueError(f"kv_indices has {kv_indices.shape[-2]} query-block rows but seqlen_q {sq} with "
                             f"BLOCK_SIZE_Q {bq} has {nqb}; pass one row per query block")
        if kv_counts is not None:
            if not isinstance(kv_counts, torch.Tensor) or kv_counts.dtype not in (torch.int32, torch.int64):
                got = kv_counts.dtype if isinstance(kv_counts, torch.Tensor) else type(kv_counts).__name__
                raise TypeError(f"kv_counts must be an int32 or int64 tensor, got {got}")
            if kv_counts.shape != kv_indices.shape[:-1]:
                raise ValueError(f"kv_counts must have shape {tuple(kv_indices.shape[:-1])} (kv_indices' shape "
                                 f"without the last dim), got {tuple(kv_counts.shape)}")
            if kv_counts.device != kv_indices.device:
                raise ValueError(f"kv_counts is on {kv_counts.device} but kv_indices on {kv_indices.device}")
        if check and not torch.compiler.is_compiling() and kv_indices.numel():
            top = int(kv_indices.max())
            if top >= nkb:
                raise ValueError(f"kv_indices holds key block {top} but seqlen_k {sk} with BLOCK_SIZE_KV {bk} "
                                 f"has {nkb} key blocks (indices 0..{nkb - 1}; negative entries are empty slots)")
            if kv_counts is not None and kv_counts.numel():
                lo, hi = int(kv_counts.min()), int(kv_counts.max())
                if lo < 0 or hi > kv_indices.shape[-1]:
                    raise ValueError(f"kv_counts must lie in [0, {kv_indices.shape[-1]}] (K, the slots per row), "
                                     f"got values in [{lo}, {hi}]")
        K = kv_indices.shape[-1]
        counts = None if kv_counts is None else kv_counts.reshape(lb * lh * nqb)
        crow, col = csr_from_kv_lists(kv_indices.reshape(lb * lh * nqb, K), nkb, lb * lh, counts)
        layout = cls(crow, col, block_size=(bq, bk), seqlen=(sq, sk), layout_batch=lb, layout_heads=lh,
                     name=name, validate=False, fixed_capacity=True)
        return layout._mark_checked()

    @classmethod
    def from_dense_mask(cls, mask: torch.Tensor, block_size, *, exact: bool = True,
                        name: str = "custom") -> "BlockSparseLayout":
        """Build from an element mask ``[Nq, Nk]``, ``[H, Nq, Nk]`` or ``[B, H, Nq, Nk]``.

        ``exact=True`` (default): the layout computes exactly this mask; blocks with every element
        allowed are full, blocks with some are partial. ``exact=False``: the block-level
        approximation, where a block is kept (full) if any of its elements is allowed, so elements
        the mask removes inside a kept block *are* attended.
        """
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a torch.bool tensor, got {got}")
        if mask.dim() not in (2, 3, 4):
            raise ValueError(f"mask must have shape [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk], "
                             f"got {tuple(mask.shape)}")
        bq, bk = as_pair(block_size, "block_size")
        sq, sk = mask.shape[-2:]
        if sq == 0 or sk == 0:
            raise ValueError(f"mask needs at least one query and one key, got shape {tuple(mask.shape)}")
        lb, lh = lead_dims(mask.shape[:-2])
        nqb, nkb = math.ceil(sq / bq), math.ceil(sk / bk)
        padded = torch.zeros(lb * lh, nqb * bq, nkb * bk, dtype=torch.bool, device=mask.device)
        padded[:, :sq, :sk] = mask.reshape(lb * lh, sq, sk)
        blocks = padded.view(lb * lh, nqb, bq, nkb, bk)
        kept = blocks.any(dim=4).any(dim=2)  # [L, R, C]
        if not exact:
            return cls.from_block_mask(kept.view(lb, lh, nqb, nkb), (bq, bk), (sq, sk), name=name)
        lid, r, c = kept.nonzero(as_tuple=True)
        elems = blocks[lid, r, :, c, :]  # [E, bq, bk]
        return assemble(lid, r, c, _bits.pack(elems), block_size=(bq, bk), seqlen=(sq, sk),
                        layout_batch=lb, layout_heads=lh, name=name)

    # ------------------------------------------------------------------ SciPy / PyTorch BSR / Flex
    # (the format readers and writers live in :mod:`sparse_io_attn.layout.convert`)
    @classmethod
    def from_scipy_bsr(cls, bsr, seqlen=None, *, layout_batch: int = 1, exact: bool = True,
                       name: str = "custom") -> "BlockSparseLayout":
        """Build from a ``scipy.sparse`` BSR matrix/array, or a list of them (one per head); arguments
        and semantics in :func:`sparse_io_attn.layout.convert.blocks_from_scipy_bsr`."""
        blocks = convert.blocks_from_scipy_bsr(bsr, seqlen, layout_batch=layout_batch, exact=exact)
        return assemble(**blocks._asdict(), name=name)

    def to_scipy_bsr(self, dtype=None):
        """See :func:`sparse_io_attn.layout.convert.to_scipy_bsr`."""
        return convert.to_scipy_bsr(self, dtype)

    @classmethod
    def from_torch_bsr(cls, t, seqlen=None, *, layout_batch: int = 1, exact: bool = True,
                       name: str = "custom") -> "BlockSparseLayout":
        """Build from a ``torch.sparse_bsr`` tensor (or a list of 2-D ones); arguments and semantics in
        :func:`sparse_io_attn.layout.convert.blocks_from_torch_bsr`."""
        blocks = convert.blocks_from_torch_bsr(t, seqlen, layout_batch=layout_batch, exact=exact)
        return assemble(**blocks._asdict(), name=name)

    def to_torch_bsr(self, dtype: torch.dtype = torch.bool, *, as_list: bool = False):
        """See :func:`sparse_io_attn.layout.convert.to_torch_bsr`."""
        return convert.to_torch_bsr(self, dtype, as_list=as_list)

    @classmethod
    def from_flex_block_mask(cls, block_mask, *, name: str = "flex") -> "BlockSparseLayout":
        """Build from a FlexAttention ``BlockMask``, element-exact; see
        :func:`sparse_io_attn.layout.convert.blocks_from_flex_block_mask`."""
        return assemble(**convert.blocks_from_flex_block_mask(block_mask)._asdict(), name=name)

    def to_flex_block_mask(self, causal=False, *, separate_full_blocks: bool = True):
        """See :func:`sparse_io_attn.layout.convert.to_flex_block_mask`."""
        return convert.to_flex_block_mask(self, causal, separate_full_blocks=separate_full_blocks)

    # ------------------------------------------------------------------ views
    @property
    def seqlen_q(self) -> int:
        return self.seqlen[0]

    @property
    def seqlen_k(self) -> int:
        return self.seqlen[1]

    @property
    def BLOCK_SIZE_Q(self) -> int:  # noqa: N802 (the name the kernels use)
        return self.block_size[0]

    @property
    def BLOCK_SIZE_KV(self) -> int:  # noqa: N802
        return self.block_size[1]

    @property
    def num_layouts(self) -> int:
        return self.layout_batch * self.layout_heads

    @property
    def device(self) -> torch.device:
        return self.crow_indices.device

    @property
    def nnz_blocks(self) -> int:
        """Kept blocks (full and partial) summed over all stored masks."""
        return int(self.col_indices.numel())

    @property
    def num_partial_blocks(self) -> int:
        """Kept blocks with an element mask (not every in-range element allowed)."""
        return int((self.partial_ids >= 0).sum())

    @property
    def density(self) -> float:
        """Kept blocks / all blocks, over all stored masks."""
        return self.nnz_blocks / (self.num_layouts * self.num_q_blocks * self.num_kv_blocks)

    ccol_indices = _part("_transposed", 0, "Column pointers of the transposed copy (CSC), "
                                           "``int32 [L, num_kv_blocks + 1]``.")
    row_indices = _part("_transposed", 1, "Row (query-block) index of every slot in CSC order, ``int32`` "
                                          "(a fixed-capacity layout's unused slots last).")
    csc_partial_ids = _part("_transposed", 2, "``partial_ids`` in the order of the transposed copy (``row_indices``).")

    def _transposed(self):
        """``(ccol_indices, row_indices, csc_partial_ids)`` (cached). For a fixed-capacity layout the
        last two keep its number of slots (unused ones last)."""
        def build():
            ccol, row, perm = csr_transpose(self.crow_indices, self.col_slots, self.num_kv_blocks)
            return ccol, row, self.partial_id_slots[perm].contiguous()
        return self.cached("transposed", build)

    def row_counts(self) -> torch.Tensor:
        """Kept key blocks per query-block row, ``[L, num_q_blocks]`` (int64)."""
        return (self.crow_indices[:, 1:] - self.crow_indices[:, :-1]).to(torch.int64)

    def col_counts(self) -> torch.Tensor:
        """Kept query blocks per key-block column, ``[L, num_kv_blocks]`` (int64)."""
        return (self.ccol_indices[:, 1:] - self.ccol_indices[:, :-1]).to(torch.int64)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lid, row, col)`` (int64 ``[nnz_blocks]``) of every kept block, in CSR order."""
        flat = csr_row_ids(self.crow_indices)
        return flat // self.num_q_blocks, flat % self.num_q_blocks, self.col_indices.to(torch.int64)

    def to_block_mask(self) -> torch.Tensor:
        """Kept blocks (full or partial), ``bool [layout_batch, layout_heads, num_q_blocks, num_kv_blocks]``."""
        m = csr_to_mask(self.crow_indices, self.col_indices, self.num_kv_blocks)
        return m.view(self.layout_batch, self.layout_heads, self.num_q_blocks, self.num_kv_blocks)

    def block_table(self) -> torch.Tensor:
        """``int32 [layout_batch, layout_heads, num_q_blocks, num_kv_blocks]``: ``-2`` not kept, ``-1``
        full, ``p >= 0`` partial with element mask ``partial_masks[p]``."""
        L, R, C = self.num_layouts, self.num_q_blocks, self.num_kv_blocks
        table = torch.full((L * R, C), -2, dtype=torch.int32, device=self.device)
        if self.nnz_blocks:
            table[csr_row_ids(self.crow_indices), self.col_indices.to(torch.int64)] = self.partial_ids
        return table.view(self.layout_batch, self.layout_heads, R, C)

    def entry_words(self) -> torch.Tensor:
        """The bit-packed element mask of every kept block, ``int32 [nnz_blocks, BLOCK_SIZE_Q, W]``
        (full blocks: every in-range bit set)."""
        _, r, c = self.entries()
        words = inrange_words(r, c, self.block_size, self.seqlen)
        part = self.partial_ids >= 0
        words[part] = self.partial_masks[self.partial_ids[part].to(torch.int64)]
        return words

    def to_dense_mask(self) -> torch.Tensor:
        """``bool [layout_batch, layout_heads, seqlen_q, seqlen_k]``: the elements attention uses."""
        bq, bk = self.block_size
        L, R, C = self.num_layouts, self.num_q_blocks, self.num_kv_blocks
        m = torch.zeros(L, R, bq, C, bk, dtype=torch.bool, device=self.device)
        lid, r, c = self.entries()
        m[lid, r, :, c, :] = _bits.unpack(self.entry_words(), bk)
        m = m.view(self.layout_batch, self.layout_heads, R * bq, C * bk)
        return m[:, :, : self.seqlen_q, : self.seqlen_k]

    def rows(self, start: int, stop: int) -> "BlockSparseLayout":
        """The layout of query positions ``[start, stop)`` against every key: element-exact, the
        same block size, ``seqlen = (stop - start, seqlen_k)`` (query ``i`` of the result is query
        ``start + i`` here). What decoding with a KV cache and chunked prefill need: the rows of
        the current query positions (:func:`sparse_io_attn.layout.convert.row_blocks`)."""
        return assemble(**convert.row_blocks(self, start, stop)._asdict(), name=f"{self.name}[{start}:{stop}]")

    def _check_broadcast(self, batch: int, num_heads_q: int) -> None:
        if self.layout_batch not in (1, batch):
            raise ValueError(f"layout has {self.layout_batch} batch masks but the input has batch "
                             f"{batch}; build it with 1 (shared) or {batch} batch masks")
        if self.layout_heads not in (1, num_heads_q):
            raise ValueError(f"layout has {self.layout_heads} head masks but q has {num_heads_q} heads; "
                             f"build it with 1 (shared) or {num_heads_q} head masks (one per query head)")

    def for_query_heads(self, num_heads_q: int, num_heads_kv: int) -> "BlockSparseLayout":
        """The layout serving ``num_heads_q`` query heads: ``self`` when it holds 1 or ``num_heads_q``
        head masks; when it holds one mask per KV head (``layout_heads == num_heads_kv``, a selection
        shared by the query heads of each GQA group), a new layout with its masks repeated for the
        query heads of each group (indices only, on the layout's device, no host synchronisation;
        the attention plan keeps it). Raises ``ValueError`` for any other head count."""
        lh = self.layout_heads
        if lh in (1, num_heads_q):
            return self
        if num_heads_kv < 1 or num_heads_q % num_heads_kv or lh != num_heads_kv:
            raise ValueError(f"layout has {lh} head masks but q has {num_heads_q} heads and k/v {num_heads_kv}; "
                             f"build it with 1 (shared), {num_heads_q} (one per query head) or "
                             f"{num_heads_kv} (one per KV head) head masks")
        crow, (col, pid) = repeat_matrices(self.crow_indices, [self.col_slots, self.partial_id_slots],
                                           num_heads_q // num_heads_kv, fill=[0, -1])
        out = BlockSparseLayout(crow, col, block_size=self.block_size, seqlen=self.seqlen,
                                layout_batch=self.layout_batch, layout_heads=num_heads_q, name=self.name,
                                validate=False, partial_ids=pid, partial_masks=self.partial_masks,
                                fixed_capacity=self.fixed_capacity)
        return out._mark_checked() if self.checked else out

    def expand_dense_mask(self, batch: int, num_heads_q: int) -> torch.Tensor:
        """Element mask broadcast to ``[batch, num_heads_q, seqlen_q, seqlen_k]`` (a view)."""
        self._check_broadcast(batch, num_heads_q)
        return self.to_dense_mask().expand(batch, num_heads_q, self.seqlen_q, self.seqlen_k)

    # ------------------------------------------------------------------ device / algebra
    def to(self, device) -> "BlockSparseLayout":
        """A copy on ``device`` (cached: asking twice for the same device returns the same object)."""
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("a layout holds index data the kernels read; it cannot live on the 'meta' "
                             "device. Keep it on CPU or CUDA (torch.compile traces through the real layout)")
        if device == self.device or (device.type == self.device.type and device.index is None):
            return self

        def build():
            copy = BlockSparseLayout(
                self.crow_indices.to(device), self.col_slots.to(device), block_size=self.block_size,
                seqlen=self.seqlen, layout_batch=self.layout_batch, layout_heads=self.layout_heads,
                name=self.name, validate=False, partial_ids=self.partial_id_slots.to(device),
                partial_masks=self.partial_masks.to(device), fixed_capacity=self.fixed_capacity)
            return copy._mark_checked() if self.checked else copy
        return self.cached(("device", str(device)), build)

    def _combine(self, other: "BlockSparseLayout", union: bool, symbol: str) -> "BlockSparseLayout":
        """Element-level union / intersection; masks broadcast over batch and heads."""
        if not isinstance(other, BlockSparseLayout):
            raise TypeError(f"expected a BlockSparseLayout, got {type(other).__name__}")
        return assemble(**convert.combined_blocks(self, other, union)._asdict(),
                        name=f"({self.name} {symbol} {other.name})")

    def union(self, other: "BlockSparseLayout") -> "BlockSparseLayout":
        """Elements allowed by either layout."""
        return self._combine(other, True, "|")

    def intersection(self, other: "BlockSparseLayout") -> "BlockSparseLayout":
        """Elements allowed by both layouts."""
        return self._combine(other, False, "&")

    __or__ = union
    __and__ = intersection

    def equal(self, other: "BlockSparseLayout") -> bool:
        """Exact equality of sizes, kept blocks and element masks (names are ignored)."""
        if not (isinstance(other, BlockSparseLayout) and self.block_size == other.block_size
                and self.seqlen == other.seqlen and self.layout_batch == other.layout_batch
                and self.layout_heads == other.layout_heads
                and torch.equal(self.crow_indices.cpu(), other.crow_indices.cpu())
                and torch.equal(self.col_indices.cpu(), other.col_indices.cpu())):
            return False
        return torch.equal(self.entry_words().cpu(), other.entry_words().cpu())

    # ------------------------------------------------------------------ printing
    def __repr__(self) -> str:
        return (f"BlockSparseLayout(name={self.name!r}, seqlen={self.seqlen}, block_size={self.block_size}, "
                f"blocks={self.num_q_blocks}x{self.num_kv_blocks}, layouts={self.layout_batch}x"
                f"{self.layout_heads}, nnz_blocks={self.nnz_blocks} ({self.num_partial_blocks} partial), "
                f"density={self.density:.4f})")

    def draw(self, layout_index: int = 0, limit: int = _DRAW_LIMIT) -> str:
        """One stored mask drawn with █ (full block), ▒ (partial block) and ░ (not kept), truncated
        at ``limit`` rows/columns."""
        R, C = min(self.num_q_blocks, limit), min(self.num_kv_blocks, limit)
        lo = self.to("cpu")
        lid, r, c = lo.entries()
        sel = (lid == layout_index) & (r < R) & (c < C)           # only what is drawn: O(limit^2)
        t = torch.full((R, C), -2, dtype=torch.int32)
        t[r[sel], c[sel]] = lo.partial_ids[sel]
        glyph = {-2: "░", -1: "█"}
        rows = ["".join(glyph.get(v, "▒") for v in row.tolist()) + ("…" if self.num_kv_blocks > limit else "")
                for row in t]
        if self.num_q_blocks > limit:
            rows.append(f"… ({self.num_q_blocks - limit} more block rows)")
        return "\n".join(rows)

    def __str__(self) -> str:
        head = repr(self)
        if self.num_layouts > 1:
            head += f"\n(layout 0 of {self.num_layouts} shown)"
        return head + "\n" + self.draw()


def stack_layouts(layouts: Iterable[BlockSparseLayout], *, name: str | None = None) -> BlockSparseLayout:
    """Stack single-mask layouts of equal sizes into one per-head layout (``layout_heads = len``)."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("stack_layouts needs at least one layout")
    first = layouts[0]
    for lo in layouts:
        if lo.block_size != first.block_size or lo.seqlen != first.seqlen or lo.num_layouts != 1:
            raise ValueError("stack_layouts needs single-mask layouts sharing block_size and seqlen")
    parts = [lo.to(first.device) for lo in layouts]
    lid = torch.cat([torch.full((lo.nnz_blocks,), i, dtype=torch.int64, device=first.device)
                     for i, lo in enumerate(parts)])
    r = torch.cat([lo.entries()[1] for lo in parts])
    c = torch.cat([lo.entries()[2] for lo in parts])
    return assemble(lid, r, c, torch.cat([lo.entry_words() for lo in parts]), block_size=first.block_size,
                    seqlen=first.seqlen, layout_batch=1, layout_heads=len(parts),
                    name=name or f"stack[{first.name}]")


# ---------------------------------------------------------------------------------------- assembly
def assemble(lid: torch.Tensor, r: torch.Tensor, c: torch.Tensor, words: torch.Tensor | None = None, *,
             partial: torch.Tensor | None = None, block_size, seqlen, layout_batch: int,
             layout_heads: int, name: str) -> BlockSparseLayout:
    """The one constructor of element-exact layouts: unique candidate blocks ``(lid, r, c)`` (int64,
    any order) with their element masks -> a canonical :class:`BlockSparseLayout` (the rules in
    :func:`sparse_io_attn.layout._assemble.canonical`)."""
    lid, r, c, ids, masks = _assemble.canonical(lid, r, c, words, partial=partial, block_size=block_size,
                                                seqlen=seqlen)
    return assemble_ids(lid, r, c, ids, masks, block_size=block_size, seqlen=seqlen, layout_batch=layout_batch,
                        layout_heads=layout_heads, name=name)


def assemble_ids(lid, r, c, ids, masks, *, block_size, seqlen, layout_batch: int, layout_heads: int,
                 name: str) -> BlockSparseLayout:
    """Unique kept blocks ``(lid, r, c)`` with their ``partial_ids`` (-1 full) into deduplicated,
    canonical ``masks`` -> the layout (entries sorted into CSR order)."""
    crow, col, pids = _assemble.csr(lid, r, c, ids, block_size=block_size, seqlen=seqlen,
                                    num_layouts=layout_batch * layout_heads)
    return BlockSparseLayout(crow, col, block_size=block_size, seqlen=seqlen, layout_batch=layout_batch,
                             layout_heads=layout_heads, name=name, validate=False, partial_ids=pids,
                             partial_masks=masks)._mark_checked()
