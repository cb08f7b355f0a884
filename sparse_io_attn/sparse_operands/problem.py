"""The structure of one call of :func:`sparse_io_attn.sparse_operands.attention`, shared by the
launchers, the traffic model and the multiply-add model: operand templates (addressing and block
maps), the block pattern of ``Q = A1 X`` and the score plan. Built on the host from block patterns
only (no operand values are read)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.sparse_operands.operands import Blocks, Operand, as_operand
from sparse_io_attn.sparse_operands.plan import AttentionPlan, attention_plan, structural_product


@dataclass
class Problem:
    """Structure of one call: the five operands as the kernels address them, ``q_map`` (tile id of
    each stored block of ``Q = A1 X``, -1 where the block product is structurally zero), ``nnz_q``
    (stored blocks of Q), the score plan and the block sizes."""
    A1: Operand
    X: Operand
    A2: Operand
    A3: Operand
    Y: Operand
    q_map: torch.Tensor
    nnz_q: int
    plan: AttentionPlan
    blocks: Blocks


def build_problem(A1, A2, A3, X, Y, qk_layout: BlockSparseLayout | None, blocks: Blocks) -> Problem:
    """The :class:`Problem` of validated operands (``blocks`` from
    :func:`~sparse_io_attn.sparse_operands.operands.check_operands`); ``qk_layout`` on the operands'
    device or None (all keys)."""
    ops = dict(A1=as_operand("a1", A1, (blocks.m, blocks.d1)), X=as_operand("x", X, (blocks.d1, blocks.d2)),
               A2=as_operand("a2", A2, (blocks.n, blocks.d2)), A3=as_operand("a3", A3, (blocks.n, blocks.d3)),
               Y=as_operand("y", Y, (blocks.d3, blocks.dv)))
    q_pattern = structural_product(ops["A1"].pattern, ops["X"].pattern)
    q_map = torch.full(q_pattern.shape, -1, dtype=torch.int32, device=q_pattern.device)
    nnz_q = int(q_pattern.sum())
    q_map[q_pattern] = torch.arange(nnz_q, dtype=torch.int32, device=q_pattern.device)
    qk_mask = None if qk_layout is None else qk_layout.to_block_mask()[0, 0]
    plan = attention_plan(q_pattern, ops["A2"].pattern, qk_mask)
    return Problem(q_map=q_map, nnz_q=nnz_q, plan=plan, blocks=blocks, **ops)


def gradient_products(A1: Operand, X: Operand, A3: Operand, Y: Operand, dQ: Operand, dH: Operand,
                      needs=(True, True, True, True, True)) -> list[tuple[str, Operand, Operand, Operand]]:
    """The backward pass's products, in launch order: ``(name, operand, a, b)``, the gradient of
    ``operand`` being ``a @ b`` on ``operand``'s own block pattern: ``da1 = dQ X^T``,
    ``dx = A1^T dQ``, ``da3 = dH Y^T``, ``dy = A3^T dH``; only those whose flag in ``needs``
    (for A1, X, A2, A3, Y) is set."""
    listed = ((0, "da1", A1, dQ, X.t()), (1, "dx", X, A1.t(), dQ), (3, "da3", A3, dH, Y.t()), (4, "dy", Y, A3.t(), dH))
    return [(name, operand, a, b) for flag, name, operand, a, b in listed if needs[flag]]
