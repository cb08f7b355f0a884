"""The batched, multi-head form of :func:`sparse_io_attn.sparse_operands.attention`: which operand
varies along which axis, and the operands as stacked dense tensors.

Axes. ``A1, A2, A3`` vary along the batch ``B``, ``X, Y`` along the heads ``H`` (:data:`LEAD`).
Each operand is one of:

* a 2-D dense tensor or one :class:`BlockSparseMatrix`: shared by every batch element (A) or head (X, Y);
* a 3-D dense tensor ``[B, n, d]`` (A) or ``[H, d, d']`` (X, Y): one matrix per batch element or head;
* a list or tuple of ``B`` (A) or ``H`` (X, Y) :class:`BlockSparseMatrix` of one shape, block size,
  dtype and device: each batch element (e.g. sparse input activations per sequence) or head (e.g. a
  pruned weight per head) its own block pattern.

The QK layout's ``layout_batch`` is 1 or ``B`` and its ``layout_heads`` 1 or ``H``.

A call is *batched* when some operand has a leading axis (3-D, or a list) or the layout holds more
than one mask; its output is ``[B, H, nq, dv]`` (``B``/``H`` are 1 where nothing varies along them).
Otherwise it is the paper's single-head form with output ``[nq, dv]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn.layout.matrix import BlockSparseMatrix

#: operands that vary along the batch axis, and along the head axis
BATCH_OPERANDS = ("A1", "A2", "A3")
HEAD_OPERANDS = ("X", "Y")
#: the axis (``"batch"`` or ``"head"``) each operand's leading axis or list runs along
LEAD = {**{name: "batch" for name in BATCH_OPERANDS}, **{name: "head" for name in HEAD_OPERANDS}}


@dataclass(frozen=True)
class Batch:
    """``B`` batch elements, ``H`` heads; ``batched`` False for the paper's single-head 2-D form."""
    B: int
    H: int
    batched: bool

    @property
    def groups(self) -> int:
        """Number of ``(batch element, head)`` problems, ``B * H``."""
        return self.B * self.H


def is_list(t) -> bool:
    """``t`` is a list/tuple of :class:`BlockSparseMatrix`, one per batch element or head."""
    return isinstance(t, (list, tuple))


def leading(t) -> int | None:
    """Size of ``t``'s leading (batch or head) axis; None when ``t`` is one shared 2-D matrix."""
    if is_list(t):
        return len(t)
    if isinstance(t, torch.Tensor) and t.dim() == 3:
        return t.shape[0]
    return None


def first(t):
    """A representative 2-D matrix of ``t`` (its first head/batch element): shape, dtype, device,
    block size."""
    return t[0] if is_list(t) else t


def matrix_shape(t) -> tuple:
    """``(rows, cols)`` of each matrix ``t`` holds."""
    return tuple(first(t).shape[-2:])


def dense_stack(t) -> torch.Tensor:
    """``t`` as a dense ``[L, rows, cols]`` tensor (``L`` = 1 for a shared matrix), differentiable
    w.r.t. the dense data or the ``values`` of every :class:`BlockSparseMatrix` (their gradients land
    on their own block patterns). A list's matrices are scattered in one indexed write."""
    if isinstance(t, torch.Tensor):
        return t if t.dim() == 3 else t[None]
    if isinstance(t, BlockSparseMatrix):
        return t.to_dense()[None]
    m0 = t[0]
    br, bc = m0.block_size
    R, C = m0.num_block_rows, m0.num_block_cols
    values = torch.cat([m.values for m in t])
    dev = values.device
    which = torch.cat([torch.full((m.nnz_blocks,), i, dtype=torch.int64, device=dev) for i, m in enumerate(t)])
    rows = torch.cat([m.row_ids().to(dev) for m in t])
    cols = torch.cat([m.col_indices.to(device=dev, dtype=torch.int64) for m in t])
    blocks = values.new_zeros(len(t) * R * C, br, bc).index_put(((which * R + rows) * C + cols,), values)
    dense = blocks.view(len(t), R, C, br, bc).permute(0, 1, 3, 2, 4).reshape(len(t), R * br, C * bc)
    return dense[:, : m0.shape[0], : m0.shape[1]]


def expand(t: torch.Tensor, batch: Batch, axis: str) -> torch.Tensor:
    """A stacked ``[L, r, c]`` operand as a ``[B, H, r, c]`` view (``axis``: ``"batch"`` or ``"head"``)."""
    r, c = t.shape[-2:]
    four = t[:, None] if axis == "batch" else t[None]
    return four.expand(batch.B, batch.H, r, c)


def squeeze(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B, H, ...]`` results back to the caller's form: ``[...]`` for the single-head 2-D call."""
    return out if batch.batched else out[0, 0]
