"""Conversions between :class:`~sparse_io_attn.BlockSparseLayout` and the block-sparse formats of
SciPy (BSR), PyTorch (``torch.sparse_bsr``) and FlexAttention (``BlockMask``).

The layout's own ``from_*``/``to_*`` methods call these functions; round trips are exact.
"""
from __future__ import annotations

import math
import warnings

import torch

from sparse_io_attn.layout._csr import csr_to_mask, from_relative_offsets, to_relative_offsets, validate_csr
from sparse_io_attn.layout.core import BlockSparseLayout


# ---------------------------------------------------------------------------------------- SciPy / PyTorch BSR
def from_scipy_bsr(bsr, seqlen=None, *, layout_batch: int = 1,
                   name: str = "custom") -> BlockSparseLayout:
    """Build from a ``scipy.sparse`` BSR matrix/array, or a list of them (one per head).

    The block size is ``bsr.blocksize``; every *stored* block is kept (the values are ignored,
    so a stored block of zeros is kept too). ``seqlen`` defaults to ``bsr.shape``; pass the
    layout's ``seqlen`` to round-trip a ragged layout exactly (SciPy shapes are whole blocks).
    A list of ``L`` matrices gives ``L`` masks, ``layout_heads = L // layout_batch`` (the order
    :meth:`to_scipy_bsr` returns: mask ``l = b * layout_heads + h``).
    """
    if isinstance(bsr, (list, tuple)):
        if not bsr:
            raise ValueError("from_scipy_bsr needs at least one matrix, got an empty list")
        parts = [_scipy_block_mask(b, f"bsr[{i}]") for i, b in enumerate(bsr)]
        for i, (m, bs) in enumerate(parts):
            if bs != parts[0][1] or m.shape != parts[0][0].shape:
                raise ValueError(f"all matrices must share shape and blocksize: bsr[0] has "
                                 f"{tuple(parts[0][0].shape)} blocks of {parts[0][1]}, bsr[{i}] "
                                 f"has {tuple(m.shape)} blocks of {bs}")
        mask, block = _split_batch(torch.stack([m for m, _ in parts]), layout_batch), parts[0][1]
    else:
        mask, block = _scipy_block_mask(bsr, "bsr")
    return BlockSparseLayout.from_block_mask(mask, block, seqlen, name=name)

def to_scipy_bsr(layout: BlockSparseLayout, dtype=None):
    """``scipy.sparse.bsr_matrix`` of shape ``(num_q_blocks * BLOCK_SIZE_Q, num_kv_blocks *
    BLOCK_SIZE_KV)``, blocksize ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)``, all-ones blocks of ``dtype``
    (default ``numpy.int8``). A layout with several masks gives a list, mask ``l = b *
    layout_heads + h`` at index ``l``. The shape covers whole blocks; ``seqlen`` is not stored."""
    import numpy as np
    import scipy.sparse as sp

    dtype = np.int8 if dtype is None else dtype
    bq, bk = layout.block_size
    shape = (layout.num_q_blocks * bq, layout.num_kv_blocks * bk)
    crow = layout.crow_indices.cpu().to(torch.int64)
    col = layout.col_indices.cpu().to(torch.int64)
    out = []
    for lid in range(layout.num_layouts):
        lo, hi = int(crow[lid, 0]), int(crow[lid, -1])
        data = np.ones((hi - lo, bq, bk), dtype=dtype)
        indptr = (crow[lid] - lo).numpy()
        out.append(sp.bsr_matrix((data, col[lo:hi].numpy(), indptr), shape=shape))
    return out[0] if layout.num_layouts == 1 else out

def from_torch_bsr(t, seqlen=None, *, layout_batch: int = 1,
                   name: str = "custom") -> BlockSparseLayout:
    """Build from a ``torch.sparse_bsr`` tensor ``[M, N]``, ``[H, M, N]`` or ``[B, H, M, N]``
    (batched BSR), or a list of ``L`` 2-D ones (``layout_heads = L // layout_batch``, the order
    ``to_torch_bsr(as_list=True)`` returns). Stored blocks are kept, values are ignored; the
    block size is ``t.values().shape[-2:]``; ``seqlen`` defaults to ``(M, N)``."""
    if isinstance(t, (list, tuple)):
        if not t:
            raise ValueError("from_torch_bsr needs at least one tensor, got an empty list")
        parts = [_torch_block_mask(x, f"t[{i}]") for i, x in enumerate(t)]
        for i, (m, bs) in enumerate(parts):
            if m.dim() != 2 or bs != parts[0][1] or m.shape != parts[0][0].shape:
                raise ValueError(f"a list must hold 2-D BSR tensors sharing shape and blocksize: "
                                 f"t[0] has {tuple(parts[0][0].shape)} blocks of {parts[0][1]}, "
                                 f"t[{i}] has {tuple(m.shape)} blocks of {bs}")
        mask, block = _split_batch(torch.stack([m for m, _ in parts]), layout_batch), parts[0][1]
    else:
        mask, block = _torch_block_mask(t, "t")
    return BlockSparseLayout.from_block_mask(mask, block, seqlen, name=name)

def to_torch_bsr(layout: BlockSparseLayout, dtype: torch.dtype = torch.bool, *, as_list: bool = False):
    """``torch.sparse_bsr`` tensor of all-ones blocks on the layout's device.

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

    def bsr(crow_, col_, n_blocks, size):
        values = torch.ones(*size[:-2], n_blocks, bq, bk, dtype=dtype, device=layout.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")
            return torch.sparse_bsr_tensor(crow_, col_, values, size=size, check_invariants=False)

    if as_list:
        starts = layout.crow_indices[:, 0].tolist()
        return [bsr(crow[lid], col[starts[lid]:starts[lid] + nnz[lid]], nnz[lid], (R * bq, C * bk))
                for lid in range(layout.num_layouts)]
    if layout.num_layouts == 1:
        return bsr(crow[0], col, nnz[0], (R * bq, C * bk))
    if min(nnz) != max(nnz):
        raise ValueError(f"torch's batched BSR needs the same number of stored blocks in every "
                         f"mask, but this layout's {layout.num_layouts} masks store between "
                         f"{min(nnz)} and {max(nnz)}; call to_torch_bsr(as_list=True) for one "
                         f"2-D tensor per mask")
    lead = (layout.layout_heads,) if layout.layout_batch == 1 else (layout.layout_batch, layout.layout_heads)
    return bsr(crow.view(*lead, R + 1), col.view(*lead, nnz[0]), nnz[0], (*lead, R * bq, C * bk))

# ---------------------------------------------------------------------------------------- FlexAttention
def to_flex_block_mask(layout: BlockSparseLayout, causal: bool = False, *, separate_full_blocks: bool = True):
    """A ``torch.nn.attention.flex_attention.BlockMask`` with the same block sparsity.

    ``BLOCK_SIZE = (BLOCK_SIZE_Q, BLOCK_SIZE_KV)``, ``seq_lengths = seqlen`` and batch/head
    dims ``[layout_batch, layout_heads]`` (1 broadcasts). Its ``mask_mod`` keeps element
    ``(q, k)`` iff its block is kept, ``q < seqlen_q`` and ``k < seqlen_k`` (and ``q >= k`` when
    ``causal``, top-left aligned); it reads the block table, so eager ``flex_attention`` (which
    evaluates ``mask_mod`` on every element and ignores the block lists) and the compiled
    kernels agree. With ``separate_full_blocks`` blocks whose every element is kept go to the
    ``full_kv_*`` lists, where the compiled kernels skip ``mask_mod``; with ``causal`` blocks
    holding no element with ``q >= k`` are dropped.

    FlexAttention's compiled CUDA kernel also needs ``BLOCK_SIZE_Q % BLOCK_M == 0`` and
    ``BLOCK_SIZE_KV % BLOCK_N == 0`` for its own tile (on torch 2.13 the defaults are 128 x 64
    for fp16/bf16 and 64 x 64 for fp32 at head_dim <= 256); for smaller layout blocks pass
    ``kernel_options={"BLOCK_M": ..., "BLOCK_N": ...}`` to ``flex_attention``.
    """
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as e:  # pragma: no cover - torch >= 2.5 is required by pyproject
        raise NotImplementedError(f"to_flex_block_mask needs torch.nn.attention.flex_attention "
                                  f"(torch >= 2.5), got torch {torch.__version__}") from e
    bq, bk = layout.block_size
    sq, sk = layout.seqlen
    R, C = layout.num_q_blocks, layout.num_kv_blocks
    dev = layout.device
    r = torch.arange(R, device=dev)
    c = torch.arange(C, device=dev)
    q_lo, q_hi = r * bq, torch.clamp((r + 1) * bq, max=sq) - 1
    k_lo, k_hi = c * bk, torch.clamp((c + 1) * bk, max=sk) - 1
    whole = ((r + 1) * bq <= sq)[:, None] & ((c + 1) * bk <= sk)[None, :]  # [R, C] no padding
    kept = layout.to_block_mask()
    if causal:
        kept = kept & (k_lo[None, :] <= q_hi[:, None])
        whole = whole & (k_hi[None, :] <= q_lo[:, None])
    full = kept & whole if separate_full_blocks else None
    partial = kept & ~whole if separate_full_blocks else kept
    kv_num_blocks, kv_indices = _ordered(partial)
    full_num, full_idx = _ordered(full) if full is not None else (None, None)

    table = kept
    stride_b = 1 if layout.layout_batch > 1 else 0
    stride_h = 1 if layout.layout_heads > 1 else 0

    def mask_mod(b, h, q_idx, kv_idx):
        rb = torch.clamp(q_idx // bq, max=R - 1)
        cb = torch.clamp(kv_idx // bk, max=C - 1)
        keep = table[b * stride_b, h * stride_h, rb, cb] & (q_idx < sq) & (kv_idx < sk)
        return keep & (q_idx >= kv_idx) if causal else keep

    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num, full_idx,
                                    BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, seq_lengths=(sq, sk))

def from_flex_block_mask(block_mask, *, name: str = "flex") -> BlockSparseLayout:
    """Build from a FlexAttention ``BlockMask``: a block is kept if it is in the partial or the
    full block lists. Block-granular: elements that the ``mask_mod`` removes inside a kept
    block are not recorded (apply them with ``causal=True`` or keep the BlockMask)."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    sq, sk = (int(x) for x in block_mask.seq_lengths)
    R, C = math.ceil(sq / bq), math.ceil(sk / bk)
    dense = block_mask.to_dense() != 0  # [..., rows, cols] union of partial and full blocks
    if dense.dim() > 4:
        raise ValueError(f"BlockMask must have at most 2 batch dims [B, H], got shape "
                         f"{tuple(dense.shape)}")
    if dense.shape[-2] < R or dense.shape[-1] < C:
        raise ValueError(f"BlockMask with seq_lengths {(sq, sk)} and BLOCK_SIZE {(bq, bk)} needs "
                         f"{R} x {C} blocks, its kv_indices hold {tuple(dense.shape[-2:])}")
    if dense[..., R:, :].any() or dense[..., C:].any():
        raise ValueError(f"BlockMask keeps blocks beyond seq_lengths {(sq, sk)} "
                         f"({R} x {C} blocks of {(bq, bk)})")
    return BlockSparseLayout.from_block_mask(dense[..., :R, :C].contiguous(), (bq, bk), (sq, sk), name=name)


def _split_batch(mask: torch.Tensor, layout_batch: int) -> torch.Tensor:
    """``[L, R, C]`` -> ``[layout_batch, L // layout_batch, R, C]``."""
    if isinstance(layout_batch, bool) or not isinstance(layout_batch, int) or layout_batch < 1 \
            or mask.shape[0] % layout_batch:
        raise ValueError(f"layout_batch must be a positive divisor of the number of masks "
                         f"{mask.shape[0]}, got {layout_batch!r}")
    return mask.view(layout_batch, mask.shape[0] // layout_batch, *mask.shape[1:])


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bool [..., R, C]`` -> FlexAttention's ``(num_blocks [..., R], indices [..., R, C])`` (int32):
    the kept columns of each row first, ascending, then the others."""
    m = mask.to(torch.int32)
    idx = torch.argsort(m, dim=-1, descending=True, stable=True)
    return m.sum(dim=-1, dtype=torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def _scipy_block_mask(bsr, what: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """Stored-block mask ``bool [R, C]`` and blocksize of one SciPy BSR matrix."""
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
    if indptr.shape != (R + 1,) or (indptr[1:] < indptr[:-1]).any():
        raise ValueError(f"{what}: indptr must be non-decreasing of length {R + 1}, got length "
                         f"{indptr.numel()}")
    indices = torch.from_numpy(np.asarray(bsr.indices[: int(indptr[-1])], dtype=np.int64))
    if indices.numel() and (indices.min() < 0 or indices.max() >= C):
        raise ValueError(f"{what}: block column indices must lie in [0, {C}), got values in "
                         f"[{int(indices.min())}, {int(indices.max())}]")
    mask = torch.zeros(R, C, dtype=torch.bool)
    rows = torch.searchsorted(indptr[1:].contiguous(), torch.arange(indices.numel()), right=True)
    mask[rows, indices] = True
    return mask, (bq, bk)


def _torch_block_mask(t, what: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """Stored-block mask ``bool [*batch, R, C]`` and blocksize of a (batched) ``torch.sparse_bsr``."""
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
    crow2 = from_relative_offsets(crow.reshape(-1, R + 1))
    validate_csr(crow2, col.reshape(-1), R, C, what=what)
    return csr_to_mask(crow2, col.reshape(-1), C).view(*lead, R, C), (bq, bk)
