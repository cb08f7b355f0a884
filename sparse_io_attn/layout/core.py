"""`BlockSparseLayout`: which (query block, key block) tiles of attention are computed.

This is the centre of the API: pattern builders return one, every backend consumes one, and the
traffic model and bound calculator read their counts from one.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE, csr_to_mask, csr_transpose, mask_to_csr, validate_csr

_DRAW_LIMIT = 64  # rows/cols drawn by __str__ before truncating


def _pair(x, what: str) -> tuple[int, int]:
    if isinstance(x, bool) or x is None:
        raise TypeError(f"{what} must be an int or an (int, int) pair, got {x!r}")
    if isinstance(x, int):
        a = b = x
    elif isinstance(x, Sequence) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        a, b = x
    else:
        raise TypeError(f"{what} must be an int or an (int, int) pair, got {x!r}")
    if a <= 0 or b <= 0:
        raise ValueError(f"{what} must be positive, got {(a, b)}")
    return int(a), int(b)


class BlockSparseLayout:
    r"""A block-level CSR description of the attention tiles that are computed.

    The score matrix of one (batch, head) is cut into tiles of ``BLOCK_SIZE_Q x BLOCK_SIZE_KV``
    elements; a tile is *kept* if its (query block, key block) pair is stored. Query positions
    ``[r*BLOCK_SIZE_Q, (r+1)*BLOCK_SIZE_Q)`` attend to key positions of the kept blocks of row ``r``
    only (the last block of each axis may be partial when a length is not a multiple of the block).

    Layout heads: a layout holds ``L = layout_batch * layout_heads`` block masks. ``layout_batch`` is
    1 (shared by the batch) or the batch size; ``layout_heads`` is 1 (shared by all heads) or the
    number of *query* heads. Mask ``l = b * layout_heads + h`` belongs to batch ``b``, head ``h``.

    Storage (see :mod:`sparse_io_attn.layout._csr`): ``crow_indices [L, num_q_blocks + 1]`` (int32, absolute
    offsets into ``col_indices``), ``col_indices [nnz_blocks]`` sorted and unique per row, and the
    transposed copy ``ccol_indices [L, num_kv_blocks + 1]`` / ``row_indices`` that backward iterates,
    built once on first use and cached.

    Rebuilding the dense element mask (what :meth:`to_dense_mask` returns)::

        blocks = torch.zeros(L, num_q_blocks, num_kv_blocks, dtype=torch.bool)
        for l in range(L):
            for r in range(num_q_blocks):
                blocks[l, r, col_indices[crow_indices[l, r]:crow_indices[l, r + 1]]] = True
        mask = blocks.repeat_interleave(BLOCK_SIZE_Q, 1).repeat_interleave(BLOCK_SIZE_KV, 2)
        mask = mask[:, :seqlen_q, :seqlen_k]

    Constructors and conversions (round trips are exact, compare with :meth:`equal`):
    ``from_block_mask``/``to_block_mask``, ``from_dense_mask``/``to_dense_mask``,
    ``from_scipy_bsr``/``to_scipy_bsr``, ``from_torch_bsr``/``to_torch_bsr`` and
    ``from_flex_block_mask``/``to_flex_block_mask`` (FlexAttention ``BlockMask``). The SciPy and
    torch BSR forms cover whole blocks, so pass ``seqlen`` back when lengths are ragged.
    """

    def __init__(self, crow_indices: torch.Tensor, col_indices: torch.Tensor, *,
                 block_size, seqlen, layout_batch: int = 1, layout_heads: int | None = None,
                 name: str = "custom", validate: bool = True,
                 ccol_indices: torch.Tensor | None = None, row_indices: torch.Tensor | None = None):
        self.block_size = _pair(block_size, "block_size")
        self.seqlen = _pair(seqlen, "seqlen")
        bq, bk = self.block_size
        self.num_q_blocks = math.ceil(self.seqlen[0] / bq)
        self.num_kv_blocks = math.ceil(self.seqlen[1] / bk)
        if validate:
            validate_csr(crow_indices, col_indices, self.num_q_blocks, self.num_kv_blocks)
        L = crow_indices.shape[0]
        if layout_heads is None:
            layout_heads = L // layout_batch if layout_batch > 0 else L
        if layout_batch < 1 or layout_heads < 1 or layout_batch * layout_heads != L:
            raise ValueError(f"layout_batch * layout_heads must equal the number of stored masks "
                             f"{L}, got {layout_batch} * {layout_heads}")
        self.layout_batch = int(layout_batch)
        self.layout_heads = int(layout_heads)
        self.crow_indices = crow_indices.to(INDEX_DTYPE)
        self.col_indices = col_indices.to(INDEX_DTYPE)
        self.name = name
        self._csc = None
        if ccol_indices is not None and row_indices is not None:
            self._csc = (ccol_indices.to(INDEX_DTYPE), row_indices.to(INDEX_DTYPE))
        self._device_copies: dict = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_block_mask(cls, block_mask: torch.Tensor, block_size, seqlen=None, *,
                        name: str = "custom") -> "BlockSparseLayout":
        """Build from a boolean block mask ``[nqb, nkb]``, ``[H, nqb, nkb]`` or ``[B, H, nqb, nkb]``.

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
        bq, bk = _pair(block_size, "block_size")
        lb, lh = (block_mask.shape[0], block_mask.shape[1]) if block_mask.dim() == 4 else (
            1, block_mask.shape[0] if block_mask.dim() == 3 else 1)
        nqb, nkb = block_mask.shape[-2:]
        if nqb == 0 or nkb == 0:
            raise ValueError(f"block_mask needs at least one block per axis, got {nqb} x {nkb}")
        if seqlen is None:
            seqlen = (nqb * bq, nkb * bk)
        sq, sk = _pair(seqlen, "seqlen")
        if math.ceil(sq / bq) != nqb or math.ceil(sk / bk) != nkb:
            raise ValueError(f"seqlen {(sq, sk)} with block_size {(bq, bk)} needs a block mask of "
                             f"{math.ceil(sq / bq)} x {math.ceil(sk / bk)} blocks, got {nqb} x {nkb}")
        crow, col = mask_to_csr(block_mask.reshape(lb * lh, nqb, nkb))
        return cls(crow, col, block_size=(bq, bk), seqlen=(sq, sk), layout_batch=lb,
                   layout_heads=lh, name=name, validate=False)

    @classmethod
    def from_dense_mask(cls, mask: torch.Tensor, block_size, *, name: str = "custom") -> "BlockSparseLayout":
        """Build from an element mask ``[Nq, Nk]``, ``[H, Nq, Nk]`` or ``[B, H, Nq, Nk]``: a block is
        kept if any of its elements is ``True``. (Elements of a kept block that were ``False`` are
        *computed*; the layout is block-granular.)"""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a torch.bool tensor, got {got}")
        if mask.dim() not in (2, 3, 4):
            raise ValueError(f"mask must have shape [Nq, Nk], [H, Nq, Nk] or [B, H, Nq, Nk], "
                             f"got {tuple(mask.shape)}")
        bq, bk = _pair(block_size, "block_size")
        sq, sk = mask.shape[-2:]
        lead = mask.shape[:-2]
        nqb, nkb = math.ceil(sq / bq), math.ceil(sk / bk)
        padded = torch.zeros(*lead, nqb * bq, nkb * bk, dtype=torch.bool, device=mask.device)
        padded[..., :sq, :sk] = mask
        blocks = padded.reshape(*lead, nqb, bq, nkb, bk).any(dim=-1).any(dim=-2)
        return cls.from_block_mask(blocks, (bq, bk), (sq, sk), name=name)

    # ------------------------------------------------------------------ SciPy / PyTorch BSR / Flex
    # (implemented in :mod:`sparse_io_attn.layout.convert`)
    @classmethod
    def from_scipy_bsr(cls, bsr, seqlen=None, *, layout_batch: int = 1,
                       name: str = "custom") -> "BlockSparseLayout":
        """See :func:`sparse_io_attn.layout.convert.from_scipy_bsr`."""
        from sparse_io_attn.layout import convert
        return convert.from_scipy_bsr(bsr, seqlen, layout_batch=layout_batch, name=name)

    def to_scipy_bsr(self, dtype=None):
        """See :func:`sparse_io_attn.layout.convert.to_scipy_bsr`."""
        from sparse_io_attn.layout import convert
        return convert.to_scipy_bsr(self, dtype)

    @classmethod
    def from_torch_bsr(cls, t, seqlen=None, *, layout_batch: int = 1,
                       name: str = "custom") -> "BlockSparseLayout":
        """See :func:`sparse_io_attn.layout.convert.from_torch_bsr`."""
        from sparse_io_attn.layout import convert
        return convert.from_torch_bsr(t, seqlen, layout_batch=layout_batch, name=name)

    def to_torch_bsr(self, dtype: torch.dtype = torch.bool, *, as_list: bool = False):
        """See :func:`sparse_io_attn.layout.convert.to_torch_bsr`."""
        from sparse_io_attn.layout import convert
        return convert.to_torch_bsr(self, dtype, as_list=as_list)

    @classmethod
    def from_flex_block_mask(cls, block_mask, *, name: str = "flex") -> "BlockSparseLayout":
        """See :func:`sparse_io_attn.layout.convert.from_flex_block_mask`."""
        from sparse_io_attn.layout import convert
        return convert.from_flex_block_mask(block_mask, name=name)

    def to_flex_block_mask(self, causal: bool = False, *, separate_full_blocks: bool = True):
        """See :func:`sparse_io_attn.layout.convert.to_flex_block_mask`."""
        from sparse_io_attn.layout import convert
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
        """Kept blocks summed over all stored masks."""
        return int(self.col_indices.numel())

    @property
    def density(self) -> float:
        """Kept blocks / all blocks, over all stored masks."""
        return self.nnz_blocks / (self.num_layouts * self.num_q_blocks * self.num_kv_blocks)

    @property
    def ccol_indices(self) -> torch.Tensor:
        return self._transposed()[0]

    @property
    def row_indices(self) -> torch.Tensor:
        return self._transposed()[1]

    def _transposed(self):
        if self._csc is None:
            ccol, row, _ = csr_transpose(self.crow_indices, self.col_indices, self.num_kv_blocks)
            self._csc = (ccol, row)
        return self._csc

    def row_counts(self) -> torch.Tensor:
        """Kept key blocks per query-block row, ``[L, num_q_blocks]`` (int64)."""
        return (self.crow_indices[:, 1:] - self.crow_indices[:, :-1]).to(torch.int64)

    def col_counts(self) -> torch.Tensor:
        """Kept query blocks per key-block column, ``[L, num_kv_blocks]`` (int64)."""
        return (self.ccol_indices[:, 1:] - self.ccol_indices[:, :-1]).to(torch.int64)

    def to_block_mask(self) -> torch.Tensor:
        """``bool [layout_batch, layout_heads, num_q_blocks, num_kv_blocks]``."""
        m = csr_to_mask(self.crow_indices, self.col_indices, self.num_kv_blocks)
        return m.view(self.layout_batch, self.layout_heads, self.num_q_blocks, self.num_kv_blocks)

    def to_dense_mask(self) -> torch.Tensor:
        """``bool [layout_batch, layout_heads, seqlen_q, seqlen_k]`` element mask."""
        bq, bk = self.block_size
        m = self.to_block_mask().repeat_interleave(bq, dim=2).repeat_interleave(bk, dim=3)
        return m[:, :, : self.seqlen_q, : self.seqlen_k]

    def broadcast_strides(self, batch: int, num_heads_q: int) -> tuple[int, int]:
        """``(stride_lb, stride_lh)`` such that mask ``b * stride_lb + h * stride_lh`` serves batch
        ``b``, query head ``h``; raises ``ValueError`` if the layout does not fit ``[batch, heads]``."""
        if self.layout_batch not in (1, batch):
            raise ValueError(f"layout has {self.layout_batch} batch masks but the input has batch "
                             f"{batch}; build it with 1 (shared) or {batch} batch masks")
        if self.layout_heads not in (1, num_heads_q):
            raise ValueError(f"layout has {self.layout_heads} head masks but q has {num_heads_q} heads; "
                             f"build it with 1 (shared) or {num_heads_q} head masks (one per query head)")
        stride_lh = 1 if self.layout_heads > 1 else 0
        stride_lb = self.layout_heads if self.layout_batch > 1 else 0
        return stride_lb, stride_lh

    def expand_dense_mask(self, batch: int, num_heads_q: int) -> torch.Tensor:
        """Element mask broadcast to ``[batch, num_heads_q, seqlen_q, seqlen_k]`` (a view)."""
        self.broadcast_strides(batch, num_heads_q)
        return self.to_dense_mask().expand(batch, num_heads_q, self.seqlen_q, self.seqlen_k)

    # ------------------------------------------------------------------ device / algebra
    def to(self, device) -> "BlockSparseLayout":
        """A copy on ``device`` (cached: asking twice for the same device returns the same object)."""
        device = torch.device(device)
        if device == self.device or (device.type == self.device.type and device.index is None):
            return self
        key = str(device)
        if key not in self._device_copies:
            csc = self._transposed()
            self._device_copies[key] = BlockSparseLayout(
                self.crow_indices.to(device), self.col_indices.to(device), block_size=self.block_size,
                seqlen=self.seqlen, layout_batch=self.layout_batch, layout_heads=self.layout_heads,
                name=self.name, validate=False, ccol_indices=csc[0].to(device), row_indices=csc[1].to(device))
        return self._device_copies[key]

    def _combine(self, other: "BlockSparseLayout", op, symbol: str) -> "BlockSparseLayout":
        if not isinstance(other, BlockSparseLayout):
            raise TypeError(f"expected a BlockSparseLayout, got {type(other).__name__}")
        if self.block_size != other.block_size or self.seqlen != other.seqlen:
            raise ValueError(f"layouts must share block_size and seqlen to combine: "
                             f"{self.block_size}/{self.seqlen} vs {other.block_size}/{other.seqlen}")
        a, b = self.to_block_mask(), other.to_block_mask().to(self.device)
        # (not torch.broadcast_shapes: its first call imports torch._refs, ~2 s)
        if any(x != y and 1 not in (x, y) for x, y in zip(a.shape[:2], b.shape[:2])):
            raise ValueError(f"layout batch/heads do not broadcast: {tuple(a.shape[:2])} vs "
                             f"{tuple(b.shape[:2])}")
        return BlockSparseLayout.from_block_mask(op(a, b), self.block_size, self.seqlen,
                                                 name=f"({self.name} {symbol} {other.name})")

    def union(self, other: "BlockSparseLayout") -> "BlockSparseLayout":
        return self._combine(other, torch.logical_or, "|")

    def intersection(self, other: "BlockSparseLayout") -> "BlockSparseLayout":
        return self._combine(other, torch.logical_and, "&")

    __or__ = union
    __and__ = intersection

    def equal(self, other: "BlockSparseLayout") -> bool:
        """Exact equality of sizes and indices (names are ignored)."""
        return (isinstance(other, BlockSparseLayout) and self.block_size == other.block_size
                and self.seqlen == other.seqlen and self.layout_batch == other.layout_batch
                and self.layout_heads == other.layout_heads
                and torch.equal(self.crow_indices.cpu(), other.crow_indices.cpu())
                and torch.equal(self.col_indices.cpu(), other.col_indices.cpu()))

    # ------------------------------------------------------------------ printing
    def __repr__(self) -> str:
        return (f"BlockSparseLayout(name={self.name!r}, seqlen={self.seqlen}, block_size={self.block_size}, "
                f"blocks={self.num_q_blocks}x{self.num_kv_blocks}, layouts={self.layout_batch}x"
                f"{self.layout_heads}, nnz_blocks={self.nnz_blocks}, density={self.density:.4f})")

    def draw(self, layout_index: int = 0, limit: int = _DRAW_LIMIT) -> str:
        """The pattern of one stored mask drawn with █ (kept) / ░ (skipped), truncated at ``limit``."""
        m = self.to_block_mask().reshape(-1, self.num_q_blocks, self.num_kv_blocks)[layout_index].cpu()
        rows = [
            "".join("█" if v else "░" for v in row[:limit].tolist()) + ("…" if m.shape[1] > limit else "")
            for row in m[:limit]
        ]
        if m.shape[0] > limit:
            rows.append(f"… ({m.shape[0] - limit} more block rows)")
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
    mask = torch.stack([lo.to_block_mask()[0, 0] for lo in layouts])
    return BlockSparseLayout.from_block_mask(mask, first.block_size, first.seqlen,
                                             name=name or f"stack[{first.name}]")
