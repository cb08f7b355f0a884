"""Exact traffic model of the :mod:`sparse_io_attn.sparse_operands` Triton kernels.

:func:`predict_traffic` returns a ``TrafficReport(source="predicted")`` with the same kernel and
tensor names, byte for byte, as an :class:`~sparse_io_attn.accounting.IOCounter` around
``sparse_operands.attention(..., backend="triton")`` (and its backward), computed from block patterns and
shapes only, so it reaches sizes the interpreter cannot run.

Per-program terms (``rows(i)``/``keys(j)``: in-bounds rows of query/key block; ``w(S)``: in-bounds
head-dim columns of the d-tiles in set ``S``; ``Pq[i]``, ``Pa2[j]``: stored d-tiles of the row
blocks of ``Q = A1 X`` and ``A2``; ``es``: element size; indices are 4-byte int32):

* forward, query block ``i``: q ``rows(i) w(Pq[i])``; per kept ``(i, j)``: a2 ``keys(j) w(Pq[i] & Pa2[j])``,
  h ``keys(j) dv``, one block-map row; per structurally zero ``(i, j)``: one fp32 ``hsum`` row.
* backward dkv, key block ``j``: a2 and h once; per kept ``(i, j)``: q ``rows(i) w(Pq[i] & Pa2[j])``,
  dO, lse, delta, and per slice of the query block (``BLOCK_M / BLOCK_M_SUB`` of them,
  :func:`~sparse_io_attn.sparse_operands.triton.configs.dkv_query_slice`) its row id and Q
  block-map row; per zero ``(i, j)``: one fp32 ``w`` row. dq, query block ``i``: q, dO, lse, delta
  once; per kept ``(i, j)``: a2 ``keys(j) w(Pq[i] & Pa2[j])`` and h.
* products ``C = A B`` (one program per row block ``i`` of C): per pair ``(i, k)`` the A tile and
  B's row ``k`` on the column tiles stored in both ``B[k, :]`` and ``C[i, :]``; one C row panel.

Batched calls: every term is per ``(batch element, head)`` group (its own Q pattern, A2 pattern and
score plan) and summed over the groups; each program of the attention kernels and the products also
reads its group's plan id (4 bytes, in ``layout`` / ``plan``). The per-group gradients the launcher
sums over a shared axis with torch are outside the kernels and not counted.

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
from sparse_io_attn.sparse_operands.batch import matrix_shape
from sparse_io_attn.sparse_operands.problem import (Problem, build_problem, gradient_products, h_operand, product_plans,
                                                    q_operand)
from sparse_io_attn.sparse_operands.operands import Operand, check_batch, check_operands
from sparse_io_attn.sparse_operands.plan import GroupPlans
from sparse_io_attn.sparse_operands.triton.configs import dkv_query_slice

MATMUL_TENSORS = ("a", "b", "c", "colsum", "plan")
FWD_TENSORS = ("q", "a2", "h", "hsum", "o", "lse", "q_map", "a2_map", "layout")
PREPROCESS_TENSORS = ("o", "do", "lse", "delta", "w")
DKV_TENSORS = ("q", "a2", "h", "do", "lse", "delta", "w", "da2", "dh", "q_map", "a2_map", "layout")
DQ_TENSORS = ("q", "a2", "h", "do", "lse", "delta", "dq", "q_map", "a2_map", "layout")


def _extent(total: int, block: int, count: int) -> torch.Tensor:
    """In-bounds length of each of ``count`` blocks of size ``block`` over ``total`` (int64)."""
    return (total - torch.arange(count, dtype=torch.int64) * block).clamp(max=block)


class _Tally:
    """Bytes per kernel and tensor, summed over the groups of a call; one launch per kernel."""

    def __init__(self):
        self.kernels: dict = {}

    def add(self, kernel: str, reads: dict, writes: dict, times: int = 1) -> None:
        r, w = self.kernels.setdefault(kernel, ({}, {}))
        for acc, new in ((r, reads), (w, writes)):
            for name, b in new.items():
                acc[name] = acc.get(name, 0) + int(b) * times

    def into(self, rep: TrafficReport) -> None:
        for kernel, (r, w) in self.kernels.items():
            rep.add(kernel, r, w)


def _parts(plans: GroupPlans, group: int | None):
    """``(plan, groups using it, key)`` of every distinct plan, or of group ``group``'s alone."""
    if group is None:
        return list(zip(plans.parts, plans.counts, plans.keys))
    i = int(plans.ids[group])
    return [(plans.parts[i], 1, plans.keys[i])]


def _matmul(tally: _Tally, kernel: str, A: Operand, B: Operand, C: Operand, plans: GroupPlans,
            colsum: bool = False, group: int | None = None) -> None:
    """Row-panel product ``C = A B``, per group: per pair ``(i, k)`` one A tile and B's row ``k`` on
    the column tiles stored in both ``B[k, :]`` and ``C[i, :]``; per row block ``i`` one C panel on
    its stored tiles. Index bytes ("plan"): per row block the group's plan id, 2 pointers and C's
    block-map row, per pair 2 ints + B's block-map row."""
    nrows = C.grid[0]
    if nrows == 0:
        return
    rows = _extent(A.shape[0], A.block[0], A.grid[0])
    kw = _extent(A.shape[1], A.block[1], A.grid[1])
    nct = C.grid[1]
    cw = _extent(C.shape[1], C.block[1], nct)
    for plan, count, (_, ib, ic) in _parts(plans, group):
        cpres = (C.block_map[ic] >= 0).cpu().long()
        bpres = (B.block_map[ib] >= 0).cpu().long()
        pi, pk = plan.pairs()
        both_w = (cpres[pi] * bpres[pk]) @ cw  # [pairs]
        c_w = cpres @ cw  # [I]
        reads = {A.name: int((rows[pi] * kw[pk]).sum()) * A.element_size,
                 B.name: int((kw[pk] * both_w).sum()) * B.element_size,
                 "plan": plan.num_rows * (12 + 4 * nct) + plan.num_pairs * (8 + 4 * nct)}
        writes = {C.name: int((rows * c_w).sum()) * C.element_size}
        if colsum:
            writes["hsum"] = 4 * int(c_w.sum())
        tally.add(kernel, reads, writes, count)


def _attention_terms(tally: _Tally, p: Problem, dv: int, es: int, backward: bool, group: int | None = None) -> None:
    nq, nk, d2 = p.A1.shape[0], p.A2.shape[0], p.X.shape[1]
    bm, bn, bd = p.blocks.m, p.blocks.n, p.blocks.d2
    nqb, nd = p.q_map.shape[-2:]
    nkb = p.A2.grid[0]
    rows, keys, wd = _extent(nq, bm, nqb), _extent(nk, bn, nkb), _extent(d2, bd, nd)
    hz = p.plan.has_zero
    n_rows, n_keys = int(rows.sum()), int(keys.sum())
    map_row = 4 * nd
    G = p.batch.groups if group is None else 1
    dkv_slices = bm // dkv_query_slice(bm, nd * bd)

    def tot(x) -> int:
        return int(x.sum()) if isinstance(x, torch.Tensor) else int(x)

    for part, count, (iq, ia2, _) in _parts(p.plans, group):
        pq = (p.q_map[iq] >= 0).cpu().long()
        pa2 = p.A2.pattern[ia2].cpu().long()
        q_cols = pq @ wd  # [nqb]
        a2_cols = pa2 @ wd  # [nkb]
        both = (pq[:, None, :] * pa2[None, :, :]) @ wd  # [nqb, nkb]
        kept = part.kept_mask.cpu().long()
        zero = part.zero_mask.cpu().long()
        kept_r, kept_c = kept.sum(1), kept.sum(0)
        zero_r, zero_c = zero.sum(1), zero.sum(0)
        tally.add("paper_attn_fwd", {
            "q": tot(rows * q_cols) * es,
            "a2": tot(kept * both * keys[None, :]) * es,
            "h": tot(kept_c * keys) * dv * es,
            "hsum": tot(zero_r) * dv * 4 if hz else 0,
            "q_map": map_row * nqb,
            "a2_map": map_row * tot(kept_r),
            "layout": 12 * nqb + 4 * tot(kept_r) + ((8 * nqb + 4 * tot(zero_r)) if hz else 0),
        }, {"o": n_rows * dv * es, "lse": n_rows * 4}, count)
        if not backward:
            continue
        kept_rows = tot(kept * rows[:, None])  # query rows streamed, summed over kept blocks
        slices = tot(kept_c) * dkv_slices  # dkv loop iterations: each reads a row id and a Q block-map row
        tally.add("paper_attn_bwd_dkv", {
            "q": tot(kept * both * rows[:, None]) * es,
            "a2": tot(keys * a2_cols) * es,
            "h": n_keys * dv * es,
            "do": kept_rows * dv * es, "lse": kept_rows * 4, "delta": kept_rows * 4,
            "w": tot(zero_c) * dv * 4 if hz else 0,
            "q_map": map_row * slices,
            "a2_map": map_row * nkb,
            "layout": 12 * nkb + 4 * slices + ((8 * nkb + 4 * tot(zero_c)) if hz else 0),
        }, {"da2": tot(keys * a2_cols) * es, "dh": n_keys * dv * es}, count)
        tally.add("paper_attn_bwd_dq", {
            "q": tot(rows * q_cols) * es,
            "a2": tot(kept * both * keys[None, :]) * es,
            "h": tot(kept_c * keys) * dv * es,
            "do": n_rows * dv * es, "lse": n_rows * 4, "delta": n_rows * 4,
            "q_map": map_row * nqb, "a2_map": map_row * tot(kept_r),
            "layout": 12 * nqb + 4 * tot(kept_r),
        }, {"dq": tot(rows * q_cols) * es}, count)
    if backward:
        tally.add("paper_attn_bwd_preprocess", {
            "o": n_rows * dv * es, "do": n_rows * dv * es, "lse": n_rows * 4 if hz else 0,
        }, {"delta": n_rows * 4, "w": nqb * dv * 4 if hz else 0}, G)


def _placeholder(shape, dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` that allocates one element (the models read shapes only)."""
    return torch.empty(1, dtype=dtype).as_strided(shape, (0,) * len(shape))


def products(p: Problem, dv: int, *, backward: bool = True, needs=(True, True, True, True, True)) -> list:
    """The row-panel products of one call, in launch order: ``(kernel, A, B, C, plans, colsum)``
    (``Q = A1 X`` and ``H = A3 Y`` forward; ``dA1, dX, dA3, dY`` backward where ``needs``)."""
    b = p.blocks
    Q = q_operand(p, _placeholder((p.batch.B, p.batch.H, p.nnz_q, b.m, b.d2), p.A1.data.dtype))
    H = h_operand(p, _placeholder((p.batch.B, p.batch.H, p.A3.shape[0], dv), p.A3.data.dtype))
    out = [("paper_q", p.A1, p.X, Q, product_plans(p.A1, p.X, Q, p.batch), False),
           ("paper_h", p.A3, p.Y, H, product_plans(p.A3, p.Y, H, p.batch), p.plan.has_zero)]
    if backward:
        for name, res, a, bb in gradient_products(p.A1, p.X, p.A3, p.Y, _renamed(Q, "dq"), _renamed(H, "dh"), needs):
            C = _renamed(res, name)
            out.append((f"paper_{name}", a, bb, C, product_plans(a, bb, C, p.batch), False))
    return out


def predict(p: Problem, dv: int, *, backward: bool = True, needs=(True, True, True, True, True),
            group: int | None = None) -> TrafficReport:
    """The traffic of one forward (and backward) call on problem ``p`` (see the module docstring),
    summed over its groups, or the share of group ``group`` (``b * H + h``) alone."""
    tally = _Tally()
    prods = products(p, dv, backward=backward, needs=needs)
    for kernel, A, B, C, plans, colsum in prods[:2]:
        _matmul(tally, kernel, A, B, C, plans, colsum=colsum, group=group)
    _attention_terms(tally, p, dv, p.A1.element_size, backward, group)
    for kernel, A, B, C, plans, colsum in prods[2:]:
        _matmul(tally, kernel, A, B, C, plans, colsum=colsum, group=group)
    rep = TrafficReport(source="predicted")
    tally.into(rep)
    return rep


def _renamed(op: Operand, name: str) -> Operand:
    return replace(op, name=name)


def predict_traffic(A1, A2, A3, X, Y, *, qk_layout=None, backward: bool = True) -> TrafficReport:
    """Predicted bytes of ``sparse_operands.attention(A1, A2, A3, X, Y, qk_layout=..., backend="triton")``
    (plus its backward when ``backward``, all five gradients), per kernel and tensor, summed over
    every ``(batch element, head)`` group of a batched call. Operands as for
    :func:`~sparse_io_attn.sparse_operands.attention`; only their shapes, dtypes and block patterns
    are used."""
    blocks, dtype, device = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    p = build_problem(A1, A2, A3, X, Y, qk_layout, blocks, check_batch(A1, A2, A3, X, Y, qk_layout))
    return predict(p, matrix_shape(Y)[1], backward=backward)


def predict_traffic_per_head(A1, A2, A3, X, Y, *, qk_layout=None, backward: bool = True) -> dict:
    """``{(b, h): TrafficReport}``: the share of each ``(batch element, head)`` group in
    :func:`predict_traffic` of the batched call (its programs' bytes); the shares sum to the call's
    traffic. A group's share equals the single-head call on its operands when the groups agree on
    whether some score block is structurally zero (the kernels' ``HAS_ZERO`` is one flag per call)."""
    blocks, _, _ = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    batch = check_batch(A1, A2, A3, X, Y, qk_layout)
    p = build_problem(A1, A2, A3, X, Y, qk_layout, blocks, batch)
    dv = matrix_shape(Y)[1]
    return {divmod(g, batch.H): predict(p, dv, backward=backward, group=g) for g in range(batch.groups)}

def kernel_fast_memory_words(A1, A2, A3, X, Y, *, qk_layout=None) -> int:
    """Fast memory (words) the counted algorithm uses: the largest per-program working set of the
    kernels, counting every register tile a program holds at once (padded sizes; ``D``: the head
    dimension rounded up to whole d-tiles, ``NUM_D_TILES * BLOCK_D``, held as per-d-tile tiles):

    * forward: ``q, acc [BM, D|DV] + a2, h [BN, D|DV] + s [BM, BN] + m, l [BM] + hsum row [DV]``;
    * backward dkv: ``a2, da2 [BN, D] + h, dh [BN, DV] + q [SM, D] + dO [SM, DV] + s/p, dp, ds
      [BN, SM] + lse, delta [SM]`` (``SM``: the query slice of
      :func:`~sparse_io_attn.sparse_operands.triton.configs.dkv_query_slice`);
    * backward dq: ``q, dq [BM, D] + dO [BM, DV] + a2 [BN, D] + h [BN, DV] + 3 [BM, BN] + 2 [BM]``;
    * products (row panels): ``A [BM, BK] + B [BK, N] + C [BM, N]`` (``N``: C's width rounded up
      to whole column tiles).

    This is the ``M`` at which Theorem 4.5 is evaluated against counted traffic: each program
    moves its data between global memory and a private fast memory of this size.
    """
    blocks, _, _ = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    bm, bn = blocks.m, blocks.n
    D, DV = -(-matrix_shape(X)[1] // blocks.d2) * blocks.d2, padded_dim(matrix_shape(Y)[1])
    fwd = bm * D + bm * DV + bn * D + bn * DV + bm * bn + 2 * bm + DV
    sm = dkv_query_slice(bm, D)
    dkv = 2 * bn * D + 2 * bn * DV + sm * D + sm * DV + 3 * sm * bn + 2 * sm
    dq = 2 * bm * D + bm * DV + bn * D + bn * DV + 3 * bm * bn + 2 * bm

    def panel(bi, bk, ncols, bc):  # A tile, one B tile per column tile, one C accumulator per column tile
        width = -(-ncols // bc) * bc
        return bi * bk + bk * width + bi * width

    (d1, d2), d3, dv = matrix_shape(X), matrix_shape(A3)[1], matrix_shape(Y)[1]
    b = blocks
    mm = max(panel(bm, b.d1, d2, b.d2), panel(bn, b.d3, dv, b.dv),  # Q = A1 X, H = A3 Y
             panel(bm, b.d2, d1, b.d1), panel(b.d1, bm, d2, b.d2),  # dA1 = dQ X^T, dX = A1^T dQ
             panel(bn, b.dv, d3, b.d3), panel(b.d3, bn, dv, b.dv))  # dA3 = dH Y^T, dY = A3^T dH
    return max(fwd, dkv, dq, mm)
