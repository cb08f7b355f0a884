"""Float64 reference of :func:`sparse_io_attn.sparse_operands.attention`, what the tests compare both
backends with: every operand expanded to a dense float64 tensor, ``Q = A1 X``, ``h = A3 Y``, the QK
block mask expanded to elements and masked with ``-inf``
(:func:`sparse_io_attn.block_sparse.reference.masked_attention`: a query row with no key gives output
0 and lse ``-inf``, not NaN), and the five gradients by float64 autograd. A block-sparse operand's
expected gradient is the dense gradient restricted to its stored blocks (``values``-shaped), which is
what the backends return on ``values.grad``."""
from __future__ import annotations

import torch

from sparse_io_attn.block_sparse.reference import masked_attention
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.operands import dense_tensor

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


def attention_reference(A1, A2, A3, X, Y, *, qk_layout: BlockSparseLayout | None = None, scale: float = 1.0,
                        do: torch.Tensor | None = None):
    """``(out [nq, dv], lse [nq])`` in float64 (natural log), or with the output gradient ``do``
    ``(out, lse, {name: gradient})`` for the names in :data:`OPERANDS` (dense operands: dense
    gradients; a :class:`BlockSparseMatrix`: :func:`stored_blocks` of the dense gradient). Operands
    as for :func:`~sparse_io_attn.sparse_operands.attention`; ``qk_layout`` None means all keys."""
    operands = dict(zip(OPERANDS, (A1, X, A2, A3, Y)))
    leaves = {name: dense_tensor(t).detach().double().requires_grad_(do is not None) for name, t in operands.items()}
    q = leaves["A1"] @ leaves["X"]
    h = leaves["A3"] @ leaves["Y"]
    nq, nk = q.shape[0], leaves["A2"].shape[0]
    if qk_layout is None:
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    else:
        mask = qk_layout.to(q.device).to_dense_mask()[0, 0]
    out, lse = masked_attention(q[None, None], leaves["A2"][None, None], h[None, None], mask, scale)
    out, lse = out[0, 0], lse[0, 0]
    if do is None:
        return out.detach(), lse.detach()
    grads = torch.autograd.grad(out, list(leaves.values()), do.double())
    expected = {name: stored_blocks(g, operands[name]) if isinstance(operands[name], BlockSparseMatrix) else g
                for name, g in zip(OPERANDS, grads)}
    return out.detach(), lse.detach(), expected
