"""Backend ``"triton"``: host launchers of the block-sparse kernels.

Implements the backend interface of :mod:`sparse_io_attn.block_sparse.api` (inputs arrive validated, the
layout on the tensors' device):

* ``forward(q, k, v, layout, *, causal_offset, sm_scale) -> (out, lse, stats)``, ``lse`` fp32
  ``[B, Hq, Nq]`` in natural-log units, ``-inf`` on rows with no allowed key (whose output is 0);
  ``stats`` fp32 ``[2, B, Hq, Nq]``: base-2 row maximum and log2 row sum, for backward.
* ``backward(do, q, k, v, out, stats, layout, *, causal_offset, sm_scale) -> (dq, dk, dv)``,
  dk/dv summed over the query heads of a GQA group; deterministic (no atomics on data).

The kernels walk the layout's schedule (:func:`sparse_io_attn.block_sparse.schedule.schedule`):
partial blocks masked, full blocks unmasked.

Tiles come from :func:`sparse_io_attn.block_sparse.tiles.choose_tiles` (shared with the traffic
model). On CUDA the kernels are autotuned over warps/stages only (tiles fixed, so the traffic is
too); ``SPARSE_IO_ATTN_NO_AUTOTUNE=1`` or counting (:class:`~sparse_io_attn.accounting.IOCounter`)
launch one fixed config. On CPU the kernels run through Triton's interpreter; :func:`aot_compile`
compiles them for a CUDA architecture without a GPU (a check of the compiled path).
"""
from __future__ import annotations

import torch

from sparse_io_attn._triton.aot import compile_for_cuda
from sparse_io_attn._triton.runtime import check_device, dot_dtype, launch
from sparse_io_attn.block_sparse.schedule import BlockLists, schedule
from sparse_io_attn.block_sparse.tiles import KernelTiles, choose_tiles, element_size, padded_head_dim
from sparse_io_attn.block_sparse.traffic import DKDV_TENSORS, DQ_TENSORS, FWD_TENSORS, PREPROCESS_TENSORS
from sparse_io_attn.block_sparse.triton.bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
                                                    _attn_bwd_preprocess_kernel)
from sparse_io_attn.block_sparse.triton.fwd import _attn_fwd_kernel
from sparse_io_attn.layout.core import BlockSparseLayout

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

FIXED_CONFIG = {"num_warps": 4, "num_stages": 2}
INDEX_PTRS = ("full_ptr_ptr", "full_idx_ptr", "part_ptr_ptr", "part_idx_ptr", "part_mask_ptr", "mask_ptr")
TUNE = ([triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))],
        ["seqlen_q", "seqlen_k", "head_dim", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "IS_CAUSAL"])


def _strides(t: torch.Tensor, prefix: str) -> dict:
    return {f"stride_{prefix}{ax}": s for ax, s in zip("zh" + ("n" if prefix in ("k", "v", "dk", "dv") else "m") + "d",
                                                         t.stride())}


def _common(q, k, layout: BlockSparseLayout, causal_offset: int | None, sm_scale: float) -> dict:
    B, Hq, Nq, D = q.shape
    stride_lb, stride_lh = layout.broadcast_strides(B, Hq)
    head_dim = padded_head_dim(D)
    return dict(stride_lb=stride_lb, stride_lh=stride_lh, seqlen_q=Nq, seqlen_k=k.shape[2],
                num_heads_q=Hq, num_heads_kv=k.shape[1], head_dim=D, sm_scale=float(sm_scale),
                causal_offset=0 if causal_offset is None else int(causal_offset),
                BLOCK_SIZE_Q=layout.BLOCK_SIZE_Q, BLOCK_SIZE_KV=layout.BLOCK_SIZE_KV,
                MASK_WORDS=layout.partial_masks.shape[-1], HEAD_DIM=head_dim, EVEN_D=head_dim == D,
                IS_CAUSAL=causal_offset is not None, DOT_DTYPE=dot_dtype(q.dtype), ELEM_BYTES=q.element_size())


def _lists(lists: BlockLists, masks: torch.Tensor) -> dict:
    return dict(full_ptr_ptr=lists.full_ptr, full_idx_ptr=lists.full_idx, part_ptr_ptr=lists.part_ptr,
                part_idx_ptr=lists.part_idx, part_mask_ptr=lists.part_mask, mask_ptr=masks)


def tiles_for(q: torch.Tensor, layout: BlockSparseLayout) -> KernelTiles:
    """The kernel tiles used for these inputs (what the traffic model assumes by default)."""
    return choose_tiles(layout.block_size, q.shape[-1], q.dtype)


def forward(q, k, v, layout: BlockSparseLayout, *, causal_offset: int | None, sm_scale: float):
    check_device(q, "backend 'triton'")
    B, Hq, Nq, D = q.shape
    tiles = tiles_for(q, layout)
    sched = schedule(layout, causal_offset)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, B, Hq, Nq, dtype=torch.float32, device=q.device)
    BLOCK_M, BLOCK_N = tiles.fwd
    launch(_attn_fwd_kernel, (triton.cdiv(Nq, BLOCK_M), B * Hq), "attn_fwd", FWD_TENSORS, q.device,
           tune=TUNE, config=FIXED_CONFIG,
           q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats, **_lists(sched.rows, sched.masks),
           **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(out, "o"),
           num_q_blocks=layout.num_q_blocks, stats_stride=B * Hq * Nq,
           **_common(q, k, layout, causal_offset, sm_scale), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out, lse, stats


def backward(do, q, k, v, out, stats, layout: BlockSparseLayout, *, causal_offset: int | None, sm_scale: float):
    check_device(q, "backend 'triton'")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    tiles = tiles_for(q, layout)
    sched = schedule(layout, causal_offset)
    do = do.to(q.dtype)
    stats = stats.contiguous()
    common = _common(q, k, layout, causal_offset, sm_scale)

    delta = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    launch(_attn_bwd_preprocess_kernel, (triton.cdiv(Nq, tiles.preprocess), B * Hq), "attn_bwd_preprocess",
           PREPROCESS_TENSORS, q.device, tune=TUNE, config=FIXED_CONFIG,
           o_ptr=out, do_ptr=do, delta_ptr=delta, **_strides(out, "o"), **_strides(do, "do"),
           seqlen_q=Nq, num_heads_q=Hq, head_dim=D, BLOCK_M=tiles.preprocess, HEAD_DIM=common["HEAD_DIM"],
           ELEM_BYTES=common["ELEM_BYTES"])

    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    BLOCK_M, BLOCK_N = tiles.dkdv
    launch(_attn_bwd_dkdv_kernel, (triton.cdiv(Nk, BLOCK_N), B * Hkv), "attn_bwd_dkdv", DKDV_TENSORS,
           q.device, tune=TUNE, config=FIXED_CONFIG,
           q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv,
           **_lists(sched.cols, sched.masks),
           **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(do, "do"),
           **_strides(dk, "dk"), **_strides(dv, "dv"), num_kv_blocks=layout.num_kv_blocks,
           stats_stride=B * Hq * Nq, **common,
           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    BLOCK_M, BLOCK_N = tiles.dq
    launch(_attn_bwd_dq_kernel, (triton.cdiv(Nq, BLOCK_M), B * Hq), "attn_bwd_dq", DQ_TENSORS, q.device,
           tune=TUNE, config=FIXED_CONFIG,
           q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dq_ptr=dq,
           **_lists(sched.rows, sched.masks),
           **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(do, "do"),
           **_strides(dq, "dq"), num_q_blocks=layout.num_q_blocks, stats_stride=B * Hq * Nq, **common,
           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return dq, dk, dv


def aot_compile(dtype: torch.dtype, head_dim: int, block_size=(128, 128), *, causal: bool = True,
                count_io: bool = True, arch: int = 90, num_warps: int = 4, num_stages: int = 2) -> dict:
    """Compile the four kernels for CUDA ``sm_<arch>`` without a GPU or a launch (Triton's ``ptxas``
    only); returns ``{kernel: shared memory bytes}``. Checks the compiled path (typing, loops,
    shared memory) where only the interpreter runs. Needs Triton imported without the interpreter."""
    tiles = choose_tiles(block_size, head_dim, dtype)
    common = dict(BLOCK_SIZE_Q=block_size[0], BLOCK_SIZE_KV=block_size[1], MASK_WORDS=-(-block_size[1] // 32),
                  HEAD_DIM=padded_head_dim(head_dim), EVEN_D=padded_head_dim(head_dim) == head_dim,
                  IS_CAUSAL=causal, DOT_DTYPE=dot_dtype(dtype), ELEM_BYTES=element_size(dtype), COUNT_IO=count_io)
    jobs = {
        "attn_fwd": (_attn_fwd_kernel, dict(common, BLOCK_M=tiles.fwd[0], BLOCK_N=tiles.fwd[1])),
        "attn_bwd_preprocess": (_attn_bwd_preprocess_kernel, dict(BLOCK_M=tiles.preprocess, HEAD_DIM=common["HEAD_DIM"],
                                                                  ELEM_BYTES=common["ELEM_BYTES"], COUNT_IO=count_io)),
        "attn_bwd_dkdv": (_attn_bwd_dkdv_kernel, dict(common, BLOCK_M=tiles.dkdv[0], BLOCK_N=tiles.dkdv[1])),
        "attn_bwd_dq": (_attn_bwd_dq_kernel, dict(common, BLOCK_M=tiles.dq[0], BLOCK_N=tiles.dq[1])),
    }
    return {name: compile_for_cuda(kernel, consts, dtype, int_ptrs=INDEX_PTRS,
                                   fp32_ptrs=("lse_ptr", "stats_ptr", "delta_ptr"), arch=arch, num_warps=num_warps,
                                   num_stages=num_stages).metadata.shared
            for name, (kernel, consts) in jobs.items()}
