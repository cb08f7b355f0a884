"""Host launchers (backend ``"triton"``) for :mod:`sparse_io_attn.sparse_operands.triton.kernels`: allocate, build the
grid and launch with keyword arguments through :func:`sparse_io_attn._triton.runtime.launch` (which
sets ``io_ptr``/``COUNT_IO`` and commits the I/O counter).

Forward: ``Q = A1 X`` (block-sparse product on the structural pattern of A1 X), ``H = A3 Y`` (and
its per-key-block column sums when some QK block is structurally zero), then attention.
Backward: preprocess (delta, w), dH/dA2 per key block, dQ per query block, then the products
``dA1 = dQ X^T``, ``dX = A1^T dQ`` (on the operands' own patterns), ``dA3 = dH Y^T``, ``dY = A3^T dH``.

Kernel names in the I/O report: ``paper_q``, ``paper_h``, ``paper_attn_fwd``,
``paper_attn_bwd_preprocess``, ``paper_attn_bwd_dkv``, ``paper_attn_bwd_dq``, ``paper_da1``,
``paper_dx``, ``paper_da3``, ``paper_dy``; their tensors are the tuples of
:mod:`sparse_io_attn.sparse_operands.traffic` (products: named after their operands).
"""
from __future__ import annotations

from sparse_io_attn._triton.runtime import check_device, dot_dtype, launch  # (sets TRITON_INTERPRET first)
from sparse_io_attn._triton.shapes import padded_dim

import torch

from sparse_io_attn.sparse_operands.triton import kernels
from sparse_io_attn.sparse_operands.operands import Operand, dense_operand, like
from sparse_io_attn.sparse_operands.plan import AttentionPlan, ProductPlan, product_plan
from sparse_io_attn.sparse_operands.problem import gradient_products
from sparse_io_attn.sparse_operands.traffic import (DKV_TENSORS, DQ_TENSORS, FWD_TENSORS, MATMUL_TENSORS,
                                                    PREPROCESS_TENSORS)


def matmul(kernel: str, A: Operand, B: Operand, C: Operand, plan: ProductPlan,
           colsum: torch.Tensor | None = None) -> None:
    """``C[stored tiles] = A @ B`` following ``plan`` (one program per row block of C); ``colsum``
    (fp32 ``[C row blocks, >= C cols]``) receives each row panel's column sums."""
    assert A.block[1] == B.block[0] and C.block == (A.block[0], B.block[1]), (A.block, B.block, C.block)
    if plan.num_rows == 0:
        return
    # the counter names the product's tensors after its operands, in MATMUL_TENSORS' slot order
    names = dict(a=A.name, b=B.name, c=C.name, colsum="hsum" if colsum is not None else "colsum", plan="plan")
    launch(kernels._bsr_matmul_kernel, (plan.num_rows,), kernel, tuple(names[t] for t in MATMUL_TENSORS), C.data.device,
           a_ptr=A.data, b_ptr=B.data, c_ptr=C.data, colsum_ptr=colsum if colsum is not None else C.data,
           bmap_ptr=B.block_map, cmap_ptr=C.block_map, pair_ptr_ptr=plan.pair_ptr, pair_a_ptr=plan.pair_a,
           pair_k_ptr=plan.pair_k, **A.strides("a"), **B.strides("b"), **C.strides("c"),
           stride_colsum_blk=colsum.stride(0) if colsum is not None else 0,
           size_m=A.shape[0], size_k=A.shape[1], size_n=B.shape[1],
           BLOCK_M=A.block[0], BLOCK_K=A.block[1], BLOCK_N=B.block[1], NUM_N_TILES=C.block_map.shape[1],
           WRITE_COLSUM=colsum is not None, DOT_DTYPE=dot_dtype(A.data.dtype))


def _grad_buffer(op: Operand) -> torch.Tensor:
    """Gradient storage shaped like ``op.data``; zeroed for BSR values (padding of edge blocks is
    never written by the kernels)."""
    return torch.zeros_like(op.data) if op.sparse else torch.empty_like(op.data)


def _attn_meta(Q: Operand, A2: Operand, dv: int) -> dict:
    """Compile-time parameters of the attention kernels; the head dimension is handled as
    ``NUM_D_TILES`` separate d-tiles of ``BLOCK_D`` columns (one compiled variant per tile count)."""
    return dict(BLOCK_M=Q.block[0], BLOCK_N=A2.block[0], BLOCK_D=Q.block[1], NUM_D_TILES=Q.block_map.shape[1],
                DV_PAD=padded_dim(dv), DOT_DTYPE=dot_dtype(Q.data.dtype))


def q_operand(A1: Operand, X: Operand, q_map: torch.Tensor, nnz_q: int) -> Operand:
    """The BSR buffer for ``Q = A1 X`` on ``q_map`` (uninitialised values)."""
    bm, bd = A1.block[0], X.block[1]
    vals = torch.empty(nnz_q, bm, bd, dtype=A1.data.dtype, device=A1.data.device)
    return Operand("q", vals, (A1.shape[0], X.shape[1]), (bm, bd), q_map, 1, vals.stride(0), 0,
                   vals.stride(1), vals.stride(2), True)


def forward(A1: Operand, X: Operand, A2: Operand, A3: Operand, Y: Operand, q_map: torch.Tensor, nnz_q: int,
            plan: AttentionPlan, scale: float):
    """Returns ``(O [nq, dv], lse [nq] fp32, Q, H)``."""
    check_device(A1.data, "sparse_io_attn.sparse_operands (backend='triton')")
    device = A1.data.device
    Q = q_operand(A1, X, q_map, nnz_q)
    matmul("paper_q", A1, X, Q, product_plan(A1.block_map, X.block_map, q_map))
    nq, nk, dv = A1.shape[0], A2.shape[0], Y.shape[1]
    h = torch.empty(nk, dv, dtype=A3.data.dtype, device=device)
    H = dense_operand("h", h, (A3.block[0], Y.block[1]))
    hsum = None
    if plan.has_zero:
        hsum = torch.zeros(H.block_map.shape[0], dv, dtype=torch.float32, device=device)
    matmul("paper_h", A3, Y, H, product_plan(A3.block_map, Y.block_map, H.block_map), colsum=hsum)
    o = torch.empty(nq, dv, dtype=A1.data.dtype, device=device)
    lse = torch.empty(nq, dtype=torch.float32, device=device)
    launch(kernels._paper_attn_fwd_kernel, (Q.block_map.shape[0],), "paper_attn_fwd", FWD_TENSORS, device,
           q_ptr=Q.data, qmap_ptr=Q.block_map, a2_ptr=A2.data, a2map_ptr=A2.block_map, h_ptr=h,
           hsum_ptr=hsum if hsum is not None else h, o_ptr=o, lse_ptr=lse,
           kept_crow_ptr=plan.kept_crow, kept_col_ptr=plan.kept_col, zero_crow_ptr=plan.zero_crow,
           zero_col_ptr=plan.zero_col, **Q.strides("q"), **A2.strides("a2"),
           stride_hn=h.stride(0), stride_hd=h.stride(1), stride_hsum_blk=hsum.stride(0) if hsum is not None else 0,
           stride_om=o.stride(0), stride_od=o.stride(1),
           seqlen_q=nq, seqlen_k=nk, head_dim=Q.shape[1], head_dim_v=dv,
           sm_scale=scale, HAS_ZERO=plan.has_zero, **_attn_meta(Q, A2, dv))
    return o, lse, Q, H


def backward(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, A1: Operand, X: Operand, A2: Operand,
             A3: Operand, Y: Operand, Q: Operand, H: Operand, plan: AttentionPlan, scale: float,
             needs=(True, True, True, True, True)):
    """Gradients ``(dA1, dX, dA2, dA3, dY)`` as data tensors shaped like each operand's ``data``
    (BSR ``values`` for block-sparse operands: masked gradients); ``None`` where not needed."""
    device = do.device
    do = do.contiguous()
    nq, nk, dv = A1.shape[0], A2.shape[0], Y.shape[1]
    meta = _attn_meta(Q, A2, dv)
    nqb = Q.block_map.shape[0]
    delta = torch.empty(nq, dtype=torch.float32, device=device)
    w = torch.zeros(nqb, dv, dtype=torch.float32, device=device) if plan.has_zero else delta
    launch(kernels._paper_attn_bwd_preprocess_kernel, (nqb,), "paper_attn_bwd_preprocess", PREPROCESS_TENSORS, device,
           o_ptr=o, do_ptr=do, lse_ptr=lse, delta_ptr=delta, w_ptr=w, stride_om=o.stride(0), stride_od=o.stride(1),
           stride_dom=do.stride(0), stride_dod=do.stride(1), stride_w_blk=w.stride(0) if plan.has_zero else 0,
           seqlen_q=nq, head_dim_v=dv, BLOCK_M=meta["BLOCK_M"], DV_PAD=meta["DV_PAD"], HAS_ZERO=plan.has_zero)
    h = H.data
    dh = torch.empty_like(h)
    da2 = like(A2, "da2", _grad_buffer(A2))
    launch(kernels._paper_attn_bwd_dkv_kernel, (A2.block_map.shape[0],), "paper_attn_bwd_dkv", DKV_TENSORS, device,
           q_ptr=Q.data, qmap_ptr=Q.block_map, a2_ptr=A2.data, a2map_ptr=A2.block_map, h_ptr=h, do_ptr=do,
           lse_ptr=lse, delta_ptr=delta, w_ptr=w, da2_ptr=da2.data, dh_ptr=dh,
           kept_ccol_ptr=plan.kept_ccol, kept_row_ptr=plan.kept_row, zero_ccol_ptr=plan.zero_ccol,
           zero_row_ptr=plan.zero_row, **Q.strides("q"), **A2.strides("a2"),
           stride_hn=h.stride(0), stride_hd=h.stride(1), stride_dom=do.stride(0), stride_dod=do.stride(1),
           stride_w_blk=w.stride(0) if plan.has_zero else 0, stride_dhn=dh.stride(0), stride_dhd=dh.stride(1),
           seqlen_q=nq, seqlen_k=nk, head_dim=Q.shape[1], head_dim_v=dv,
           sm_scale=scale, HAS_ZERO=plan.has_zero, **meta)
    dQ = like(Q, "dq", torch.empty_like(Q.data))
    launch(kernels._paper_attn_bwd_dq_kernel, (nqb,), "paper_attn_bwd_dq", DQ_TENSORS, device,
           q_ptr=Q.data, qmap_ptr=Q.block_map, a2_ptr=A2.data, a2map_ptr=A2.block_map, h_ptr=h, do_ptr=do,
           lse_ptr=lse, delta_ptr=delta, dq_ptr=dQ.data, kept_crow_ptr=plan.kept_crow, kept_col_ptr=plan.kept_col,
           **Q.strides("q"), **A2.strides("a2"), stride_hn=h.stride(0), stride_hd=h.stride(1),
           stride_dom=do.stride(0), stride_dod=do.stride(1),
           seqlen_q=nq, seqlen_k=nk, head_dim=Q.shape[1], head_dim_v=dv, sm_scale=scale, **meta)
    grads = {}
    for name, out, a, b in gradient_products(A1, X, A3, Y, dQ, like(H, "dh", dh), needs):
        C = like(out, name, _grad_buffer(out))
        matmul(f"paper_{name}", a, b, C, product_plan(a.block_map, b.block_map, out.block_map))
        grads[name] = C.data
    return grads.get("da1"), grads.get("dx"), da2.data if needs[2] else None, grads.get("da3"), grads.get("dy")
