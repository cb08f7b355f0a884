"""Conversions between :class:`~sparse_io_attn.BlockSparseLayout` and the block-sparse formats of
SciPy (BSR), PyTorch (``torch.sparse_bsr``) and FlexAttention (``BlockMask``).

This module sits below the layout class: the ``blocks_from_*`` readers turn a foreign object into
:class:`Blocks` (the candidate blocks and their element masks, the arguments of
:func:`~sparse_io_attn.layout.core.assemble`), and the ``to_*`` writers read a layout's public
fields. The layout's ``from_*``/``to_*`` methods are the public entry points. Every conversion
carries the element masks of partial blocks: BSR block *values* are the element mask (nonzero =
allowed), a ``BlockMask``'s ``mask_mod`` is evaluated on its partial blocks (and
``to_flex_block_mask`` writes one that reads ours), so round trips are exact.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from sparse_io_attn.layout import _bits, _flex
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout._assemble import words_at
from sparse_io_attn.layout._csr import csr_row_ids, from_relative_offsets, to_relative_offsets, validate_csr
from sparse_io_attn.layout.causal import causal_blocks, causal_offset, mask_offsets

_EVAL_CHUNK = 1 << 22  # mask_mod evaluations per vmap call


class Blocks(NamedTuple):
    """Unique candidate blocks ``(lid, r, c)`` (int64) with the element masks ``words`` of those
    where ``partial`` is True (all when ``partial`` is None; no words: all full): the arguments of
    :func:`~sparse_io_attn.layout.core.assemble` but ``name``."""
    lid: torch.Tensor
    r: torch.Tensor
    c: torch.Tensor
    words: torch.Tensor | None
    partial: torch.Tensor | None
    block_size: tuple[int, int]
    seqlen: tuple[int, int]
    layout_batch: int
    layout_heads: int


# ---------------------------------------------------------------------------------------- SciPy / PyTorch BSR
def blocks_from_scipy_bsr(bsr, seqlen=None, *, layout_batch: int = 1, exact: bool = True) -> Blocks:
    """The blocks of a ``scipy.sparse`` BSR matrix/array, or a list of them (one per head).

    The block size is ``bsr.blocksize``. ``exact=True`` (default): a stored block's nonzero values
    are its allowed elements (all nonzero: a full block; none: not kept). ``exact=False``: every
    stored block is kept whole, values ignored. ``seqlen`` defaults to ``bsr.shape``; pass the
    layout's ``seqlen`` to round-trip a ragged layout exactly (SciPy shapes are whole blocks).
    A list of ``L`` matrices gives ``L`` masks, ``layout_heads = L // layout_batch`` (the order
    :func:`to_scipy_bsr` returns: mask ``l = b * layout_heads + h``).
    """
    if isinstance(bsr, (list, tuple)):
        if not bsr:
            raise ValueError("from_scipy_bsr needs at least one matrix, got an empty list")
        parts = [_scipy_blocks(b, f"bsr[{i}]") for i, b in enumerate(bsr)]
        for i, p in enumerate(parts):
            if p[4:] != parts[0][4:]:
                raise ValueError(f"all matrices must share shape and blocksize: bsr[0] has "
                                 f"{parts[0][4]} blocks of {parts[0][5]}, bsr[{i}] has {p[4]} blocks of {p[5]}")
        lid, r, c, vals, grid, block = _stacked([p[:6] for p in parts])
        lb, lh = _split_batch(len(parts), layout_batch)
    else:
        lid, r, c, vals, grid, block = _scipy_blocks(bsr, "bsr")
        lb = lh = 1
    return _from_blocks(lid, r, c, vals, (lb, lh), grid, block, seqlen, exact)


def _stacked(parts):
    """The blocks of a list of matrices (``parts``: each one's ``(lid, r, c, vals, grid, block)``, one mask
    each, sharing ``grid`` and ``block``) as one list, matrix ``i`` mask ``i``: ``(lid, r, c, vals, grid, block)``."""
    lid = torch.cat([torch.full_like(p[0], i) for i, p in enumerate(parts)])
    r, c, vals = (torch.cat([p[k] for p in parts]) for k in (1, 2, 3))
    return lid, r, c, vals, parts[0][4], parts[0][5]


def to_scipy_bsr(layout, dtype=None):
    """``scipy.sparse.bsr_matrix`` of shape ``(num_q_blocks * BLOCK_SIZE_Q, num_kv_blocks *
    BLOCK_SIZE_KV)``, blocksize ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)``; each kept block's values are its
    element mask as ``dtype`` (default ``numpy.int8``: 1 allowed, 0 not; full blocks all ones). A
    layout with several masks gives a list, mask ``l = b * layout_heads + h`` at index ``l``. The
    shape covers whole blocks; ``seqlen`` is not stored."""
    import numpy as np
    import scipy.sparse as sp

    dtype = np.int8 if dtype is None else dtype
    bq, bk = layout.block_size
    shape = (layout.num_q_blocks * bq, layout.num_kv_blocks * bk)
    crow = layout.crow_indices.cpu().to(torch.int64)
    col = layout.col_indices.cpu().to(torch.int64)
    values = _block_values(layout).cpu().numpy().astype(dtype)
    out = []
    for lid in range(layout.num_layouts):
        lo, hi = int(crow[lid, 0]), int(crow[lid, -1])
        indptr = (crow[lid] - lo).numpy()
        out.append(sp.bsr_matrix((values[lo:hi], col[lo:hi].numpy(), indptr), shape=shape))
    return out[0] if layout.num_layouts == 1 else out


def blocks_from_torch_bsr(t, seqlen=None, *, layout_batch: int = 1, exact: bool = True) -> Blocks:
    """The blocks of a ``torch.sparse_bsr`` tensor ``[M, N]``, ``[H, M, N]`` or ``[B, H, M, N]``
    (batched BSR), or a list of ``L`` 2-D ones (``layout_heads = L // layout_batch``, the order
    ``to_torch_bsr(as_list=True)`` returns). ``exact`` as in :func:`blocks_from_scipy_bsr` (nonzero
    values are allowed elements; ``False``: stored blocks kept whole). The block size is
    ``t.values().shape[-2:]``; ``seqlen`` defaults to ``(M, N)``."""
    if isinstance(t, (list, tuple)):
        if not t:
            raise ValueError("from_torch_bsr needs at least one tensor, got an empty list")
        parts = [_torch_blocks(x, f"t[{i}]") for i, x in enumerate(t)]
        for i, p in enumerate(parts):
            if p[0] != () or p[5:] != parts[0][5:]:
                raise ValueError(f"a list must hold 2-D BSR tensors sharing shape and blocksize: "
                                 f"t[0] has {parts[0][5]} blocks of {parts[0][6]}, t[{i}] has "
                                 f"{p[5]} blocks of {p[6]} and batch dims {p[0]}")
        lid, r, c, vals, grid, block = _stacked([p[1:7] for p in parts])
        lb, lh = _split_batch(len(parts), layout_batch)
    else:
        lead, lid, r, c, vals, grid, block = _torch_blocks(t, "t")
        lb, lh = (lead[0], lead[1]) if len(lead) == 2 else (1, lead[0] if lead else 1)
    return _from_blocks(lid, r, c, vals, (lb, lh), grid, block, seqlen, exact)


def to_torch_bsr(layout, dtype: torch.dtype = torch.bool, *, as_list: bool = False):
    """``torch.sparse_bsr`` tensor on the layout's device whose block values are the element masks
    (``dtype``: True/1 allowed; full blocks all ones).

    One mask: shape ``[num_q_blocks * BLOCK_SIZE_Q, num_kv_blocks * BLOCK_SIZE_KV]``. Several
    masks: a batched BSR tensor ``[layout_heads, M, N]`` (or ``[layout_batch, layout_heads, M,
    N]`` when ``layout_batch > 1``), which PyTorch allows only when every mask stores the same
    number of blocks; otherwise this raises ``ValueError``: ask for ``as_list=True`` to get a
    list of ``num_layouts`` 2-D tensors instead (always a list, mask ``l`` at index ``l``).
    """
    bq, bk = layout.block_size
    R, C = layout.num_q_blocks, layout.num_kv_blocks
    crow = to_relative_offsets(layout.crow_indices.to(torch.int64))
    col = layout.col_indices.to(torch.int64)
    nnz = (layout.crow_indices[:, -1] - layout.crow_indices[:, 0]).tolist()
    values = _block_values(layout).to(dtype)

    def bsr(crow_, col_, vals, size):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")
            return torch.sparse_bsr_tensor(crow_, col_, vals, size=size, check_invariants=False)

    starts = layout.crow_indices[:, 0].tolist()
    if as_list:
        return [bsr(crow[lid], col[starts[lid]:starts[lid] + nnz[lid]],
                    values[starts[lid]:starts[lid] + nnz[lid]], (R * bq, C * bk))
                for lid in range(layout.num_layouts)]
    if layout.num_layouts == 1:
        return bsr(crow[0], col, values, (R * bq, C * bk))
    if min(nnz) != max(nnz):
        raise ValueError(f"torch's batched BSR needs the same number of stored blocks in every "
                         f"mask, but this layout's {layout.num_layouts} masks store between "
                         f"{min(nnz)} and {max(nnz)}; call to_torch_bsr(as_list=True) for one "
                         f"2-D tensor per mask")
    lead = (layout.layout_heads,) if layout.layout_batch == 1 else (layout.layout_batch, layout.layout_heads)
    return bsr(crow.view(*lead, R + 1), col.view(*lead, nnz[0]), values.view(*lead, nnz[0], bq, bk),
               (*lead, R * bq, C * bk))


def _block_values(layout) -> torch.Tensor:
    """Element masks of the kept blocks in CSR order, ``bool [nnz_blocks, bq, bk]``."""
    return _bits.unpack(layout.entry_words(), layout.BLOCK_SIZE_KV)


def _from_blocks(lid, r, c, vals, lead, grid, block, seqlen, exact: bool) -> Blocks:
    """Stored blocks (duplicates allowed: their values are OR-ed) -> unique blocks."""
    (lb, lh), (R, C), (bq, bk) = lead, grid, block
    if R == 0 or C == 0:
        raise ValueError(f"a BSR matrix needs at least one block per axis, got {R} x {C}")
    sq, sk = as_pair((R * bq, C * bk) if seqlen is None else seqlen, "seqlen")
    if math.ceil(sq / bq) != R or math.ceil(sk / bk) != C:
        raise ValueError(f"seqlen {(sq, sk)} with block_size {(bq, bk)} needs {math.ceil(sq / bq)} x "
                         f"{math.ceil(sk / bk)} blocks, the BSR input has {R} x {C}")
    key = (lid * R + r) * C + c
    uniq, inverse = torch.unique(key, return_inverse=True)
    merged = torch.zeros(uniq.numel(), bq, bk, dtype=torch.int32)
    merged.index_add_(0, inverse, vals.to(torch.int32))
    c_u, rest = uniq % C, uniq // C
    r_u, l_u = rest % R, rest // R
    words = _bits.pack(merged > 0) if exact else None
    return Blocks(l_u, r_u, c_u, words, None, (bq, bk), (sq, sk), lb, lh)


# ---------------------------------------------------------------------------------------- FlexAttention
def _flex_block_tables(layout, delta: int | None):
    """``(kept, full)`` bool ``[lb, lh, R, C]`` for FlexAttention: blocks that hold an allowed element
    (the decision of the attention plan: :func:`~sparse_io_attn.layout.causal.causal_blocks` with the
    masks' offsets, causal offset ``delta``), and those of them with every element of the block
    rectangle allowed (full in the layout, inside both lengths, below the diagonal)."""
    dev = layout.device
    r = torch.arange(layout.num_q_blocks, device=dev)[:, None]
    c = torch.arange(layout.num_kv_blocks, device=dev)[None, :]
    table = layout.block_table()
    offset = None
    if delta is not None and layout.partial_masks.shape[0]:  # a partial mask wholly above the diagonal: dead
        per_mask = mask_offsets(layout.partial_masks, layout.BLOCK_SIZE_KV)
        offset = torch.where(table >= 0, per_mask[table.clamp(min=0).to(torch.int64)], -layout.BLOCK_SIZE_Q)
    live = causal_blocks(r, c, layout.block_size, layout.seqlen, delta, offset)
    kept = (table >= -1) & live.alive
    return kept, kept & live.whole & (table == -1)


def to_flex_block_mask(layout, causal=False, *, separate_full_blocks: bool = True):
    """A ``torch.nn.attention.flex_attention.BlockMask`` computing exactly this layout's mask.

    ``BLOCK_SIZE = (BLOCK_SIZE_Q, BLOCK_SIZE_KV)``, ``seq_lengths = seqlen`` and batch/head dims
    ``[layout_batch, layout_heads]`` (1 broadcasts). ``causal`` takes the values of the attention
    call's (:func:`~sparse_io_attn.layout.causal.causal_offset`: ``True``/``"top_left"``,
    ``"bottom_right"``). Its ``mask_mod`` keeps element ``(q, k)`` iff the layout allows it,
    ``q < seqlen_q``, ``k < seqlen_k`` and, with ``causal``, ``k <= q + delta``, on every element
    (eager ``flex_attention`` evaluates it everywhere; the compiled kernels on the partial blocks).
    It reads no table where the layout's rows are a band ``[q + lo, q + hi)`` (dense, causal,
    sliding windows), two per-query interval tables where every row is one interval (documents,
    prefix-LM), else a uint8 code per block (wider past 253 stored masks) and uint8 mask bits:
    never a 32-bit tile gather, so Flex compiles at its default tiles
    (:mod:`sparse_io_attn.layout._flex`). With ``separate_full_blocks`` the full blocks (every
    element of the block allowed) go to the ``full_kv_*`` lists, where the compiled kernels skip
    ``mask_mod``; with ``causal`` blocks holding no element with ``k <= q + delta`` are dropped.

    FlexAttention's compiled CUDA kernel also needs ``BLOCK_SIZE_Q % BLOCK_M == 0`` and
    ``BLOCK_SIZE_KV % BLOCK_N == 0`` for its own tile (on torch 2.13 the sm_90 defaults are 128 x 64
    at head dim 128 and 128 x 128 at 64 for fp16/bf16); for smaller layout blocks pass
    ``kernel_options={"BLOCK_M": ..., "BLOCK_N": ...}`` to ``flex_attention``.
    """
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as e:  # pragma: no cover - torch >= 2.5 is required by pyproject
        raise NotImplementedError(f"to_flex_block_mask needs torch.nn.attention.flex_attention "
                                  f"(torch >= 2.5), got torch {torch.__version__}") from e
    delta = causal_offset(causal, *layout.seqlen)
    kept, full = _flex_block_tables(layout, delta)
    if not separate_full_blocks:
        full = None
    kv_num_blocks, kv_indices = _ordered(kept & ~full if full is not None else kept)
    full_num, full_idx = _ordered(full) if full is not None else (None, None)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num, full_idx, BLOCK_SIZE=layout.block_size,
                                    mask_mod=_flex.mask_mod(layout, delta), seq_lengths=layout.seqlen)


def blocks_from_flex_block_mask(block_mask) -> Blocks:
    """The blocks of a FlexAttention ``BlockMask``, element-exact: blocks in its full lists are full
    blocks; on the blocks of its partial lists its ``mask_mod`` is evaluated element by element
    (for ``b < B``, ``h < H`` of the BlockMask's own batch/head dims, ``q < seq_lengths[0]``,
    ``kv < seq_lengths[1]``), giving partial blocks (or full/empty ones when every/no element is
    allowed). A ``mask_mod`` that depends on ``b`` or ``h`` therefore needs a BlockMask built with
    those dims, as for FlexAttention itself."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    sq, sk = (int(x) for x in block_mask.seq_lengths)
    R, C = math.ceil(sq / bq), math.ceil(sk / bk)
    partial = _flex_list(block_mask.kv_num_blocks, block_mask.kv_indices, R, C, "kv")
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = _flex_list(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, R, C, "full_kv")
    lb, lh = partial.shape[:2]
    if full is not None:
        lb, lh = max(lb, full.shape[0]), max(lh, full.shape[1])
        full = full.expand(lb, lh, R, C)
    partial = partial.expand(lb, lh, R, C)
    if full is not None:
        partial = partial & ~full
    lid_p, r_p, c_p = partial.reshape(lb * lh, R, C).nonzero(as_tuple=True)
    words = _eval_mask_mod(block_mask.mask_mod, lid_p, r_p, c_p, lh, (bq, bk), (sq, sk))
    if full is not None:
        lid_f, r_f, c_f = full.reshape(lb * lh, R, C).nonzero(as_tuple=True)
        lid_p, r_p, c_p = torch.cat([lid_p, lid_f]), torch.cat([r_p, r_f]), torch.cat([c_p, c_f])
        partial_flag = torch.cat([torch.ones(words.shape[0], dtype=torch.bool),
                                  torch.zeros(lid_f.numel(), dtype=torch.bool)])
    else:
        partial_flag = None
    return Blocks(lid_p, r_p, c_p, words, partial_flag, (bq, bk), (sq, sk), lb, lh)


def _flex_list(num_blocks: torch.Tensor, indices: torch.Tensor, R: int, C: int, what: str) -> torch.Tensor:
    """FlexAttention's padded block lists -> ``bool [B, H, R, C]``; indices used by ``num_blocks``
    must lie in ``[0, C)`` (FlexAttention pads *after* them)."""
    num_blocks, indices = num_blocks.cpu().to(torch.int64), indices.cpu().to(torch.int64)
    if num_blocks.dim() > 3 or indices.dim() != num_blocks.dim() + 1:
        raise ValueError(f"BlockMask {what}_num_blocks must be [B, H, rows] and {what}_indices "
                         f"[B, H, rows, cols], got {tuple(num_blocks.shape)} and {tuple(indices.shape)}")
    while num_blocks.dim() < 3:
        num_blocks, indices = num_blocks[None], indices[None]
    if num_blocks.shape[-1] < R:
        raise ValueError(f"BlockMask {what} lists cover {num_blocks.shape[-1]} block rows, seq_lengths "
                         f"need {R}")
    num_blocks, indices = num_blocks[..., :R], indices[..., :R, :]
    if (num_blocks < 0).any() or (num_blocks > indices.shape[-1]).any():
        raise ValueError(f"BlockMask {what}_num_blocks must lie in [0, {indices.shape[-1]}], got values "
                         f"in [{int(num_blocks.min())}, {int(num_blocks.max())}]")
    used = torch.arange(indices.shape[-1]) < num_blocks[..., None]
    bad = used & ((indices < 0) | (indices >= C))
    if bad.any():
        b, h, r, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"BlockMask {what}_indices[{b}, {h}, {r}, {j}] = {int(indices[b, h, r, j])} is one "
                         f"of the {int(num_blocks[b, h, r])} blocks {what}_num_blocks counts in that row "
                         f"but lies outside [0, {C}) ({C} key blocks for seq_lengths); put padding (-1 "
                         f"or any value) only after the counted entries, or lower the count")
    out = torch.zeros(*indices.shape[:-1], C, dtype=torch.bool)
    b, h, r, j = used.nonzero(as_tuple=True)
    out[b, h, r, indices[b, h, r, j]] = True
    return out


def _eval_mask_mod(mask_mod, lid, r, c, lh: int, block, seqlen) -> torch.Tensor:
    """``mask_mod`` on every in-range element of blocks ``(lid, r, c)``: ``int32 [E, bq, W]`` words."""
    (bq, bk), (sq, sk) = block, seqlen
    out = torch.zeros(lid.numel(), bq, _bits.num_words(bk), dtype=torch.int32)
    if lid.numel() == 0:
        return out
    fn = torch.vmap(mask_mod, in_dims=(0, 0, 0, 0))
    iq, ik = torch.arange(bq), torch.arange(bk)
    step = max(1, _EVAL_CHUNK // (bq * bk))
    for a in range(0, lid.numel(), step):
        sl = slice(a, a + step)
        n = lid[sl].numel()
        q = (r[sl] * bq)[:, None, None] + iq[None, :, None]
        k = (c[sl] * bk)[:, None, None] + ik[None, None, :]
        b = (lid[sl] // lh)[:, None, None].expand(n, bq, bk)
        h = (lid[sl] % lh)[:, None, None].expand(n, bq, bk)
        q, k = q.expand(n, bq, bk), k.expand(n, bq, bk)
        inside = (q < sq) & (k < sk)
        vals = fn(b.reshape(-1), h.reshape(-1), q.clamp(max=sq - 1).reshape(-1), k.clamp(max=sk - 1).reshape(-1))
        out[sl] = _bits.pack(vals.view(n, bq, bk).bool() & inside)
    return out


def _split_batch(num: int, layout_batch: int) -> tuple[int, int]:
    """``(layout_batch, layout_heads)`` for ``num`` masks."""
    if isinstance(layout_batch, bool) or not isinstance(layout_batch, int) or layout_batch < 1 \
            or num % layout_batch:
        raise ValueError(f"layout_batch must be a positive divisor of the number of masks "
                         f"{num}, got {layout_batch!r}")
    return layout_batch, num // layout_batch


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bool [..., R, C]`` -> FlexAttention's ``(num_blocks [..., R], indices [..., R, C])`` (int32):
    the kept columns of each row first, ascending, then the others."""
    m = mask.to(torch.int32)
    idx = torch.argsort(m, dim=-1, descending=True, stable=True)
    return m.sum(dim=-1, dtype=torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def _scipy_blocks(bsr, what: str):
    """Stored blocks of one SciPy BSR matrix: ``(lid, r, c, nonzero values bool [n, bq, bk],
    (R, C), (bq, bk))``."""
    import numpy as np
    import scipy.sparse as sp

    if not sp.issparse(bsr) or bsr.format != "bsr":
        got = f"a scipy.sparse {bsr.format} matrix" if sp.issparse(bsr) else type(bsr).__name__
        raise TypeError(f"{what} must be a scipy.sparse BSR matrix or array, got {got}; convert "
                        f"with .tobsr(blocksize=(block_size_q, block_size_kv))")
    if len(bsr.shape) != 2:
        raise ValueError(f"{what} must be 2-D, got shape {bsr.shape}")
    bq, bk = (int(x) for x in bsr.blocksize)
    R, C = bsr.shape[0] // bq, bsr.shape[1] // bk
    indptr = torch.from_numpy(np.asarray(bsr.indptr, dtype=np.int64))
    if indptr.shape != (R + 1,) or (indptr[1:] < indptr[:-1]).any() or indptr[0] != 0:
        raise ValueError(f"{what}: indptr must start at 0 and be non-decreasing of length {R + 1}, "
                         f"got length {indptr.numel()}")
    n = int(indptr[-1])
    if n > len(bsr.indices) or n > bsr.data.shape[0]:
        raise ValueError(f"{what}: indptr counts {n} stored blocks but indices/data hold "
                         f"{len(bsr.indices)}/{bsr.data.shape[0]}")
    indices = torch.from_numpy(np.asarray(bsr.indices[:n], dtype=np.int64))
    if indices.numel() and (indices.min() < 0 or indices.max() >= C):
        raise ValueError(f"{what}: block column indices must lie in [0, {C}), got values in "
                         f"[{int(indices.min())}, {int(indices.max())}]")
    rows = torch.searchsorted(indptr[1:].contiguous(), torch.arange(n), right=True)
    vals = torch.from_numpy(np.asarray(bsr.data[:n]) != 0)
    return torch.zeros_like(rows), rows, indices, vals, (R, C), (bq, bk)


def _torch_blocks(t, what: str):
    """Stored blocks of a (batched) ``torch.sparse_bsr``: ``(batch dims, lid, r, c, nonzero values
    bool [n, bq, bk], (R, C), (bq, bk))``."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_bsr:
        got = f"a tensor with layout {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{what} must be a torch.sparse_bsr tensor, got {got}; convert with "
                        f".to_sparse_bsr((block_size_q, block_size_kv))")
    values, crow, col = t.values(), t.crow_indices(), t.col_indices()
    n_batch = crow.dim() - 1
    if n_batch > 2 or values.dim() != n_batch + 3:
        raise ValueError(f"{what} must have shape [M, N], [H, M, N] or [B, H, M, N] without dense "
                         f"dims, got shape {tuple(t.shape)} with values {tuple(values.shape)}")
    bq, bk = int(values.shape[-2]), int(values.shape[-1])
    M, N = t.shape[-2:]
    R, C = M // bq, N // bk
    lead = tuple(t.shape[:n_batch])
    if crow.shape[-1] != R + 1:
        raise ValueError(f"{what}: crow_indices must have {R + 1} entries per matrix ({M} rows in "
                         f"blocks of {bq}), got {crow.shape[-1]}")
    crow2 = from_relative_offsets(crow.reshape(-1, R + 1).cpu())
    col2 = col.reshape(-1).cpu()
    validate_csr(crow2, col2, R, C, what=what)
    flat = csr_row_ids(crow2)
    vals = values.reshape(-1, bq, bk).cpu() != 0
    return lead, flat // R, flat % R, col2.to(torch.int64), vals, (R, C), (bq, bk)


# ------------------------------------------------------------------------------- row ranges, algebra
def row_blocks(layout, start: int, stop: int) -> Blocks:
    """The blocks of query positions ``[start, stop)`` of ``layout`` against every key, element-exact
    (what :meth:`~sparse_io_attn.BlockSparseLayout.rows` assembles)."""
    sq = layout.seqlen_q
    if isinstance(start, bool) or isinstance(stop, bool) or not isinstance(start, int) \
            or not isinstance(stop, int) or not 0 <= start < stop <= sq:
        raise ValueError(f"rows(start, stop) needs ints 0 <= start < stop <= seqlen_q = {sq}, got "
                         f"({start!r}, {stop!r})")
    (bq, bk), sk = layout.block_size, layout.seqlen_k
    lid, r, c = layout.entries()
    sel = ((r + 1) * bq > start) & (r * bq < stop)               # block rows overlapping the range
    lid, r, c = lid[sel], r[sel], c[sel]
    elems = _bits.unpack(layout.entry_words()[sel], bk)          # [E, bq, bk]
    i_abs = r[:, None] * bq + torch.arange(bq, device=r.device)  # [E, bq]
    inside = (i_abs >= start) & (i_abs < stop)
    e, i = inside.nonzero(as_tuple=True)
    new = i_abs[e, i] - start
    R = math.ceil((stop - start) / bq)
    key = (lid[e] * R + new // bq) * layout.num_kv_blocks + c[e]
    uniq, inverse = torch.unique(key, return_inverse=True)
    out = torch.zeros(uniq.numel(), bq, bk, dtype=torch.bool, device=r.device)
    out[inverse, new % bq] = elems[e, i]
    new_c, rest = uniq % layout.num_kv_blocks, uniq // layout.num_kv_blocks
    return Blocks(rest // R, rest % R, new_c, _bits.pack(out), None, layout.block_size, (stop - start, sk),
                  layout.layout_batch, layout.layout_heads)


def combined_blocks(a, b, union: bool) -> Blocks:
    """The element-level union (``union``) or intersection of two layouts of one block size and
    seqlen; their masks broadcast over batch and heads."""
    if a.block_size != b.block_size or a.seqlen != b.seqlen:
        raise ValueError(f"layouts must share block_size and seqlen to combine: "
                         f"{a.block_size}/{a.seqlen} vs {b.block_size}/{b.seqlen}")
    b = b.to(a.device)
    ta, tb = a.block_table(), b.block_table()
    if any(x != y and 1 not in (x, y) for x, y in zip(ta.shape[:2], tb.shape[:2])):
        raise ValueError(f"layout batch/heads do not broadcast: {tuple(ta.shape[:2])} vs {tuple(tb.shape[:2])}")
    lb, lh = max(ta.shape[0], tb.shape[0]), max(ta.shape[1], tb.shape[1])
    R, C = a.num_q_blocks, a.num_kv_blocks
    ta, tb = ta.expand(lb, lh, R, C).reshape(-1, R, C), tb.expand(lb, lh, R, C).reshape(-1, R, C)
    keep = (ta >= -1) | (tb >= -1) if union else (ta >= -1) & (tb >= -1)
    lid, r, c = keep.nonzero(as_tuple=True)
    wa = words_at(ta[lid, r, c], a.partial_masks, r, c, a.block_size, a.seqlen)
    wb = words_at(tb[lid, r, c], b.partial_masks, r, c, a.block_size, a.seqlen)
    return Blocks(lid, r, c, wa | wb if union else wa & wb, None, a.block_size, a.seqlen, lb, lh)
