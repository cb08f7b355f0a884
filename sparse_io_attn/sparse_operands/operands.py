"""Host-side view of the operands of ``softmax(A1 X A2^T * scale) A3 Y``: validation, block sizes,
and one addressing scheme that lets a kernel load a tile of a dense tensor or of a
:class:`BlockSparseMatrix` with the same code.

Addressing (what :class:`Operand` hands the kernels). A *tile* is one block of the operand in its
logical orientation; a tile is named by an int ``t`` taken from ``block_map[row_block, col_block]``
(-1 = structurally zero, never loaded). Element ``(r, c)`` of tile ``t`` lives at::

    data_ptr + (t // nb) * s_a + (t % nb) * s_b + r * s_r + c * s_c

* BSR values ``[nnz_blocks, BR, BC]``: ``t`` = position in ``values``, ``nb = 1``, ``s_a = stride(0)``,
  ``s_b = 0``, ``(s_r, s_c) = (stride(1), stride(2))``.
* Dense ``[rows, cols]`` cut into blocks: ``t = row_block * col_blocks + col_block``,
  ``nb = col_blocks``, ``s_a = BR * stride(0)``, ``s_b = BC * stride(1)``.
* Transposition swaps ``s_r``/``s_c``, the block sizes, the shape, and transposes ``block_map``.

No copy of a dense operand is made; gradients of dense operands are written in place of a dense
tensor, those of block-sparse operands into a ``values``-shaped tensor (masked gradients).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn._attention.checks import resolve_sm_scale
from sparse_io_attn.layout._csr import INDEX_DTYPE
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.batch import LEAD, Batch, first, is_list, leading, matrix_shape

DEFAULT_BLOCK = 64
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Operand:
    """One operand (or output buffer) as the kernels see it. ``data`` is the dense tensor or the BSR
    ``values``; ``shape``/``block`` are logical (after any transpose) and per ``(batch element,
    head)`` group. ``block_map [Bm, Hm, R, C]``: ``Bm``/``Hm`` are 1 where every batch element/head
    shares the pattern (its strides along them are then 0). Group ``(b, h)``'s matrix starts at
    ``data + b * s_gb + h * s_gh``; ``lead`` names the axis the operand's own data varies along
    (``"batch"``, ``"head"`` or None: one matrix), what its gradient is summed back to."""
    name: str
    data: torch.Tensor
    shape: tuple
    block: tuple
    block_map: torch.Tensor  # int32 [Bm, Hm, row_blocks, col_blocks], tile id or -1
    nb: int
    s_a: int
    s_b: int
    s_r: int
    s_c: int
    sparse: bool
    s_gb: int = 0
    s_gh: int = 0
    lead: str | None = None

    @property
    def pattern(self) -> torch.Tensor:
        """``bool [Bm, Hm, R, C]``: stored tiles."""
        return self.block_map >= 0

    @property
    def grid(self) -> tuple:
        """``(row_blocks, col_blocks)``."""
        return tuple(self.block_map.shape[-2:])

    @property
    def element_size(self) -> int:
        return self.data.element_size()

    def map_index(self, b: int, h: int) -> tuple:
        """Index into ``block_map``'s leading axes of group ``(b, h)``."""
        return group_index(self.block_map, b, h)

    def map_of(self, b: int, h: int) -> torch.Tensor:
        """The ``[R, C]`` block map of group ``(b, h)``."""
        return self.block_map[self.map_index(b, h)]

    def matrix_shape(self) -> tuple:
        """Shape of one group's data: ``values``' for a BSR operand, ``[rows, cols]`` for a dense one."""
        return tuple(self.data.shape[-3:] if self.sparse else self.data.shape[-2:])

    def t(self) -> "Operand":
        return replace(self, shape=self.shape[::-1], block=self.block[::-1],
                       block_map=self.block_map.transpose(-1, -2).contiguous(), s_r=self.s_c, s_c=self.s_r)

    def strides(self, prefix: str) -> dict:
        """Kernel keyword arguments ``{prefix}_nb, stride_{prefix}_ta, ...``, the group offsets
        ``stride_{prefix}_gb/_gh`` and the block map's ``stride_{prefix}map_gb/_gh``."""
        m = self.block_map
        return {f"{prefix}_nb": self.nb, f"stride_{prefix}_ta": self.s_a, f"stride_{prefix}_tb": self.s_b,
                f"stride_{prefix}_r": self.s_r, f"stride_{prefix}_c": self.s_c,
                f"stride_{prefix}_gb": self.s_gb, f"stride_{prefix}_gh": self.s_gh,
                f"stride_{prefix}map_gb": m.stride(0) if m.shape[0] > 1 else 0,
                f"stride_{prefix}map_gh": m.stride(1) if m.shape[1] > 1 else 0}


def group_index(t: torch.Tensor, b: int, h: int) -> tuple:
    """Index into the leading ``[Bm, Hm]`` axes of ``t`` (each 1 = shared, or the full size) of group
    ``(b, h)``."""
    return (b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0)


def dense_map(rows: int, cols: int, device) -> torch.Tensor:
    """``int32 [1, 1, rows, cols]``: every tile stored, ids row-major."""
    return torch.arange(rows * cols, dtype=INDEX_DTYPE, device=device).view(1, 1, rows, cols)


def dense_operand(name: str, t: torch.Tensor, block, lead: str | None = None) -> Operand:
    """A dense ``[rows, cols]`` tensor, or ``[L, rows, cols]`` varying along ``lead``."""
    br, bc = block
    R, C = math.ceil(t.shape[-2] / br), math.ceil(t.shape[-1] / bc)
    g = t.stride(0) if t.dim() == 3 else 0
    return Operand(name, t, tuple(t.shape[-2:]), (br, bc), dense_map(R, C, t.device), C,
                   br * t.stride(-2), bc * t.stride(-1), t.stride(-2), t.stride(-1), False,
                   s_gb=g if lead == "batch" else 0, s_gh=g if lead == "head" else 0,
                   lead=lead if t.dim() == 3 else None)


def bsr_operand(name: str, m, values: torch.Tensor | None = None, lead: str | None = None) -> Operand:
    """One :class:`BlockSparseMatrix` (shared by every group), or a list of them, one per batch
    element (``lead="batch"``) or head (``lead="head"``), whose ``values`` are concatenated in
    ``values`` (tile ids of element ``i`` offset by the blocks of the elements before it; the block
    map ``[L, 1, R, C]`` or ``[1, L, R, C]``, the data's group strides 0)."""
    if is_list(m):
        if lead not in ("batch", "head"):
            raise ValueError(f"bsr_operand: a list of matrices needs lead 'batch' or 'head', got {lead!r}")
        v = torch.cat([x.values for x in m]) if values is None else values
        offsets = [0]
        for x in m[:-1]:
            offsets.append(offsets[-1] + x.nnz_blocks)
        ids = [x.block_index_map() for x in m]
        maps = torch.stack([torch.where(i >= 0, i + o, -1) for i, o in zip(ids, offsets)]).to(device=v.device,
                                                                                            dtype=INDEX_DTYPE)
        maps = maps[:, None] if lead == "batch" else maps[None]
        m0 = m[0]
        return Operand(name, v, m0.shape, m0.block_size, maps.contiguous(), 1, v.stride(0), 0, v.stride(1),
                       v.stride(2), True, lead=lead)
    v = m.values if values is None else values
    return Operand(name, v, m.shape, m.block_size, m.block_index_map().to(v.device)[None, None], 1,
                   v.stride(0), 0, v.stride(1), v.stride(2), True)


def like(op: Operand, name: str, data: torch.Tensor, grouped: bool = False) -> Operand:
    """An operand with ``op``'s structure over another buffer (e.g. its gradient): of the same shape,
    or with ``grouped`` of shape ``[B or 1, H or 1, *op.matrix_shape()]`` (one matrix per group; an
    axis of size 1 is shared by the groups along it: group stride 0)."""
    g = {}
    if grouped:
        g = dict(s_gb=data.stride(0) if data.shape[0] > 1 else 0, s_gh=data.stride(1) if data.shape[1] > 1 else 0)
    if op.sparse:
        return replace(op, name=name, data=data, s_a=data.stride(-3), s_r=data.stride(-2), s_c=data.stride(-1), **g)
    br, bc = op.block
    return replace(op, name=name, data=data, s_a=br * data.stride(-2), s_b=bc * data.stride(-1),
                   s_r=data.stride(-2), s_c=data.stride(-1), **g)


def grouped_buffer(op: Operand, batch, zero: bool) -> Operand:
    """A ``[B, H, *op.matrix_shape()]`` buffer with ``op``'s addressing, one matrix per group. The
    groups along a list's own axis write disjoint tiles of its concatenated ``values`` (each
    element's tile ids are offset past the elements before it), so they share one matrix: ``[1, H,
    ...]`` for a per-batch list, ``[B, 1, ...]`` for a per-head one (memory of one ``values`` per
    group of the other axis, not per group)."""
    alloc = torch.zeros if zero else torch.empty
    B = 1 if op.sparse and op.lead == "batch" else batch.B
    H = 1 if op.sparse and op.lead == "head" else batch.H
    data = alloc(B, H, *op.matrix_shape(), dtype=op.data.dtype, device=op.data.device)
    return like(op, op.name, data, grouped=True)


def reduce_groups(op: Operand, grad: torch.Tensor) -> torch.Tensor:
    """A :func:`grouped_buffer` gradient summed back to the shape of ``op.data``: over the heads for
    a batch-varying dense operand, over the batch for a head-varying dense one, over both otherwise
    (block-sparse operands: one ``values`` tensor, whose buffer is 1 along a list's axis)."""
    if op.lead == "batch" and not op.sparse:
        return grad.sum(dim=1)
    if op.lead == "head" and not op.sparse:
        return grad.sum(dim=0)
    return grad.sum(dim=(0, 1))


@dataclass(frozen=True)
class Blocks:
    """Block sizes along each axis: query rows ``m``, key rows ``n``, the X row axis ``d1`` (A1's
    columns), the X column axis ``d2`` (A2's columns), A3's column axis ``d3`` and Y's column axis ``dv``."""
    m: int
    n: int
    d1: int
    d2: int
    d3: int
    dv: int


BACKENDS = ("auto", "torch", "triton")


def _form(f: tuple) -> str:
    shape, block, dtype, device = f
    return f"shape {shape}, block size {block}, {dtype} on {device}"


def _check_one(name: str, t) -> None:
    """Type and rank of one operand (see :mod:`sparse_io_attn.sparse_operands.batch` for the forms)."""
    element = "batch element" if LEAD[name] == "batch" else "head"
    if is_list(t):
        if not t or not all(isinstance(m, BlockSparseMatrix) for m in t):
            raise TypeError(f"{name} as a list must hold one BlockSparseMatrix per {element} (at least one), got "
                            f"{[type(m).__name__ for m in t]}; stack dense matrices into one 3-D tensor instead")
        form = [(tuple(m.shape), tuple(m.block_size), m.dtype, m.device) for m in t]
        odd = next((i for i, f in enumerate(form) if f != form[0]), None)
        if odd is not None:
            raise ValueError(f"the matrices in {name} (one per {element}) must share shape, block size, dtype "
                             f"and device: {name}[0] has {_form(form[0])} but {name}[{odd}] has {_form(form[odd])}; "
                             f"build every {element}'s matrix with the same shape and block_size")
        t = t[0]
    if not isinstance(t, (torch.Tensor, BlockSparseMatrix)):
        raise TypeError(f"{name} must be a torch.Tensor, a BlockSparseMatrix or a list of BlockSparseMatrix "
                        f"(one per {element}), got {type(t).__name__}")
    if isinstance(t, torch.Tensor) and t.dim() not in (2, 3):
        axis = "B (batch)" if LEAD[name] == "batch" else "H (heads)"
        raise ValueError(f"{name} must be 2-D (shared) or 3-D with a leading {axis} axis, got shape "
                         f"{tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def check_batch(A1, A2, A3, X, Y, qk_layout) -> Batch:
    """The batch structure of validated operands (:mod:`sparse_io_attn.sparse_operands.batch`): ``B``
    from A1, A2, A3 (3-D leading axis or list length) and ``layout_batch``, ``H`` from X, Y and
    ``layout_heads``; each must be 1 or agree."""
    def size(axis: str, claims) -> int:
        given = {(who, n) for who, n in claims if n is not None and n != 1}
        sizes = {n for _, n in given}
        if len(sizes) > 1:
            raise ValueError(f"inconsistent {axis} sizes: " + ", ".join(f"{who}={n}" for who, n in sorted(given))
                             + f"; give every operand that varies along the {axis} axis the same leading size "
                             f"or list length (or a 2-D operand to share one matrix)")
        return sizes.pop() if sizes else 1

    lb = qk_layout.layout_batch if qk_layout is not None else None
    lh = qk_layout.layout_heads if qk_layout is not None else None
    B = size("batch", [("A1", leading(A1)), ("A2", leading(A2)), ("A3", leading(A3)), ("qk_layout.layout_batch", lb)])
    H = size("head", [("X", leading(X)), ("Y", leading(Y)), ("qk_layout.layout_heads", lh)])
    batched = any(leading(t) is not None for t in (A1, A2, A3, X, Y)) or (
        qk_layout is not None and qk_layout.num_layouts > 1)
    return Batch(B, H, batched)


def _lead_shape(t) -> str:
    return f"a list of {len(t)}" if is_list(t) else f"of shape {tuple(first(t).shape)}"


def check_scale(scale) -> float:
    """``scale`` as a Python float, under :func:`~sparse_io_attn.block_sparse_attention`'s rules for
    ``sm_scale`` (any finite real scalar: Python int/float, NumPy scalar, 0-d real tensor); ``None``
    is refused (the paper's form has no head dim to default from: it uses 1)."""
    if scale is None:
        raise TypeError("scale must be a finite real number (the paper uses 1.0), got None")
    try:
        return resolve_sm_scale(scale, 1)
    except TypeError:
        raise TypeError(f"scale must be a finite real number (int, float, NumPy scalar, 0-d real tensor), got "
                        f"{type(scale).__name__}" + (f" of shape {tuple(scale.shape)} and dtype {scale.dtype}"
                                                     if isinstance(scale, torch.Tensor) else "")) from None
    except ValueError:
        raise ValueError(f"scale must be a finite number, got {float(scale)} (every output would be NaN); "
                         f"the paper uses 1.0") from None


def check_operands(A1, A2, A3, X, Y, qk_layout, scale, backend):
    """Validate the operands (single-head 2-D form or the batched form of
    :mod:`sparse_io_attn.sparse_operands.batch`); return ``(Blocks, dtype, device)``. Errors name
    expected vs got."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    named = (("A1", A1), ("A2", A2), ("A3", A3), ("X", X), ("Y", Y))
    for name, t in named:
        _check_one(name, t)
    dtypes = {first(t).dtype for _, t in named}
    if len(dtypes) != 1:
        raise TypeError(f"A1, A2, A3, X, Y must share a dtype, got {[str(first(t).dtype) for _, t in named]}")
    devices = {first(t).device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"A1, A2, A3, X, Y must be on one device, got {[str(first(t).device) for _, t in named]}")
    (nq, d1), (nk, d2), (nv, d3) = matrix_shape(A1), matrix_shape(A2), matrix_shape(A3)
    if matrix_shape(X) != (d1, d2):
        raise ValueError(f"X must have shape [A1 columns, A2 columns] = {(d1, d2)} (per head), got "
                         f"{matrix_shape(X)}")
    if nv != nk:
        raise ValueError(f"A3 must have as many rows as A2 (keys): {nk}, got {nv}")
    if matrix_shape(Y)[0] != d3:
        raise ValueError(f"Y must have {d3} rows (A3's columns) per head, got shape {matrix_shape(Y)}")
    check_scale(scale)
    if qk_layout is not None:
        if not isinstance(qk_layout, BlockSparseLayout):
            raise TypeError(f"qk_layout must be a BlockSparseLayout or None, got {type(qk_layout).__name__}")
        if qk_layout.seqlen != (nq, nk):
            raise ValueError(f"qk_layout was built for seqlen {qk_layout.seqlen} but A1/A2 have "
                             f"{(nq, nk)} rows; build it with seqlen=({nq}, {nk})")
    if check_batch(A1, A2, A3, X, Y, qk_layout).H == 0:
        raise ValueError(f"X and Y hold 0 heads (X {_lead_shape(X)}, Y {_lead_shape(Y)}); the attention needs at "
                         f"least one head: give X/Y a leading size of 1 or more (or 2-D matrices)")

    def pick(axis: str, *claims):
        given = {(who, b) for who, b in claims if b is not None}
        sizes = {b for _, b in given}
        if len(sizes) > 1:
            raise ValueError(f"inconsistent block sizes along the {axis} axis: "
                             + ", ".join(f"{who}={b}" for who, b in sorted(given))
                             + "; build the operands with matching block_size")
        return sizes.pop() if sizes else None

    def blk(t, k):
        t = first(t)
        return t.block_size[k] if isinstance(t, BlockSparseMatrix) else None

    qb = qk_layout.block_size if qk_layout is not None else (None, None)
    bm = pick("query (A1 rows)", ("A1", blk(A1, 0)), ("qk_layout", qb[0]))
    bn = pick("key (A2, A3 rows)", ("A2", blk(A2, 0)), ("A3", blk(A3, 0)), ("qk_layout", qb[1]))
    bd1 = pick("A1 column / X row", ("A1", blk(A1, 1)), ("X", blk(X, 0)))
    bd2 = pick("X column / A2 column", ("X", blk(X, 1)), ("A2", blk(A2, 1)))
    bd3 = pick("A3 column / Y row", ("A3", blk(A3, 1)), ("Y", blk(Y, 0)))
    dv = matrix_shape(Y)[1]
    blocks = Blocks(
        m=bm or DEFAULT_BLOCK, n=bn or DEFAULT_BLOCK,
        d1=bd1 or min(DEFAULT_BLOCK, padded_dim(d1)),
        d2=bd2 or min(DEFAULT_BLOCK, padded_dim(d2)),
        d3=bd3 or min(DEFAULT_BLOCK, padded_dim(d3)), dv=blk(Y, 1) or min(DEFAULT_BLOCK, padded_dim(dv)))
    if backend == "triton":
        for name, b in vars(blocks).items():
            if b < 16 or b & (b - 1):
                raise ValueError(f"backend='triton' needs block sizes that are powers of two >= 16 "
                                 f"(tl.dot), got {b} along axis {name!r}; use other block sizes or "
                                 f"backend='torch'")
    return blocks, dtypes.pop(), devices.pop()


def dense_tensor(t) -> torch.Tensor:
    """``t`` as a dense tensor (a :class:`BlockSparseMatrix` expanded, differentiably w.r.t. its ``values``)."""
    return t.to_dense() if isinstance(t, BlockSparseMatrix) else t


def as_operand(name: str, t, block, lead: str | None = None, data: torch.Tensor | None = None) -> Operand:
    """The :class:`Operand` of a dense tensor, a :class:`BlockSparseMatrix` or a list of them;
    ``lead``: the axis a 3-D dense tensor or a list varies along; ``data``: the tensor to address
    instead of ``t``'s own (the one autograd hands in)."""
    if isinstance(t, BlockSparseMatrix) or is_list(t):
        return bsr_operand(name, t, data, lead)
    return dense_operand(name, t if data is None else data, block, lead)
