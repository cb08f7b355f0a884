"""Host launchers (backend ``"triton"``) for the kernels of :mod:`.product`, :mod:`.fwd` and :mod:`.bwd`:
allocate, build the grid and launch with keyword arguments through
:func:`sparse_io_attn._triton.runtime.launch` (which sets ``io_ptr``/``COUNT_IO`` and commits the I/O counter).

Forward: ``Q = A1 X`` (block-sparse product on the structural pattern of A1 X), ``H = A3 Y`` (and
its per-key-block column sums when some QK block is structurally zero), then attention.
Backward: preprocess (delta, w), dH/dA2 per key block, dQ per query block, then the products
``dA1 = dQ X^T``, ``dX = A1^T dQ`` (on the operands' own patterns), ``dA3 = dH Y^T``, ``dY = A3^T dH``.
Every kernel runs all ``(batch element, head)`` groups of a call in one launch (grid axis 1,
``g = b * H + h``); a group reads its operands through their group strides and its part of the
concatenated plans (:class:`~sparse_io_attn.sparse_operands.plan.GroupPlans`).

Kernel names in the I/O report: ``paper_q``, ``paper_h``, ``paper_attn_fwd``,
``paper_attn_bwd_preprocess``, ``paper_attn_bwd_dkv``, ``paper_attn_bwd_dq``, ``paper_da1``,
``paper_dx``, ``paper_da3``, ``paper_dy``; their tensors are the tuples of
:mod:`sparse_io_attn.sparse_operands.traffic` (products: named after their operands).
"""
from __future__ import annotations

from dataclasses import replace

from sparse_io_attn._triton.runtime import check_device, dot_dtype, launch  # (sets TRITON_INTERPRET first)
from sparse_io_attn._triton.shapes import padded_dim

import torch

from sparse_io_attn.sparse_operands.triton import bwd, fwd, product
from sparse_io_attn.sparse_operands.triton.configs import dkv_query_slice, launch_options
from sparse_io_attn.sparse_operands.operands import Operand, grouped_buffer, like, reduce_groups
from sparse_io_attn.sparse_operands.plan import GroupPlans
from sparse_io_attn.sparse_operands.problem import Problem, gradient_products, h_operand, product_plans, q_operand
from sparse_io_attn.sparse_operands.traffic import (DKV_TENSORS, DQ_TENSORS, FWD_TENSORS, MATMUL_TENSORS,
                                                    PREPROCESS_TENSORS)


def _drop(d: dict, *names) -> dict:
    return {k: v for k, v in d.items() if k not in names}


def matmul(kernel: str, A: Operand, B: Operand, C: Operand, plans: GroupPlans, num_heads: int,
           colsum: torch.Tensor | None = None) -> None:
    """``C[stored tiles] = A @ B`` for every group, following ``plans`` (grid: one program per row
    block of C and group); ``colsum`` (fp32 ``[groups, C row blocks, >= C cols]``) receives each row
    panel's column sums."""
    assert A.block[1] == B.block[0] and C.block == (A.block[0], B.block[1]), (A.block, B.block, C.block)
    rows = C.grid[0]
    if rows == 0:
        return
    # the counter names the product's tensors after its operands, in MATMUL_TENSORS' slot order
    names = dict(a=A.name, b=B.name, c=C.name, colsum="hsum" if colsum is not None else "colsum", plan="plan")
    plan = plans.plan
    launch(product._bsr_matmul_kernel, (rows, plans.ids.numel()), kernel, tuple(names[t] for t in MATMUL_TENSORS),
           C.data.device, a_ptr=A.data, b_ptr=B.data, c_ptr=C.data, colsum_ptr=colsum if colsum is not None else C.data,
           bmap_ptr=B.block_map, cmap_ptr=C.block_map, pair_ptr_ptr=plan.pair_ptr, pair_a_ptr=plan.pair_a,
           pair_k_ptr=plan.pair_k, plan_ids_ptr=plans.ids,
           **_drop(A.strides("a"), "stride_amap_gb", "stride_amap_gh"), **B.strides("b"), **C.strides("c"),
           stride_colsum_blk=colsum.stride(1) if colsum is not None else 0,
           stride_colsum_g=colsum.stride(0) if colsum is not None else 0,
           size_m=A.shape[0], size_k=A.shape[1], size_n=B.shape[1], num_rows=rows, num_heads=num_heads,
           BLOCK_M=A.block[0], BLOCK_K=A.block[1], BLOCK_N=B.block[1], NUM_N_TILES=C.grid[1],
           WRITE_COLSUM=colsum is not None, DOT_DTYPE=dot_dtype(A.data.dtype), **launch_options("matmul"))


def _attn_meta(Q: Operand, A2: Operand, dv: int) -> dict:
    """Compile-time parameters of the attention kernels; the head dimension is handled as
    ``NUM_D_TILES`` separate d-tiles of ``BLOCK_D`` columns (one compiled variant per tile count)."""
    return dict(BLOCK_M=Q.block[0], BLOCK_N=A2.block[0], BLOCK_D=Q.block[1], NUM_D_TILES=Q.grid[1],
                DV_PAD=padded_dim(dv), DOT_DTYPE=dot_dtype(Q.data.dtype))


def _operands(Q: Operand, A2: Operand) -> dict:
    return dict(q_ptr=Q.data, qmap_ptr=Q.block_map, a2_ptr=A2.data, a2map_ptr=A2.block_map,
                **Q.strides("q"), **A2.strides("a2"))


def forward(p: Problem, scale: float):
    """Returns ``(O [B, H, nq, dv], lse [B, H, nq] fp32, Q, H)`` for every group of problem ``p``
    (its operands address the autograd inputs)."""
    A1, X, A2, A3, Y = p.A1, p.X, p.A2, p.A3, p.Y
    check_device(A1.data, "sparse_io_attn.sparse_operands (backend='triton')")
    device = A1.data.device
    batch, plan = p.batch, p.plan
    G, nh = batch.groups, batch.H
    Q = q_operand(p)
    matmul("paper_q", A1, X, Q, product_plans(A1, X, Q, batch), nh)
    nq, nk, dv = A1.shape[0], A2.shape[0], Y.shape[1]
    H = h_operand(p)
    h = H.data
    hsum = None
    if plan.has_zero:
        hsum = torch.zeros(G, H.grid[0], dv, dtype=torch.float32, device=device)
    matmul("paper_h", A3, Y, H, product_plans(A3, Y, H, batch), nh, colsum=hsum)
    o = torch.empty(batch.B, batch.H, nq, dv, dtype=A1.data.dtype, device=device)
    lse = torch.empty(batch.B, batch.H, nq, dtype=torch.float32, device=device)
    launch(fwd._paper_attn_fwd_kernel, (Q.grid[0], G), "paper_attn_fwd", FWD_TENSORS, device,
           **_operands(Q, A2), h_ptr=h, hsum_ptr=hsum if hsum is not None else h, o_ptr=o, lse_ptr=lse,
           kept_crow_ptr=plan.kept_crow, kept_col_ptr=plan.kept_col, zero_crow_ptr=plan.zero_crow,
           zero_col_ptr=plan.zero_col, plan_ids_ptr=p.plans.ids,
           stride_hg=h.stride(1), stride_hn=h.stride(2), stride_hd=h.stride(3),
           stride_hsum_g=hsum.stride(0) if hsum is not None else 0,
           stride_hsum_blk=hsum.stride(1) if hsum is not None else 0,
           stride_og=o.stride(1), stride_om=o.stride(2), stride_od=o.stride(3), stride_lse_g=lse.stride(1),
           seqlen_q=nq, seqlen_k=nk, head_dim=Q.shape[1], head_dim_v=dv, sm_scale=scale, num_heads=nh,
           HAS_ZERO=plan.has_zero, **_attn_meta(Q, A2, dv), **launch_options("paper_attn_fwd"))
    return o, lse, Q, H


def backward(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, p: Problem, Q: Operand, H: Operand, scale: float,
             needs=(True, True, True, True, True)):
    """Gradients ``(dA1, dX, dA2, dA3, dY)`` shaped like each operand's ``data`` (BSR ``values`` for
    block-sparse operands: masked gradients; per-head values concatenated); ``None`` where not
    needed. ``do``, ``o`` ``[B, H, nq, dv]``, ``lse`` ``[B, H, nq]``. Each group's gradients are
    computed into a ``[B, H, ...]`` buffer and summed over the axis an operand is shared along."""
    A1, X, A2, A3, Y = p.A1, p.X, p.A2, p.A3, p.Y
    batch, plan = p.batch, p.plan
    G, nh = batch.groups, batch.H
    device = do.device
    do = do.contiguous()
    nq, nk, dv = A1.shape[0], A2.shape[0], Y.shape[1]
    meta = _attn_meta(Q, A2, dv)
    nqb = Q.grid[0]
    delta = torch.empty(batch.B, batch.H, nq, dtype=torch.float32, device=device)
    w = torch.zeros(G, nqb, dv, dtype=torch.float32, device=device) if plan.has_zero else delta
    w_strides = dict(stride_w_g=w.stride(0) if plan.has_zero else 0, stride_w_blk=w.stride(1) if plan.has_zero else 0)
    launch(bwd._paper_attn_bwd_preprocess_kernel, (nqb, G), "paper_attn_bwd_preprocess", PREPROCESS_TENSORS,
           device, o_ptr=o, do_ptr=do, lse_ptr=lse, delta_ptr=delta, w_ptr=w,
           stride_og=o.stride(1), stride_om=o.stride(2), stride_od=o.stride(3),
           stride_dog=do.stride(1), stride_dom=do.stride(2), stride_dod=do.stride(3), stride_lse_g=lse.stride(1),
           **w_strides, seqlen_q=nq, head_dim_v=dv, num_heads=nh, BLOCK_M=meta["BLOCK_M"], DV_PAD=meta["DV_PAD"],
           HAS_ZERO=plan.has_zero, **launch_options("paper_attn_bwd_preprocess"))
    h = H.data
    dH = like(H, "dh", torch.empty_like(h), grouped=True)
    dA2 = grouped_buffer(A2, batch, zero=A2.sparse)
    assert (dA2.s_a, dA2.s_b, dA2.s_r, dA2.s_c) == (A2.s_a, A2.s_b, A2.s_r, A2.s_c)  # da2 addressed as a2
    common = dict(do_ptr=do, lse_ptr=lse, delta_ptr=delta, plan_ids_ptr=p.plans.ids,
                  stride_hg=h.stride(1), stride_hn=h.stride(2), stride_hd=h.stride(3),
                  stride_dog=do.stride(1), stride_dom=do.stride(2), stride_dod=do.stride(3),
                  stride_lse_g=lse.stride(1), seqlen_q=nq, seqlen_k=nk, head_dim=Q.shape[1], head_dim_v=dv,
                  sm_scale=scale, num_heads=nh, **meta)
    launch(bwd._paper_attn_bwd_dkv_kernel, (A2.grid[0], G), "paper_attn_bwd_dkv", DKV_TENSORS, device,
           **_operands(Q, A2), **common, h_ptr=h, w_ptr=w, da2_ptr=dA2.data, dh_ptr=dH.data,
           kept_ccol_ptr=plan.kept_ccol, kept_row_ptr=plan.kept_row, zero_ccol_ptr=plan.zero_ccol,
           zero_row_ptr=plan.zero_row, stride_da2_gb=dA2.s_gb, stride_da2_gh=dA2.s_gh, **w_strides,
           stride_dhn=dH.data.stride(2), stride_dhd=dH.data.stride(3), HAS_ZERO=plan.has_zero,
           BLOCK_M_SUB=dkv_query_slice(meta["BLOCK_M"], Q.grid[1] * meta["BLOCK_D"]), **launch_options("paper_attn_bwd_dkv"))
    dQ = like(Q, "dq", torch.empty_like(Q.data))
    launch(bwd._paper_attn_bwd_dq_kernel, (nqb, G), "paper_attn_bwd_dq", DQ_TENSORS, device,
           **_operands(Q, A2), **common, h_ptr=h, dq_ptr=dQ.data, kept_crow_ptr=plan.kept_crow,
           kept_col_ptr=plan.kept_col, **launch_options("paper_attn_bwd_dq"))
    grads = {}
    for name, out, a, b in gradient_products(A1, X, A3, Y, dQ, dH, needs):
        C = replace(grouped_buffer(out, batch, zero=out.sparse), name=name)
        matmul(f"paper_{name}", a, b, C, product_plans(a, b, C, batch), nh)
        grads[name] = reduce_groups(out, C.data)
    dA2 = reduce_groups(A2, dA2.data) if needs[2] else None
    return grads.get("da1"), grads.get("dx"), dA2, grads.get("da3"), grads.get("dy")
