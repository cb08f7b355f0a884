"""Exact model of the ``tl.dot`` work of the :mod:`sparse_io_attn.sparse_operands` Triton kernels.

:func:`predict_dot_macs` returns, per kernel (report names), the multiply-adds its ``tl.dot`` calls issue
(``M * N * K`` of every call, on the padded register tiles the kernel holds), from block patterns and
shapes only. The kernels split every product over the head dimension into d-tiles and issue a tile's
product only when the tile is stored in both operands, so the model counts, per kept score block
``(i, j)``, ``|Pq[i] & Pa2[j]|`` tile products (``Pq[i]``, ``Pa2[j]``: stored d-tiles of row block
``i`` of ``Q = A1 X`` and of ``A2``), never ``num_d_tiles``:

* ``paper_attn_fwd``: per kept ``(i, j)``: ``S`` over shared tiles ``|both| BM BN BD`` and ``P H``
  ``BM BN DV``;
* ``paper_attn_bwd_dkv``: per kept ``(i, j)``: ``S`` and ``dA2 += dS^T Q`` on shared tiles
  (``2 |both| BM BN BD``), ``dH += P^T dO`` and ``dP = dO H^T`` (``2 BM BN DV``);
* ``paper_attn_bwd_dq``: per kept ``(i, j)``: ``S`` and ``dQ += dS A2`` on shared tiles
  (``2 |both| BM BN BD``), ``dP`` (``BM BN DV``);
* products ``C = A B`` (``paper_q``, ``paper_h``, ``paper_da1``, ``paper_dx``, ``paper_da3``,
  ``paper_dy``; one kernel, ``_bsr_matmul_kernel``): per pair ``(i, k)`` of the product plan,
  ``BM_A BK BN`` per column tile stored in both ``B[k, :]`` and ``C[i, :]``.

``BM``, ``BN``, ``BD``: query, key and head-dim block sizes; ``DV``: the padded value width
(:func:`~sparse_io_attn._triton.shapes.padded_dim` of ``dv``: the next power of two, at least 16).
Tests compare these numbers with the multiply-adds the interpreter actually executes
(tests/sparse_operands/test_sparse_operands_attention.py::test_executed_dot_macs_equal_model).
"""
from __future__ import annotations

from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.sparse_operands.batch import matrix_shape
from sparse_io_attn.sparse_operands.problem import build_problem
from sparse_io_attn.sparse_operands.operands import check_batch, check_operands
from sparse_io_attn.sparse_operands.traffic import products

ATTENTION_KERNELS = ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq")
PRODUCT_KERNELS = ("paper_q", "paper_h", "paper_da1", "paper_dx", "paper_da3", "paper_dy")


def _product_macs(A, B, C, plans) -> int:
    """``BM_A BK BN`` per (pair, column tile stored in both ``B[k, :]`` and ``C[i, :]``), summed over
    the groups."""
    total = 0
    for plan, count, (_, ib, ic) in zip(plans.parts, plans.counts, plans.keys):
        pi, pk = plan.pairs()
        shared = int(((C.block_map[ic] >= 0).cpu().long()[pi] * (B.block_map[ib] >= 0).cpu().long()[pk]).sum())
        total += count * shared
    return total * A.block[0] * A.block[1] * B.block[1]


def predict_dot_macs(A1, A2, A3, X, Y, *, qk_layout=None, backward: bool = True) -> dict:
    """``{kernel: multiply-adds issued by tl.dot}`` for the kernels of one
    ``sparse_operands.attention(..., backend="triton")`` call (and its backward when ``backward``, all five
    gradients), summed over its ``(batch element, head)`` groups: the three attention kernels and
    the products, by report name."""
    blocks, _, _ = check_operands(A1, A2, A3, X, Y, qk_layout, 1.0, "triton")
    p = build_problem(A1, A2, A3, X, Y, qk_layout, blocks, check_batch(A1, A2, A3, X, Y, qk_layout))
    bm, bn, bd = blocks.m, blocks.n, blocks.d2
    dv_cols = matrix_shape(Y)[1]
    dv = padded_dim(dv_cols)
    shared = n_kept = 0
    for part, count, (iq, ia2, _) in zip(p.plans.parts, p.plans.counts, p.plans.keys):
        pq = (p.q_map[iq] >= 0).cpu().long()
        pa2 = p.A2.pattern[ia2].cpu().long()
        kept = part.kept_mask.cpu().long()
        shared += count * int((kept * (pq @ pa2.t())).sum())  # sum over kept (i, j) of |Pq[i] & Pa2[j]|
        n_kept += count * int(kept.sum())
    tile = bm * bn * bd
    out = {"paper_attn_fwd": shared * tile + n_kept * bm * bn * dv}
    if backward:
        out["paper_attn_bwd_dkv"] = 2 * shared * tile + 2 * n_kept * bm * bn * dv
        out["paper_attn_bwd_dq"] = 2 * shared * tile + n_kept * bm * bn * dv
    for kernel, A, B, C, plans, _ in products(p, dv_cols, backward=backward):
        out[kernel] = _product_macs(A, B, C, plans)
    return out
