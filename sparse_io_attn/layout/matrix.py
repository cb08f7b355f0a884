"""`BlockSparseMatrix`: a block-sparse (BSR) operand, e.g. a pruned weight or a sparse activation.

Storage follows :mod:`sparse_io_attn.layout._csr` (the same helpers as :class:`BlockSparseLayout`), for a
single matrix (``L = 1``), with the leading batch axis dropped the way ``torch.sparse_bsr_tensor``
and ``scipy.sparse.bsr_matrix`` drop it:

* ``crow_indices [R + 1]`` int32 (offsets into ``col_indices``), ``col_indices [nnz_blocks]`` int32,
  sorted and unique inside each block row;
* ``values [nnz_blocks, BR, BC]`` in the matrix's dtype, block ``b`` = rows
  ``[r*BR, (r+1)*BR)``, columns ``[c*BC, (c+1)*BC)``. The last block row/column may stick out of
  ``shape`` when a dimension is not a multiple of the block: entries outside ``shape`` are padding,
  kept at zero, and never counted, loaded or returned.

``values`` is the leaf tensor: ``m.values.requires_grad_()`` or ``torch.nn.Parameter(m.values)``
makes the matrix trainable on its fixed block pattern (gradients are masked to the pattern, as in
pruned-weight training); ``torch.optim`` optimizers take ``[m.values]``.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.layout._csr import (INDEX_DTYPE, check_index_capacity, csr_row_ids, csr_to_mask, csr_transpose,
                                        mask_to_csr, validate_csr)
from sparse_io_attn.layout._args import as_pair

_DRAW_LIMIT = 64


class BlockSparseMatrix:
    r"""A 2-D block-sparse matrix in BSR form.

    Rebuilding the dense matrix (what :meth:`to_dense` returns)::

        dense = torch.zeros(R * BR, C * BC)
        for r in range(R):
            for p in range(crow_indices[r], crow_indices[r + 1]):
                c = col_indices[p]
                dense[r*BR:(r+1)*BR, c*BC:(c+1)*BC] = values[p]
        dense = dense[:shape[0], :shape[1]]

    Counts: ``nnz_blocks`` stored blocks; ``nnz`` stored *elements* inside ``shape`` (a stored block
    counts all of its in-bounds elements, zero or not: this is what the kernels load); ``density`` =
    ``nnz / (shape[0] * shape[1])``.
    """

    def __init__(self, crow_indices: torch.Tensor, col_indices: torch.Tensor, values: torch.Tensor,
                 shape, block_size, *, validate: bool = True):
        self.shape = as_pair(tuple(shape) if not isinstance(shape, int) else shape, "shape")
        self.block_size = as_pair(block_size, "block_size")
        br, bc = self.block_size
        self.num_block_rows = math.ceil(self.shape[0] / br)
        self.num_block_cols = math.ceil(self.shape[1] / bc)
        if validate:
            if not isinstance(crow_indices, torch.Tensor) or crow_indices.dim() != 1:
                got = tuple(crow_indices.shape) if isinstance(crow_indices, torch.Tensor) else type(crow_indices).__name__
                raise ValueError(f"BlockSparseMatrix: crow_indices must be 1-D [{self.num_block_rows + 1}] "
                                 f"(block rows + 1), got {got}")
            validate_csr(crow_indices[None], col_indices, self.num_block_rows, self.num_block_cols,
                         what="BlockSparseMatrix")
            if not isinstance(values, torch.Tensor):
                raise TypeError(f"BlockSparseMatrix: values must be a torch.Tensor, got {type(values).__name__}")
            want = (col_indices.numel(), br, bc)
            if tuple(values.shape) != want:
                raise ValueError(f"BlockSparseMatrix: values must have shape [nnz_blocks, BR, BC] = {want}, "
                                 f"got {tuple(values.shape)}")
            if not values.is_floating_point():
                raise TypeError(f"BlockSparseMatrix: values must be floating point, got {values.dtype}")
            if crow_indices.device != values.device or col_indices.device != values.device:
                raise ValueError(f"BlockSparseMatrix: indices and values must be on one device, got "
                                 f"{crow_indices.device}, {col_indices.device}, {values.device}")
        check_index_capacity(col_indices.numel(), "BlockSparseMatrix")
        self.crow_indices = crow_indices.to(INDEX_DTYPE)
        self.col_indices = col_indices.to(INDEX_DTYPE)
        self.values = values
        self._cache: dict = {}
        if validate and self.nnz_blocks and (values.detach() * ~self._inbounds_mask()).any():
            raise ValueError(f"BlockSparseMatrix: entries of edge blocks outside shape {self.shape} must be "
                             f"zero (padding); zero them or build with from_dense")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def random(cls, block_mask: torch.Tensor, block_size, *, shape=None, dtype=torch.float32,
               device=None, generator: torch.Generator | None = None) -> "BlockSparseMatrix":
        """A matrix on the pattern of ``block_mask [R, C]`` (bool) with random normal values
        (padding outside ``shape`` zeroed). ``shape`` defaults to ``(R * BR, C * BC)``."""
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool or block_mask.dim() != 2:
            raise TypeError("block_mask must be a 2-D torch.bool tensor [block_rows, block_cols]")
        br, bc = as_pair(block_size, "block_size")
        R, C = block_mask.shape
        shape = (R * br, C * bc) if shape is None else as_pair(shape, "shape")
        if (math.ceil(shape[0] / br), math.ceil(shape[1] / bc)) != (R, C):
            raise ValueError(f"shape {shape} with block_size {(br, bc)} needs a {math.ceil(shape[0] / br)} x "
                             f"{math.ceil(shape[1] / bc)} block mask, got {R} x {C}")
        device = block_mask.device if device is None else torch.device(device)
        crow, col = mask_to_csr(block_mask.to(device)[None])
        vals = torch.randn(col.numel(), br, bc, dtype=dtype, device=device, generator=generator)
        m = cls(crow[0], col, vals, shape, (br, bc), validate=False)
        m.values = m.values * m._inbounds_mask().to(dtype)
        return m

    @classmethod
    def from_dense(cls, tensor: torch.Tensor, block_size) -> "BlockSparseMatrix":
        """Keep every block with at least one nonzero element (the values are copied, not shared)."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"from_dense expects a 2-D torch.Tensor, got {got}")
        if not tensor.is_floating_point():
            raise TypeError(f"from_dense expects a floating-point tensor, got {tensor.dtype}")
        br, bc = as_pair(block_size, "block_size")
        n0, n1 = tensor.shape
        R, C = math.ceil(n0 / br), math.ceil(n1 / bc)
        padded = torch.zeros(R * br, C * bc, dtype=tensor.dtype, device=tensor.device)
        padded[:n0, :n1] = tensor.detach()
        blocks = padded.view(R, br, C, bc).permute(0, 2, 1, 3)  # [R, C, br, bc]
        keep = (blocks != 0).any(dim=-1).any(dim=-1)
        crow, col = mask_to_csr(keep[None])
        values = blocks[keep].contiguous()  # row-major over (r, c): the CSR order
        return cls(crow[0], col, values, (n0, n1), (br, bc), validate=False)

    @classmethod
    def from_scipy_bsr(cls, matrix, *, dtype=torch.float32, shape=None) -> "BlockSparseMatrix":
        """From ``scipy.sparse.bsr_matrix`` (indices sorted first). ``shape`` may crop the last block
        row/column (scipy needs multiples of the block); cropped entries must be zero."""
        import scipy.sparse as sp

        if not sp.issparse(matrix) or matrix.format != "bsr":
            raise TypeError(f"expected a scipy.sparse bsr matrix, got {type(matrix).__name__}; "
                            f"convert with .tobsr(blocksize=...)")
        m = matrix.copy()
        m.sort_indices()
        m.sum_duplicates()
        br, bc = m.blocksize
        vals = torch.as_tensor(m.data, dtype=dtype)
        return cls(torch.as_tensor(m.indptr), torch.as_tensor(m.indices), vals,
                   m.shape if shape is None else shape, (br, bc))

    @classmethod
    def from_torch_bsr(cls, tensor: torch.Tensor, *, shape=None) -> "BlockSparseMatrix":
        """From a 2-D ``torch.sparse_bsr_tensor`` (its values are shared, not copied); ``shape`` may
        crop the last block row/column (entries cropped must be zero)."""
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_bsr or tensor.dim() != 2:
            got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"expected a 2-D torch.sparse_bsr tensor, got {got}; use "
                            f"tensor.to_sparse_bsr(blocksize) or BlockSparseMatrix.from_dense")
        vals = tensor.values()
        return cls(tensor.crow_indices(), tensor.col_indices(), vals,
                   tuple(tensor.shape) if shape is None else shape, tuple(vals.shape[1:]))

    # ------------------------------------------------------------------ views and counts
    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def requires_grad(self) -> bool:
        return self.values.requires_grad

    def requires_grad_(self, flag: bool = True) -> "BlockSparseMatrix":
        self.values.requires_grad_(flag)
        return self

    @property
    def grad(self) -> "BlockSparseMatrix | None":
        """The gradient on this matrix's block pattern (``values.grad`` wrapped), or ``None``."""
        g = self.values.grad
        return None if g is None else self._with_values(g)

    def detach(self) -> "BlockSparseMatrix":
        return self._with_values(self.values.detach())

    def _with_values(self, values: torch.Tensor) -> "BlockSparseMatrix":
        out = BlockSparseMatrix(self.crow_indices, self.col_indices, values, self.shape, self.block_size,
                                validate=False)
        out._cache = self._cache  # same pattern: share the host-side bookkeeping
        return out

    @property
    def nnz_blocks(self) -> int:
        return int(self.col_indices.numel())

    @property
    def nnz(self) -> int:
        """Stored elements inside ``shape`` (padding of edge blocks excluded)."""
        if "nnz" not in self._cache:
            br, bc = self.block_size
            rows = self.row_ids()
            h = (self.shape[0] - rows * br).clamp(max=br)
            w = (self.shape[1] - self.col_indices.to(torch.int64) * bc).clamp(max=bc)
            self._cache["nnz"] = int((h * w).sum())
        return self._cache["nnz"]

    @property
    def density(self) -> float:
        return self.nnz / (self.shape[0] * self.shape[1])

    def row_ids(self) -> torch.Tensor:
        """Block row of each stored block (int64 ``[nnz_blocks]``)."""
        return csr_row_ids(self.crow_indices[None])

    def to_block_mask(self) -> torch.Tensor:
        """``bool [block_rows, block_cols]``: which blocks are stored."""
        return csr_to_mask(self.crow_indices[None], self.col_indices, self.num_block_cols)[0]

    def block_index_map(self) -> torch.Tensor:
        """``int32 [block_rows, block_cols]``: position of each block in ``values``, -1 if absent
        (cached; what the kernels gather tile addresses from)."""
        key = ("map", str(self.device))
        if key not in self._cache:
            m = torch.full((self.num_block_rows, self.num_block_cols), -1, dtype=INDEX_DTYPE,
                           device=self.device)
            if self.nnz_blocks:
                m[self.row_ids(), self.col_indices.to(torch.int64)] = torch.arange(
                    self.nnz_blocks, dtype=INDEX_DTYPE, device=self.device)
            self._cache[key] = m
        return self._cache[key]

    def transposed_indices(self):
        """``(ccol_indices [C+1], row_indices [nnz_blocks], perm [nnz_blocks])`` (cached):
        ``values[perm]`` lists the blocks in column-major (CSC) order."""
        if "csc" not in self._cache:
            ccol, row, perm = csr_transpose(self.crow_indices[None], self.col_indices, self.num_block_cols)
            self._cache["csc"] = (ccol[0], row, perm)
        return self._cache["csc"]

    def _inbounds_mask(self) -> torch.Tensor:
        """``bool [nnz_blocks, BR, BC]``: True for entries inside ``shape``."""
        br, bc = self.block_size
        r0 = (self.row_ids() * br).to(self.device)
        c0 = self.col_indices.to(torch.int64) * bc
        rows = r0[:, None] + torch.arange(br, device=self.device)[None] < self.shape[0]
        cols = c0[:, None] + torch.arange(bc, device=self.device)[None] < self.shape[1]
        return rows[:, :, None] & cols[:, None, :]

    def to_dense(self) -> torch.Tensor:
        """The dense matrix ``[shape]`` (differentiable w.r.t. ``values``: gradients land on the pattern)."""
        br, bc = self.block_size
        R, C = self.num_block_rows, self.num_block_cols
        blocks = self.values.new_zeros(R * C, br, bc)
        idx = self.row_ids() * C + self.col_indices.to(torch.int64)
        blocks = blocks.index_put((idx,), self.values)
        dense = blocks.view(R, C, br, bc).permute(0, 2, 1, 3).reshape(R * br, C * bc)
        return dense[: self.shape[0], : self.shape[1]]

    def to_scipy_bsr(self):
        """``scipy.sparse.bsr_matrix`` (float64 copy). scipy needs a shape that is a multiple of the
        block, so the shape is rounded up to whole blocks; the padding holds zeros."""
        import scipy.sparse as sp

        br, bc = self.block_size
        data = (self.values.detach() * self._inbounds_mask()).to(torch.float64).cpu().numpy()
        return sp.bsr_matrix((data, self.col_indices.cpu().numpy().astype("int32"),
                              self.crow_indices.cpu().numpy().astype("int32")),
                             shape=(self.num_block_rows * br, self.num_block_cols * bc))

    def to_torch_bsr(self) -> torch.Tensor:
        """``torch.sparse_bsr_tensor`` with int64 indices, sharing ``values``. Like scipy, PyTorch's BSR
        needs whole blocks, so the size is rounded up to whole blocks (the padding holds zeros)."""
        br, bc = self.block_size
        size = (self.num_block_rows * br, self.num_block_cols * bc)
        return torch.sparse_bsr_tensor(self.crow_indices.to(torch.int64), self.col_indices.to(torch.int64),
                                       self.values, size=size, check_invariants=False)

    def to(self, device=None, dtype=None) -> "BlockSparseMatrix":
        """A copy on ``device`` and/or in ``dtype`` (indices follow the values)."""
        vals = self.values.to(device=device, dtype=dtype)
        if vals is self.values:
            return self
        return BlockSparseMatrix(self.crow_indices.to(vals.device), self.col_indices.to(vals.device), vals,
                                 self.shape, self.block_size, validate=False)

    # ------------------------------------------------------------------ printing
    def __repr__(self) -> str:
        return (f"BlockSparseMatrix(shape={self.shape}, block_size={self.block_size}, "
                f"blocks={self.num_block_rows}x{self.num_block_cols}, nnz_blocks={self.nnz_blocks}, "
                f"nnz={self.nnz}, density={self.density:.4f}, dtype={self.dtype}, device={self.device})")

    def draw(self, limit: int = _DRAW_LIMIT) -> str:
        """The block pattern drawn with █ (stored) / ░ (zero block), truncated at ``limit``."""
        m = self.to_block_mask().cpu()
        rows = ["".join("█" if v else "░" for v in row[:limit].tolist()) + ("…" if m.shape[1] > limit else "")
                for row in m[:limit]]
        if m.shape[0] > limit:
            rows.append("⋮")
        return "\n".join(rows)

    def __str__(self) -> str:
        return repr(self) + "\n" + self.draw()
