"""Float64 reference of :func:`sparse_io_attn.sparse_operands.attention`, what the tests compare both
backends with: every operand expanded to a dense float64 tensor, ``Q = A1 X``, ``h = A3 Y`` per
``(batch element, head)``, the QK block mask expanded to elements and masked with ``-inf``
(:func:`sparse_io_attn._attention.reference.masked_attention`: a query row with no key gives output
0 and lse ``-inf``, not NaN), and the five gradients by float64 autograd. A block-sparse operand's
expected gradient is the dense gradient restricted to its stored blocks (``values``-shaped; a
list of matrices, per batch element or per head, gets a list), which is what the backends return on
each matrix's ``values.grad``.
Operands shared along an axis get the gradient summed over that axis (autograd of the broadcast)."""
from __future__ import annotations

import torch

from sparse_io_attn._attention.reference import masked_attention
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.batch import dense_stack, is_list, squeeze
from sparse_io_attn.sparse_operands.operands import check_batch
from sparse_io_attn.sparse_operands.torch_path import products, qk_mask

#: the operands in the order :func:`attention_reference` returns their gradients
OPERANDS = ("A1", "X", "A2", "A3", "Y")


def stored_blocks(dense: torch.Tensor, m: BlockSparseMatrix) -> torch.Tensor:
    """The blocks of ``dense`` (``m.shape``) at ``m``'s stored positions, ``values``-shaped
    ``[nnz_blocks, BR, BC]``; entries of edge blocks outside ``m.shape`` are 0."""
    br, bc = m.block_size
    padded = dense.new_zeros(m.num_block_rows * br, m.num_block_cols * bc)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    blocks = padded.view(m.num_block_rows, br, m.num_block_cols, bc).permute(0, 2, 1, 3)
    return blocks[m.row_ids(), m.col_indices.long()]


def _leaf(t) -> torch.Tensor:
    """The float64 dense leaf of an operand: its own shape for dense tensors and a single matrix,
    ``[L, r, c]`` for a list of ``L`` matrices (one per batch element or head)."""
    if isinstance(t, torch.Tensor):
        return t.detach().double()
    if is_list(t):
        return dense_stack([m.detach() for m in t]).double()
    return t.detach().to_dense().double()


def _expected(g: torch.Tensor, t):
    if is_list(t):
        return [stored_blocks(g[i], m) for i, m in enumerate(t)]
    return stored_blocks(g, t) if isinstance(t, BlockSparseMatrix) else g


def attention_reference(A1, A2, A3, X, Y, *, qk_layout: BlockSparseLayout | None = None, scale: float = 1.0,
                        do: torch.Tensor | None = None):
    """``(out, lse)`` in float64 (natural log), or with the output gradient ``do`` ``(out, lse,
    {name: gradient})`` for the names in :data:`OPERANDS` (dense operands: dense gradients of their
    shape; a :class:`BlockSparseMatrix`: :func:`stored_blocks` of the dense gradient; a list (per
    batch element or per head): a list of those). Shapes as
    :func:`~sparse_io_attn.sparse_operands.attention` returns them (``[nq, dv]`` for the single-head
    form, ``[B, H, nq, dv]`` batched); operands as it takes them; ``qk_layout`` None means all keys."""
    batch = check_batch(A1, A2, A3, X, Y, qk_layout)
    operands = dict(zip(OPERANDS, (A1, X, A2, A3, Y)))
    leaves = {name: _leaf(t).requires_grad_(do is not None) for name, t in operands.items()}
    stacked = {name: (v if v.dim() == 3 else v[None]) for name, v in leaves.items()}
    q, k, h = products(*(stacked[n] for n in OPERANDS), batch)
    mask = qk_mask(qk_layout, q.device)
    out, lse = masked_attention(q, k, h, mask, scale)
    out, lse = squeeze(out, batch), squeeze(lse, batch)
    if do is None:
        return out.detach(), lse.detach()
    grads = torch.autograd.grad(out, list(leaves.values()), do.double())
    expected = {name: _expected(g, operands[name]) for name, g in zip(OPERANDS, grads)}
    return out.detach(), lse.detach(), expected
