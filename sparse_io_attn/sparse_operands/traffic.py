"""Exact traffic model of the :mod:`sparse_io_attn.sparse_operands` Triton kernels.

:func:`predict_traffic` returns a ``TrafficReport(source="predicted")`` with the same kernel and
tensor names, byte for byte, as an :class:`~sparse_io_attn.accounting.IOCounter` around
``paper.attention(..., backend="triton")`` (and its backward), computed from block patterns and
shapes only, so it reaches sizes the interpreter cannot run.

Per-program terms (``rows(i)``/``keys(j)``: in-bounds rows of query/key block; ``w(S)``: in-bounds
head-dim columns of the d-tiles in set ``S``; ``Pq[i]``, ``Pa2[j]``: stored d-tiles of the row
blocks of ``Q = A1 X`` and ``A2``; ``es``: element size; indices are 4-byte int32):

* forward, query block ``i``: q ``rows(i) w(Pq[i])``; per kept ``(i, j)``: a2 ``keys(j) w(Pq[i] & Pa2[j])``,
  h ``keys(j) dv``, one block-map row; per structurally zero ``(i, j)``: one fp32 ``hsum`` row.
* backward dkv, key block ``j``: a2 and h once; per kept ``(i, j)``: q ``rows(i) w(Pq[i] & Pa2[j])``,
  dO, lse, delta; per zero ``(i, j)``: one fp32 ``w`` row. dq, query block ``i``: q, dO, lse, delta
  once; per kept ``(i, j)``: a2 ``keys(j) w(Pq[i] & Pa2[j])`` and h.
* products ``C = A B`` (one program per row block ``i`` of C): per pair ``(i, k)`` the A tile and
  B's row ``k`` on the column tiles stored in both ``B[k, :]`` and ``C[i, :]``; one C row panel.

Block maps are read as whole rows (``4 * num_d_tiles`` bytes, one int32 tile id per d-tile) even
though only the d-tiles stored in both operands are then read and multiplied
(:mod:`sparse_io_attn.sparse_operands.flops` is the matching model of the multiply-adds).

The ``*_TENSORS`` tuples name each kernel's tensors in counter-slot order: the launcher names the
counter's tensors with them and :mod:`sparse_io_attn.sparse_operands.triton.slots` turns them into the
kernels' named slots. The row-panel product's counter names its tensors after its operands (the
product's ``a``, ``b``, ``c``; ``hsum`` for the column sums of ``H = A3 Y``), in
:data:`MATMUL_TENSORS` order.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.tally.report import TrafficReport
from sparse_io_attn.sparse_operands.problem import Problem, build_problem, gradient_products
from sparse_io_attn.sparse_operands.operands import Operand, check_operands, dense_operand
from sparse_io_attn.sparse_operands.plan import ProductPlan, product_plan

MATMUL_TENSORS = ("a", "b", "c", "colsum", "plan")
FWD_TENSORS = ("q", "a2", "h", "hsum", "o", "lse", "q_map", "a2_map", "layout")
PREPROCESS_TENSORS = ("o", "do", "lse", "delta", "w")
DKV_TENSORS = ("q", "a2", "h", "do", "lse", "delta", "w", "da2", "dh", "q_map", "a2_map", "layout")
DQ_TENSORS = ("q", "a2", "h", "do", "lse", "delta", "dq", "q_map", "a2_map", "layout")


def _extent(total: int, block: int, count: int) -> torch.Tensor:
    """In-bounds length of each of ``count`` blocks of size ``block`` over ``total`` (int64)."""
    return (total - torch.arange(count, dtype=torch.int64) * block).clamp(max=block)


def _matmul(rep: TrafficReport, kernel: str, A: Operand, B: Operand, C: Operand, plan: ProductPlan,
            colsum: bool = False) -> None:
    """Row-panel product ``C = A B``: per pair ``(i, k)`` one A tile and B's row ``k`` on the column
    tiles stored in both ``B[k, :]`` and ``C[i, :]``; per row block ``i`` one C panel on its stored
    tiles. Index bytes ("plan"): per row block 2 pointers + C's block-map row, per pair 2 ints + B's
    block-map row."""
    if plan.num_rows == 0:
        return
    rows = _extent(A.shape[0], A.block[0], A.block_map.shape[0])
    kw = _extent(A.shape[1], A.block[1], A.block_map.shape[1])
    nct = C.block_map.shape[1]
    cw = _extent(C.shape[1], C.block[1], nct)
    cpres = (C.block_map >= 0).cpu().long()
    bpres = (B.block_map >= 0).cpu().long()
    pi, pk = plan.pairs()
    both_w = (cpres[pi] * bpres[pk]) @ cw  # [pairs]
    c_w = cpres @ cw  # [I]
    reads = {A.name: int((rows[pi] * kw[pk]).sum()) * A.element_size,
             B.name: int((kw[pk] * both_w).sum()) * B.element_size,
             "plan": plan.num_rows * (8 + 4 * nct) + plan.num_pairs * (8 + 4 * nct)}
    writes = {C.name: int((rows * c_w).sum()) * C.element_size}
    if colsum:
        writes["hsum"] = 4 * int(c_w.sum())
    rep.add(kernel, reads, writes)


def _attention_terms(rep: TrafficReport, p: Problem, dv: int, es: int, backward: bool) -> None:
    nq, nk, d2 = p.A1.shape[0], p.A2.shape[0], p.X.shape[1]
    bm, bn, bd = p.blocks.m, p.blocks.n, p.blocks.d2
    nqb, nd = p.q_map.shape
    nkb = p.A2.block_map.shape[0]
    rows, keys, wd = _extent(nq, bm, nqb), _extent(nk, bn, nkb), _extent(d2, bd, nd)
    pq = (p.q_map >= 0).cpu().long()
    pa2 = p.A2.pattern.cpu().long()
    q_cols = pq @ wd  # [nqb]
    a2_cols = pa2 @ wd  # [nkb]
    both = (pq[:, None, :] * pa2[None, :, :]) @ wd  # [nqb, nkb]
    kept = p.plan.kept_mask.cpu().long()
    zero = p.plan.zero_mask.cpu().long()
    hz = p.plan.has_zero
    kept_r, kept_c = kept.sum(1), kept.sum(0)
    zero_r, zero_c = zero.sum(1), zero.sum(0)
    n_rows, n_keys = int(rows.sum()), int(keys.sum())
    map_row = 4 * nd

    def tot(x) -> int:
        return int(x.sum()) if isinstance(x, torch.Tensor) else int(x)

    rep.add("paper_attn_fwd", {
        "q": tot(rows * q_cols) * es,
        "a2": tot(kept * both * keys[None, :]) * es,
        "h": tot(kept_c * keys) * dv * es,
        "hsum": tot(zero_r) * dv * 4 if hz else 0,
        "q_map": map_row * nqb,
        "a2_map": map_row * tot(kept_r),
        "layout": 8 * nqb + 4 * tot(kept_r) + ((8 * nqb + 4 * tot(zero_r)) if hz else 0),
    }, {"o": n_rows * dv * es, "lse": n_rows * 4})
    if not backward:
        return
    rep.add("paper_attn_bwd_preprocess", {
        "o": n_rows * dv * es, "do": n_rows * dv * es, "lse": n_rows * 4 if hz else 0,
    }, {"delta": n_rows * 4, "w": nqb * dv * 4 if hz else 0})
    kept_rows = tot(kept * rows[:, None])  # query rows streamed, summed over kept blocks
    rep.add("paper_attn_bwd_dkv", {
        "q": tot(kept * both * rows[:, None]) * es,
        "a2": tot(keys * a2_cols) * es,
        "h": n_keys * dv * es,
        "do": kept_rows * dv * es, "lse": kept_rows * 4, "delta": kept_rows * 4,
        "w": tot(zero_c) * dv * 4 if hz else 0,
        "q_map": map_row * tot(kept_c),
        "a2_map": map_row * nkb,
        "layout": 8 * nkb + 4 * tot(kept_c) + ((8 * nkb + 4 * tot(zero_c)) if hz else 0),
    }, {"da2": tot(keys * a2_cols) * es, "dh": n_keys * dv * es})
    rep.add("paper_attn_bwd_dq", {
        "q": tot(rows * q_cols) * es,
        "a2": tot(kept * both * keys[None, :]) * es,
        "h": tot(kept_c * keys) * dv * es,
        "do": n_rows * dv * es, "lse": n_rows * 4, "delta": n_rows * 4,
        "q_map": map_row * nqb, "a2_map": map_row * tot(kept_r),
        "layout": 8 * nqb + 4 * tot(kept_r),
    }, {"dq": tot(rows * q_cols) * es})


def products(p: Problem, dv: int, *, backward: bool = True, needs=(True, True, True, True, True)) -> list:
    """The row-panel products of one call, in launch order: ``(kernel, A, B, C, plan, colsum)``
    (``Q = A1 X`` and ``H = A3 Y`` forward; ``dA1, dX, dA3, dY`` backward where ``needs``)."""
    Q = Operand("q", p.A1.data, (p.A1.shape[0], p.X.shape[1]), (p.blocks.m, p.blocks.d2), p.q_map, 1, 0, 0, 0, 0,
                True)
    H = dense_operand("h", torch.empty(p.A3.shape[0], dv, dtype=p.A3.data.dtype), (p.blocks.n, p.blocks.dv))
    out = [("paper_q", p.A1, p.X, Q, product_plan(p.A1.block_map, p.X.block_map, p.q_map), False),
           ("paper_h", p.A3, p.Y, H, product_plan(p.A3.block_map, p.Y.block_map, H.block_map), p.plan.has_zero)]
    if backward:
        for name, res, a, b in gradient_products(p.A1, p.X, p.A3, p.Y, _renamed(Q, "dq"), _renamed(H, "dh"), needs):
            out.append((f"paper_{name}", a, b, _renamed(res, name),
                        product_plan(a.block_map, b.block_map, res.block_map), False))
    return out


def predict(p: Problem, dv: int, *, backward: bool = True, needs=(True, True, True, True, True)) -> TrafficReport:
    """The traffic of one forward (and backward) call on problem ``p`` (see the module docstring)."""
    rep = TrafficReport(source="predicted")
    prods = products(p, dv, backward=backward, needs=needs)
    for kernel, A, B, C, plan, colsum in prods[:2]:
        _matmul(rep, kernel, A, B, C, plan, colsum=colsum)
    _attention_terms(rep, p, dv, p.A1.element_size, backward)
    for kernel, A, B, C, plan, colsum in prods[2:]:
        _matmul(rep, kernel, A, B, C, plan, colsum=colsum)
    return rep


def _renamed(op: Operand, name: str) -> Operand:
    return replace(op, name=name)


def predict_traffic(A1, A2, A3, X, Y, *, qk_layout=None, backward: bool = True) -> TrafficReport:
    """Predicted bytes of ``paper.attention(A1, A2, A3, X, Y, qk_layout=..., backend="triton")``
    (plus its backward when ``backward``, all five gradients), per kernel and tensor. Operands as for
    :func:`~sparse_io_attn.sparse_operands.attention`; only their shapes, dtypes and block patterns are used."""
    blocks, dtype, device = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    p = build_problem(A1, A2, A3, X, Y, qk_layout, blocks)
    return predict(p, Y.shape[1], backward=backward)


def kernel_fast_memory_words(A1, A2, A3, X, Y, *, qk_layout=None) -> int:
    """Fast memory (words) the counted algorithm uses: the largest per-program working set of the
    kernels, counting every register tile a program holds at once (padded sizes; ``D``: the head
    dimension rounded up to whole d-tiles, ``NUM_D_TILES * BLOCK_D``, held as per-d-tile tiles):

    * forward: ``q, acc [BM, D|DV] + a2, h [BN, D|DV] + s [BM, BN] + m, l [BM] + hsum row [DV]``;
    * backward dkv: ``a2, da2 [BN, D] + h, dh [BN, DV] + q [BM, D] + dO [BM, DV] + s/p, dp, ds
      [BM, BN] + lse, delta [BM]`` (the largest);
    * backward dq: ``q, dq [BM, D] + dO [BM, DV] + a2 [BN, D] + h [BN, DV] + 3 [BM, BN] + 2 [BM]``;
    * products (row panels): ``A [BM, BK] + B [BK, N] + C [BM, N]`` (``N``: C's width rounded up
      to whole column tiles).

    This is the ``M`` at which Theorem 4.5 is evaluated against counted traffic: each program
    moves its data between global memory and a private fast memory of this size.
    """
    blocks, _, _ = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    bm, bn = blocks.m, blocks.n
    D, DV = -(-X.shape[1] // blocks.d2) * blocks.d2, padded_dim(Y.shape[1])
    fwd = bm * D + bm * DV + bn * D + bn * DV + bm * bn + 2 * bm + DV
    dkv = 2 * bn * D + 2 * bn * DV + bm * D + bm * DV + 3 * bm * bn + 2 * bm
    dq = 2 * bm * D + bm * DV + bn * D + bn * DV + 3 * bm * bn + 2 * bm

    def panel(bi, bk, ncols, bc):  # A tile, one B tile per column tile, one C accumulator per column tile
        width = -(-ncols // bc) * bc
        return bi * bk + bk * width + bi * width

    d1, d2, d3, dv = X.shape[0], X.shape[1], A3.shape[1], Y.shape[1]
    b = blocks
    mm = max(panel(bm, b.d1, d2, b.d2), panel(bn, b.d3, dv, b.dv),  # Q = A1 X, H = A3 Y
             panel(bm, b.d2, d1, b.d1), panel(b.d1, bm, d2, b.d2),  # dA1 = dQ X^T, dX = A1^T dQ
             panel(bn, b.dv, d3, b.d3), panel(b.d3, bn, dv, b.dv))  # dA3 = dH Y^T, dY = A3^T dH
    return max(fwd, dkv, dq, mm)
