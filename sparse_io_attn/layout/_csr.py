"""Block-level CSR/CSC bookkeeping shared by every block-sparse object in the library.

One convention, used by :class:`~sparse_io_attn.BlockSparseLayout` (the QK pattern) and by
:class:`~sparse_io_attn.BlockSparseMatrix` (block-sparse operands):

* A batch of ``L`` block-sparse matrices of ``R`` block rows and ``C`` block columns is stored as
  ``crow_indices`` of shape ``[L, R + 1]`` and a flat ``col_indices`` of shape ``[nnz]``.
* ``crow_indices`` hold **absolute** offsets into ``col_indices``: matrix ``l``'s row ``r`` owns
  ``col_indices[crow_indices[l, r] : crow_indices[l, r + 1]]`` and ``crow_indices[l + 1, 0] ==
  crow_indices[l, R]``. (PyTorch's batched CSR restarts at 0 per batch and needs equal nnz per
  batch; absolute offsets let every head keep its own nnz and let a kernel index with one load.)
* Column indices are sorted and unique inside each row. Index dtype is int32 (what the kernels
  load); conversions to PyTorch/SciPy formats widen to int64 where those formats want it.
* The transposed copy (CSC) uses the same convention with names ``ccol_indices [L, C + 1]`` and
  ``row_indices [nnz]``; ``csc_perm[j]`` gives the CSR position of the j-th CSC entry, so values
  stored in CSR order can be read in CSC order.
"""
from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32
#: the largest value an index tensor holds (and so the most stored blocks a layout may have)
INDEX_MAX = torch.iinfo(INDEX_DTYPE).max


def check_index_capacity(num_entries: int, what: str = "layout") -> None:
    """Raise ``ValueError`` unless ``num_entries`` stored blocks fit the int32 indices."""
    if num_entries > INDEX_MAX:
        raise ValueError(f"{what}: at most {INDEX_MAX} stored blocks fit int32 indices, got "
                         f"{num_entries}; use larger blocks")


def check_fits_int32(t: torch.Tensor, name: str, what: str = "layout") -> None:
    """Raise ``ValueError`` unless every value of the integer tensor ``t`` fits int32 (so that the
    conversion to the stored int32 loses nothing)."""
    if t.dtype == torch.int32 or t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    limits = torch.iinfo(torch.int32)
    if lo < limits.min or hi > limits.max:
        raise ValueError(f"{what}: {name} is stored as int32, values in [{limits.min}, {limits.max}], "
                         f"got values in [{lo}, {hi}]; pass values that fit (element-mask words "
                         f"as signed int32, e.g. word - 2**32 for word >= 2**31)")


def mask_to_csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bool [L, R, C]`` -> ``(crow_indices [L, R+1], col_indices [nnz])`` (int32, absolute offsets)."""
    if mask.dim() != 3:
        raise ValueError(f"expected a block mask of shape [L, R, C], got shape {tuple(mask.shape)}")
    L, R, C = mask.shape
    counts = mask.reshape(L * R, C).sum(dim=1, dtype=torch.int64)
    crow = torch.zeros(L * R + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(counts, dim=0, out=crow[1:])
    col = mask.reshape(L * R, C).nonzero()[:, 1]  # row-major order: sorted inside each row
    return _absolute_crow(crow, L, R).to(INDEX_DTYPE), col.to(INDEX_DTYPE)


def csr_row_ids(crow: torch.Tensor) -> torch.Tensor:
    """For each stored entry, the flat row id ``l * R + r`` that owns it (int64, ``[nnz]``).

    Needs absolute, non-decreasing offsets starting at 0 (entry ``j`` belongs to the first row
    whose end exceeds ``j``). A binary search instead of ``repeat_interleave(counts)``, which has a
    fixed cost of ~20 ms per call on CPU builds of torch 2.13. Reads ``nnz`` from ``crow`` (a host
    synchronisation on CUDA); :func:`slot_rows` is the fixed-size form.
    """
    ends = crow[:, 1:].reshape(-1).to(torch.int64).contiguous()
    nnz = int(ends[-1]) if ends.numel() else 0
    return slot_rows(crow, nnz)


def slot_rows(crow: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The flat row id ``l * R + r`` owning each of ``num_slots`` storage slots (int64 ``[num_slots]``);
    slots past ``crow[-1, -1]`` (unused capacity) get ``L * R``. Tensor operations only, sized by
    ``num_slots``: no host synchronisation."""
    ends = crow[:, 1:].reshape(-1).to(torch.int64).contiguous()
    return torch.searchsorted(ends, torch.arange(num_slots, device=crow.device), right=True)


def slot_entries(crow: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(used, lid, r)`` of each of ``num_slots`` storage slots: whether it holds an entry, and the
    matrix and row owning it (``lid = L``, ``r = 0`` on unused slots). Fixed size, no synchronisation."""
    L, R = crow.shape[0], crow.shape[1] - 1
    flat_row = slot_rows(crow, num_slots)
    used = flat_row < L * R
    lid = flat_row // R
    return used, lid, torch.where(used, flat_row - lid * R, 0)


def csc_order(used, lid, r, c, R: int, C: int) -> torch.Tensor:
    """The permutation sorting slots by ``(lid, c, r)`` (the CSC order), unused slots last in slot
    order: one stable sort of a key unique among used slots (``R`` rows, ``C`` columns per matrix)."""
    key = torch.where(used, (lid * C + c) * R + r, torch.iinfo(torch.int64).max)
    return torch.sort(key, stable=True).indices


def front_slots(keep: torch.Tensor) -> torch.Tensor:
    """Where :func:`pack_front` writes each entry (int64 ``[n]``): the ``i``-th kept entry (``keep``,
    bool ``[n]``) to slot ``i``, every other entry to the spare slot ``n``."""
    kept = keep.to(torch.int64)
    return torch.where(keep, torch.cumsum(kept, 0) - kept, keep.numel())


def pack_front(slots: torch.Tensor, values: torch.Tensor, fill: int, dtype=INDEX_DTYPE) -> torch.Tensor:
    """``values[keep]`` in order at the front of an ``[n]`` tensor, ``fill`` after (``slots`` from
    :func:`front_slots`): one scatter into a buffer with a spare slot that takes the entries not kept.
    Fixed size, no host synchronisation (``values[keep]`` has a data-dependent size)."""
    out = torch.full((slots.numel() + 1,), fill, dtype=dtype, device=values.device)
    return out.scatter_(0, slots, values.to(dtype))[:-1]


def group_offsets(group: torch.Tensor, keep: torch.Tensor, num_groups: int, L: int) -> torch.Tensor:
    """Absolute CSR offsets ``int32 [L, num_groups // L + 1]`` of the entries where ``keep``, counted
    per flat group id ``group`` (int64 in ``[0, num_groups)`` where ``keep``): scatter-add and cumsum,
    no host synchronisation."""
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=group.device)
    counts.scatter_add_(0, torch.where(keep, group, num_groups), keep.to(torch.int64))
    flat = torch.zeros(num_groups + 1, dtype=torch.int64, device=group.device)
    torch.cumsum(counts[:-1], 0, out=flat[1:])
    return _absolute_crow(flat, L, num_groups // L).to(INDEX_DTYPE)


def csr_to_mask(crow: torch.Tensor, col: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of :func:`mask_to_csr`: ``bool [L, R, C]``."""
    L, R1 = crow.shape
    R = R1 - 1
    mask = torch.zeros(L * R, num_cols, dtype=torch.bool, device=crow.device)
    if col.numel():
        mask[csr_row_ids(crow), col.to(torch.int64)] = True
    return mask.view(L, R, num_cols)


def csr_transpose(crow: torch.Tensor, col: torch.Tensor, num_cols: int):
    """CSR -> CSC of the same matrices: ``(ccol [L, C+1], row [n], perm [n])`` for ``n = col.numel()``.

    ``perm[j]`` is the CSR position of the j-th CSC entry (so ``values[perm]`` reorders values).
    ``col`` may hold unused capacity past ``crow[-1, -1]``: those slots sort to the end of the CSC
    order (``row`` 0 there) and no column counts them. Fixed size, no host synchronisation.
    """
    L, C = crow.shape[0], num_cols
    used, lid, r = slot_entries(crow, col.numel())
    c = col.to(torch.int64)
    perm = csc_order(used, lid, r, c, crow.shape[1] - 1, C)
    return group_offsets(lid * C + c, used, L * C, L), r[perm].to(INDEX_DTYPE), perm


def validate_csr(crow: torch.Tensor, col: torch.Tensor, num_rows: int, num_cols: int,
                 what: str = "layout") -> None:
    """Raise ``ValueError``/``TypeError`` (naming expected vs got) unless ``(crow, col)`` is a valid
    absolute-offset CSR of ``num_rows`` x ``num_cols`` blocks with sorted, unique columns per row."""
    for name, t in (("crow_indices", crow), ("col_indices", col)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what}: {name} must be int32 or int64, got {t.dtype}; "
                            f"convert with .to(torch.int32)")
    if crow.dim() != 2 or crow.shape[1] != num_rows + 1 or crow.shape[0] < 1:
        raise ValueError(f"{what}: crow_indices must have shape [L, {num_rows + 1}] "
                         f"(L >= 1 layouts, {num_rows} block rows + 1), got {tuple(crow.shape)}")
    if col.dim() != 1:
        raise ValueError(f"{what}: col_indices must be 1-D (flat, absolute offsets), "
                         f"got shape {tuple(col.shape)}")
    if crow.device != col.device:
        raise ValueError(f"{what}: crow_indices and col_indices must be on one device, got "
                         f"{crow.device} and {col.device}")
    check_index_capacity(col.numel(), what)
    check_fits_int32(crow, "crow_indices", what)
    check_fits_int32(col, "col_indices", what)
    c64 = crow.to(torch.int64).cpu()
    if c64.numel() and c64[0, 0].item() != 0:
        raise ValueError(f"{what}: crow_indices[0, 0] must be 0, got {c64[0, 0].item()}")
    if c64.shape[0] > 1 and not torch.equal(c64[1:, 0], c64[:-1, -1]):
        raise ValueError(f"{what}: crow_indices must use absolute offsets: crow_indices[l+1, 0] "
                         f"must equal crow_indices[l, -1]")
    if (c64[:, 1:] < c64[:, :-1]).any():
        raise ValueError(f"{what}: crow_indices must be non-decreasing along each row")
    if c64[-1, -1].item() != col.numel():
        raise ValueError(f"{what}: crow_indices[-1, -1] must equal len(col_indices) = {col.numel()}, "
                         f"got {c64[-1, -1].item()}")
    if col.numel() == 0:
        return
    c = col.to(torch.int64).cpu()
    lo, hi = c.min().item(), c.max().item()
    if lo < 0 or hi >= num_cols:
        raise ValueError(f"{what}: col_indices must lie in [0, {num_cols}), got values in [{lo}, {hi}]")
    rows = csr_row_ids(c64)
    same_row = rows[1:] == rows[:-1]
    if (same_row & (c[1:] <= c[:-1])).any():
        bad = int(torch.nonzero(same_row & (c[1:] <= c[:-1]))[0, 0])
        kind = "duplicate" if c[bad + 1] == c[bad] else "unsorted"
        raise ValueError(f"{what}: col_indices must be sorted and unique within each row; "
                         f"found {kind} entries {c[bad].item()}, {c[bad + 1].item()} in flat row "
                         f"{rows[bad].item()}; sort them (or build with from_block_mask)")


def to_relative_offsets(crow: torch.Tensor) -> torch.Tensor:
    """Absolute ``crow [L, R+1]`` -> per-matrix offsets that restart at 0 (PyTorch/SciPy style)."""
    return crow - crow[:, :1]


def from_relative_offsets(crow: torch.Tensor) -> torch.Tensor:
    """Per-matrix ``crow [L, R+1]`` that restart at 0 -> absolute offsets into one flat index."""
    nnz = (crow[:, -1] - crow[:, 0]).to(torch.int64)
    start = torch.zeros_like(nnz)
    torch.cumsum(nnz[:-1], dim=0, out=start[1:])
    return crow - crow[:, :1] + start[:, None].to(crow.dtype)


def _absolute_crow(flat: torch.Tensor, L: int, R: int) -> torch.Tensor:
    """Flat offsets ``[L * R + 1]`` -> ``[L, R + 1]`` absolute offsets (row r of matrix l ends where
    row r + 1 starts)."""
    return torch.cat([flat[:-1].view(L, R), flat[R::R].view(L, 1)], dim=1)


def coo_to_csr(lid: torch.Tensor, row: torch.Tensor, col: torch.Tensor, L: int, R: int):
    """Unique entries ``(lid, row, col)`` (int64) of ``L`` matrices with ``R`` block rows ->
    ``(crow [L, R+1], col [nnz], order)``: absolute-offset int32 CSR and the permutation ``order``
    that sorts the entries by ``(lid, row, col)`` (apply it to per-entry data)."""
    flat_row = lid * R + row
    ncol = int(col.max()) + 1 if col.numel() else 1
    key = flat_row * ncol + col
    if bool((key[1:] >= key[:-1]).all()):   # already in CSR order (the pattern builders' output)
        order = torch.arange(key.numel(), device=key.device)
    else:
        order = torch.argsort(key)
    counts = torch.bincount(flat_row, minlength=L * R)
    flat = torch.zeros(L * R + 1, dtype=torch.int64, device=col.device)
    torch.cumsum(counts, dim=0, out=flat[1:])
    return _absolute_crow(flat, L, R).to(INDEX_DTYPE), col[order].to(INDEX_DTYPE), order
