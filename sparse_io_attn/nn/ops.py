"""Block-sparse attention as ``torch.library`` custom ops, so ``torch.compile`` traces through it.

Two opaque ops, each a thin shell over a backend of :mod:`sparse_io_attn.block_sparse.api`:

* ``sparse_io_attn::block_sparse_attn_fwd(q, k, v, crow_indices, col_indices, partial_ids,
  partial_masks, ccol_indices, row_indices, csc_partial_ids, block_size_q, block_size_kv,
  layout_batch, layout_heads, indices_checked, causal_offset, sm_scale, backend) -> (out, lse, stats)``
* ``sparse_io_attn::block_sparse_attn_bwd(do, q, k, v, out, stats, <same layout args>) -> (dq, dk, dv)``

A :class:`~sparse_io_attn.BlockSparseLayout` is not a tensor, so it crosses the op boundary as its
index and element-mask tensors (CSR storage slots, partial-block ids and masks, and the transposed
CSC copy) plus ints; the op rebuilds the layout object inside (as a fixed-capacity layout: entries
past ``crow_indices[-1, -1]`` are unused slots) and checks its indices once per index tensors and
version (a direct call may carry any), unless ``indices_checked`` says they come from a layout the
library built or validated (:attr:`BlockSparseLayout.checked`: what :func:`block_sparse_attention_op`
passes), and checks its broadcast over q's ``[batch, heads]`` per call. ``causal_offset`` is ``None`` or the
``delta`` of ``j <= i + delta`` (:func:`sparse_io_attn.layout.causal.causal_offset`). ``register_fake`` gives the shapes to the compiler and ``register_autograd`` wires the
backward op, so ``torch.compile(model, fullgraph=True)`` sees two nodes and no graph break.

Shapes and units are those of :func:`sparse_io_attn.block_sparse_attention`: ``out`` has q's shape
and dtype (contiguous), ``lse`` is float32 ``[B, Hq, Nq]`` in natural-log units, ``-inf`` on empty
rows, and is not differentiable (its incoming gradient is ignored).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from sparse_io_attn.block_sparse.api import _no_double_backward, backend_module, prologue
from sparse_io_attn.layout.core import BlockSparseLayout

# Layout objects rebuilt inside the ops, keyed by the crow_indices tensor they were built from, so a
# backend's per-layout caches survive across calls with the same index tensors.
_REBUILT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _layout_from_indices(q: Tensor, k: Tensor, crow_indices: Tensor, col_indices: Tensor, partial_ids: Tensor,
                         partial_masks: Tensor, ccol_indices: Tensor, row_indices: Tensor, csc_partial_ids: Tensor,
                         block_size_q: int, block_size_kv: int, layout_batch: int, layout_heads: int,
                         indices_checked: bool) -> tuple[BlockSparseLayout, tuple[int, int]]:
    """``(layout, layout_strides)`` for the op's arguments: the layout rebuilt once per index tensors,
    its indices validated unless ``indices_checked`` (and again after an in-place edit); its
    broadcast over q's ``[batch, heads]`` checked per call (a direct call may carry any)."""
    tensors = (col_indices, partial_ids, partial_masks, ccol_indices, row_indices, csc_partial_ids)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    meta = (block_size_q, block_size_kv, layout_batch, layout_heads, seqlen_q, seqlen_k)
    hit = _REBUILT.get(crow_indices)
    if hit is not None:
        layout, hit_tensors, hit_meta = hit
        if all(a is b for a, b in zip(hit_tensors, tensors)) and hit_meta == meta:
            return layout.check(), layout.broadcast_strides(q.shape[0], q.shape[1])
    layout = BlockSparseLayout(crow_indices, col_indices, block_size=(block_size_q, block_size_kv),
                               seqlen=(seqlen_q, seqlen_k), layout_batch=layout_batch,
                               layout_heads=layout_heads, name="custom_op", validate=False,
                               partial_ids=partial_ids, partial_masks=partial_masks,
                               ccol_indices=ccol_indices, row_indices=row_indices,
                               csc_partial_ids=csc_partial_ids, fixed_capacity=True)
    if indices_checked:
        layout._mark_checked()
    layout.check()  # a direct op call may carry any indices: validated once per rebuilt layout and version
    _REBUILT[crow_indices] = (layout, tensors, meta)
    return layout, layout.broadcast_strides(q.shape[0], q.shape[1])


@torch.library.custom_op("sparse_io_attn::block_sparse_attn_fwd", mutates_args=())
def block_sparse_attn_fwd(q: Tensor, k: Tensor, v: Tensor, crow_indices: Tensor, col_indices: Tensor,
                          partial_ids: Tensor, partial_masks: Tensor, ccol_indices: Tensor, row_indices: Tensor,
                          csc_partial_ids: Tensor, block_size_q: int, block_size_kv: int, layout_batch: int,
                          layout_heads: int, indices_checked: bool, causal_offset: Optional[int], sm_scale: float,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Forward of block-sparse attention: ``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq], stats fp32
    [2, B, Hq, Nq])`` (``stats``: the softmax statistics backward recomputes ``P`` from)."""
    layout, layout_strides = _layout_from_indices(q, k, crow_indices, col_indices, partial_ids, partial_masks,
                                                  ccol_indices, row_indices, csc_partial_ids, block_size_q,
                                                  block_size_kv, layout_batch, layout_heads, indices_checked)
    out, lse, stats = backend_module(backend).forward(q, k, v, layout, causal_offset=causal_offset,
                                                      sm_scale=sm_scale, layout_strides=layout_strides)
    return out.contiguous(), lse.contiguous(), stats.contiguous()


@block_sparse_attn_fwd.register_fake
def _(q, k, v, crow_indices, col_indices, partial_ids, partial_masks, ccol_indices, row_indices,
      csc_partial_ids, block_size_q, block_size_kv, layout_batch, layout_heads, indices_checked, causal_offset,
      sm_scale, backend):
    B, Hq, Nq, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=torch.float32),
            q.new_empty((2, B, Hq, Nq), dtype=torch.float32))


@torch.library.custom_op("sparse_io_attn::block_sparse_attn_bwd", mutates_args=())
def block_sparse_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor,
                          crow_indices: Tensor, col_indices: Tensor, partial_ids: Tensor, partial_masks: Tensor,
                          ccol_indices: Tensor, row_indices: Tensor, csc_partial_ids: Tensor,
                          block_size_q: int, block_size_kv: int, layout_batch: int, layout_heads: int,
                          indices_checked: bool, causal_offset: Optional[int], sm_scale: float,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of block-sparse attention: ``(dq, dk, dv)`` shaped like q, k, v (dk/dv summed over
    the query heads of a GQA group)."""
    layout, layout_strides = _layout_from_indices(q, k, crow_indices, col_indices, partial_ids, partial_masks,
                                                  ccol_indices, row_indices, csc_partial_ids, block_size_q,
                                                  block_size_kv, layout_batch, layout_heads, indices_checked)
    dq, dk, dv = backend_module(backend).backward(do, q, k, v, out, stats, layout, causal_offset=causal_offset,
                                                  sm_scale=sm_scale, layout_strides=layout_strides)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@block_sparse_attn_bwd.register_fake
def _(do, q, k, v, out, stats, crow_indices, col_indices, partial_ids, partial_masks, ccol_indices, row_indices,
      csc_partial_ids, block_size_q, block_size_kv, layout_batch, layout_heads, indices_checked, causal_offset,
      sm_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_NUM_LAYOUT_TENSORS = 7  # crow, col, partial_ids, partial_masks, ccol, row, csc_partial_ids


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    layout_tensors = inputs[3:3 + _NUM_LAYOUT_TENSORS]
    out, lse, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *layout_tensors)
    # block_size_q, block_size_kv, layout_batch, layout_heads, indices_checked, causal_offset, sm_scale, backend
    ctx.meta = inputs[3 + _NUM_LAYOUT_TENSORS:]
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, dout, _dlse, _dstats):
    _no_double_backward("sparse_io_attn::block_sparse_attn_fwd")
    q, k, v, out, stats, *layout_tensors = ctx.saved_tensors
    dq, dk, dv = block_sparse_attn_bwd(dout.contiguous(), q, k, v, out, stats, *layout_tensors, *ctx.meta)
    return (dq, dk, dv) + (None,) * (_NUM_LAYOUT_TENSORS + len(ctx.meta))


block_sparse_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def layout_op_args(layout: BlockSparseLayout) -> tuple:
    """The layout as the op's arguments: ``(crow, col_slots, partial_id_slots, partial_masks, ccol, row,
    csc_partial_ids, bq, bkv, layout_batch, layout_heads, indices_checked)`` (storage slots: no read of
    the data, so a layout chosen on the device crosses the op without synchronising)."""
    return (layout.crow_indices, layout.col_slots, layout.partial_id_slots, layout.partial_masks,
            layout.ccol_indices, layout.row_indices, layout.csc_partial_ids,
            layout.BLOCK_SIZE_Q, layout.BLOCK_SIZE_KV, layout.layout_batch, layout.layout_heads, layout.checked)


def block_sparse_attention_op(q: Tensor, k: Tensor, v: Tensor, layout: BlockSparseLayout, *,
                              causal=False, sm_scale: float | None = None,
                              return_lse: bool = False, backend: str = "auto"):
    """Same contract as :func:`sparse_io_attn.block_sparse_attention`, through the custom ops.

    Use this one inside code you ``torch.compile``; it runs the same prologue
    (:func:`sparse_io_attn.block_sparse.api.prologue`), then calls
    ``torch.ops.sparse_io_attn.block_sparse_attn_fwd``. The layout's transposed indices are built
    (once, cached on the layout) before the call.
    """
    call = prologue(q, k, v, layout, causal=causal, sm_scale=sm_scale, backend=backend)
    out, lse, _ = block_sparse_attn_fwd(q, k, v, *layout_op_args(call.layout), call.causal_offset, call.sm_scale,
                                        call.backend)
    return (out, lse) if return_lse else out
