"""The structure of one call of :func:`sparse_io_attn.sparse_operands.attention`, shared by the
launchers, the traffic model and the multiply-add model: operand templates (addressing and block
maps, per ``(batch element, head)`` group), the block patterns of ``Q = A1 X`` and the score plans.
Built on the host from block patterns only (no operand values are read). Plans are built once per
distinct pattern (groups sharing a pattern share a plan) and concatenated for the kernels, which
run every group of a call in one launch (grid axis 1 = ``b * H + h``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.sparse_operands.batch import LEAD, Batch
from sparse_io_attn.sparse_operands.operands import Blocks, Operand, as_operand, dense_map, group_index
from sparse_io_attn.sparse_operands.plan import (GroupPlans, attention_plan, first_equal, group_plans, product_plan,
                                                 stack_attention_plans, stack_product_plans, structural_product)


@dataclass
class Problem:
    """Structure of one call: the five operands as the kernels address them, ``q_map`` (``int32
    [Bq, Hq, nqb, nd]``: tile id of each stored block of ``Q = A1 X``, -1 where the block product
    is structurally zero; ``Bq`` is 1 unless A1's pattern varies along the batch (a list), ``Hq`` 1
    unless X's varies along the heads), ``nnz_q`` (the most stored blocks of one group's Q), the
    score plans of the groups (keyed ``(q_map index, A2 map index, QK mask index)``), the block sizes
    and the batch."""
    A1: Operand
    X: Operand
    A2: Operand
    A3: Operand
    Y: Operand
    q_map: torch.Tensor
    nnz_q: int
    plans: GroupPlans
    blocks: Blocks
    batch: Batch

    @property
    def plan(self):
        """The concatenated score plan the kernels read."""
        return self.plans.plan

    def groups(self):
        """``(b, h)`` of every group, in grid order."""
        return [divmod(g, self.batch.H) for g in range(self.batch.groups)]


def build_problem(A1, A2, A3, X, Y, qk_layout: BlockSparseLayout | None, blocks: Blocks, batch: Batch,
                  data=None) -> Problem:
    """The :class:`Problem` of validated operands (``blocks`` from
    :func:`~sparse_io_attn.sparse_operands.operands.check_operands`, ``batch`` from ``check_batch``);
    ``qk_layout`` on the operands' device or None (all keys); ``data``: the tensors (dense data or
    BSR ``values``, a list's values concatenated) of A1, X, A2, A3, Y to address instead of the
    operands' own."""
    data = data or (None,) * 5
    ops = dict(A1=as_operand("a1", A1, (blocks.m, blocks.d1), LEAD["A1"], data[0]),
               X=as_operand("x", X, (blocks.d1, blocks.d2), LEAD["X"], data[1]),
               A2=as_operand("a2", A2, (blocks.n, blocks.d2), LEAD["A2"], data[2]),
               A3=as_operand("a3", A3, (blocks.n, blocks.d3), LEAD["A3"], data[3]),
               Y=as_operand("y", Y, (blocks.d3, blocks.dv), LEAD["Y"], data[4]))
    # [Ba1, 1, nqb, nd1] x [1, Hx, nd1, nd] -> [Bq, Hq, nqb, nd]: one Q pattern per (A1, X) pattern pair
    q_pattern = structural_product(ops["A1"].pattern, ops["X"].pattern)
    flat = q_pattern.flatten(2)
    ids = flat.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1  # row-major tile ids per Q pattern
    q_map = torch.where(flat, ids, -1).view(q_pattern.shape).to(torch.int32)
    nnz_q = int(flat.sum(-1).max()) if flat.numel() else 0
    masks = None if qk_layout is None else qk_layout.to_block_mask()
    A2op = ops["A2"]
    same_q, same_a2 = first_equal(q_pattern), first_equal(A2op.pattern)
    same_qk = None if masks is None else first_equal(masks)

    def key(b, h):  # groups on equal patterns share a part
        iqk = None if masks is None else same_qk[group_index(masks, b, h)]
        return same_q[group_index(q_map, b, h)], same_a2[A2op.map_index(b, h)], iqk

    def build(k):
        iq, ia2, iqk = k
        return attention_plan(q_pattern[iq], A2op.pattern[ia2], None if iqk is None else masks[iqk])

    keys = [key(*divmod(g, batch.H)) for g in range(batch.groups)]
    plans = group_plans(keys, build, stack_attention_plans, q_pattern.device)
    return Problem(q_map=q_map, nnz_q=nnz_q, plans=plans, blocks=blocks, batch=batch, **ops)


def product_plans(A: Operand, B: Operand, C: Operand, batch: Batch) -> GroupPlans:
    """The row-panel plans of ``C = A B`` for every group: one :func:`product_plan` per distinct
    triple of block maps (tile ids included: the plan lists A's)."""
    same = [first_equal(op.block_map) for op in (A, B, C)]

    def key(b, h):
        return tuple(s[op.map_index(b, h)] for s, op in zip(same, (A, B, C)))

    def build(k):
        ia, ib, ic = k
        return product_plan(A.block_map[ia], B.block_map[ib], C.block_map[ic])

    keys = [key(*divmod(g, batch.H)) for g in range(batch.groups)]
    return group_plans(keys, build, stack_product_plans, A.block_map.device)


def q_operand(p: Problem, data: torch.Tensor | None = None) -> Operand:
    """``Q = A1 X`` of every group as a BSR operand over ``data`` (``[B, H, nnz_q, BM, BD]``;
    allocated uninitialised when None) on ``p.q_map``."""
    bm, bd = p.blocks.m, p.blocks.d2
    if data is None:
        data = torch.empty(p.batch.B, p.batch.H, p.nnz_q, bm, bd, dtype=p.A1.data.dtype, device=p.A1.data.device)
    return Operand("q", data, (p.A1.shape[0], p.X.shape[1]), (bm, bd), p.q_map, 1, data.stride(2), 0,
                   data.stride(3), data.stride(4), True, s_gb=data.stride(0), s_gh=data.stride(1))


def h_operand(p: Problem, data: torch.Tensor | None = None) -> Operand:
    """``H = A3 Y`` of every group, dense ``[B, H, nk, dv]`` (allocated uninitialised when None)."""
    nk, dv = p.A3.shape[0], p.Y.shape[1]
    if data is None:
        data = torch.empty(p.batch.B, p.batch.H, nk, dv, dtype=p.A3.data.dtype, device=p.A3.data.device)
    bn, bv = p.blocks.n, p.blocks.dv
    R, C = -(-nk // bn), -(-dv // bv)
    return Operand("h", data, (nk, dv), (bn, bv), dense_map(R, C, data.device), C, bn * data.stride(2),
                   bv * data.stride(3), data.stride(2), data.stride(3), False, s_gb=data.stride(0),
                   s_gh=data.stride(1))


def gradient_products(A1: Operand, X: Operand, A3: Operand, Y: Operand, dQ: Operand, dH: Operand,
                      needs=(True, True, True, True, True)) -> list[tuple[str, Operand, Operand, Operand]]:
    """The backward pass's products, in launch order: ``(name, operand, a, b)``, the gradient of
    ``operand`` being ``a @ b`` on ``operand``'s own block pattern: ``da1 = dQ X^T``,
    ``dx = A1^T dQ``, ``da3 = dH Y^T``, ``dy = A3^T dH``; only those whose flag in ``needs``
    (for A1, X, A2, A3, Y) is set."""
    listed = ((0, "da1", A1, dQ, X.t()), (1, "dx", X, A1.t(), dQ), (3, "da3", A3, dH, Y.t()), (4, "dy", Y, A3.t(), dH))
    return [(name, operand, a, b) for flag, name, operand, a, b in listed if needs[flag]]
