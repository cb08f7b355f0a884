"""Host side of backend ``"cpu"``: schedule tensors in, the C++ ops (:mod:`sparse_io_attn._cpu.build`) called."""
from __future__ import annotations

import weakref

import torch

from sparse_io_attn._cpu.build import load
from sparse_io_attn.block_sparse.schedule import BlockLists, Schedule, schedule
from sparse_io_attn.layout.core import BlockSparseLayout

# transposed element masks ([num_masks, BLOCK_SIZE_KV, ceil(BLOCK_SIZE_Q / 32)], what dK/dV reads),
# built once per layout version (they do not depend on the causal offset)
_MASKS_T: "weakref.WeakKeyDictionary[BlockSparseLayout, tuple]" = weakref.WeakKeyDictionary()


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"backend 'cpu' runs on CPU tensors, got a tensor on {t.device}; use "
                             f"backend='auto' or 'triton' for CUDA tensors")


def _lists(lists: BlockLists) -> tuple:
    return (lists.full_ptr, lists.full_idx, lists.part_ptr, lists.part_idx, lists.part_mask)


def _schedule(layout: BlockSparseLayout, causal_offset: int | None) -> Schedule:
    return schedule(layout.to("cpu"), causal_offset)


def _masks_t(ops, layout: BlockSparseLayout, sched: Schedule) -> torch.Tensor:
    """The transposed element masks, cached per layout until its tensors are edited in place."""
    key = (layout.version_key(), sched.masks.shape[0])
    hit = _MASKS_T.get(layout)
    if hit is None or hit[0] != key:
        hit = _MASKS_T[layout] = (key, ops.transpose_masks(sched.masks, layout.BLOCK_SIZE_KV))
    return hit[1]


def forward(q, k, v, layout: BlockSparseLayout, *, causal_offset: int | None, sm_scale: float,
            layout_strides: tuple[int, int]):
    """``(out [B, Hq, Nq, D] in q's dtype, lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq])``."""
    _check_cpu(q, k, v)
    ops = load()
    sched = _schedule(layout, causal_offset)
    stride_lb, stride_lh = layout_strides
    return ops.fwd(q, k, v, *_lists(sched.rows), sched.masks, layout.BLOCK_SIZE_Q, layout.BLOCK_SIZE_KV,
                   stride_lb, stride_lh, causal_offset, float(sm_scale))


def backward(do, q, k, v, out, stats, layout: BlockSparseLayout, *, causal_offset: int | None, sm_scale: float,
             layout_strides: tuple[int, int]):
    """``(dq, dk, dv)`` in the inputs' dtypes; dk/dv summed over each GQA group."""
    _check_cpu(do, q, k, v, out, stats)
    ops = load()
    sched = _schedule(layout, causal_offset)
    stride_lb, stride_lh = layout_strides
    do = do.to(q.dtype)
    out = out.to(q.dtype)
    stats = stats.to(torch.float32)
    return ops.bwd(do, q, k, v, out, stats, *_lists(sched.cols), sched.masks,
                   _masks_t(ops, layout, sched), layout.BLOCK_SIZE_Q, layout.BLOCK_SIZE_KV,
                   stride_lb, stride_lh, causal_offset, float(sm_scale))
