"""Backend ``"triton"``: host launchers of the block-sparse kernels.

Implements the backend interface of :mod:`sparse_io_attn.block_sparse.op` (inputs arrive validated, the
plan on the tensors' device):

* ``forward(q, k, v, plan, *, sm_scale) -> (out, lse, stats)``, ``lse`` fp32 ``[B, Hq, Nq]`` in
  natural-log units, ``-inf`` on rows with no allowed key (whose output is 0); ``stats`` fp32
  ``[2, B, Hq, Nq]``: base-2 row maximum and log2 row sum, for backward.
* ``backward(do, q, k, v, out, stats, plan, *, sm_scale) -> (dq, dk, dv)``, dk/dv summed over the
  query heads of a GQA group; deterministic (no atomics on data).

The kernels walk the lists of an :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan`:
partial blocks masked, full blocks unmasked. Each launch is described once by a *call* (kernel,
grid, counter names, configs, arguments: the attention kit's
:class:`~sparse_io_attn._attention.triton.launch.Call`; :func:`forward_calls`, :func:`backward_calls`),
run by the kit's :func:`~sparse_io_attn._attention.triton.launch.run` and compiled for a GPU
architecture by :mod:`.report` from the same calls. Launch configurations (tiles, warps, stages) come from :func:`sparse_io_attn.block_sparse.tiles.kernel_configs`:
on CUDA the kernels are autotuned over them, otherwise (interpreter, counting with
:class:`~sparse_io_attn.accounting.IOCounter`, ``SPARSE_IO_ATTN_NO_AUTOTUNE=1``) the first runs,
whose tiles the traffic model assumes by default; :func:`launched_tiles` gives the tiles the last
launches used (pass them to the traffic model after autotuning).
"""
from __future__ import annotations

import functools

import torch

from sparse_io_attn._attention.tiles import DECODE_MAX_QUERIES, padded_head_dim, tile_head_dim
from sparse_io_attn._attention.delta import residual_made
from sparse_io_attn._attention.sinks import sinks_base2
from sparse_io_attn._attention.triton.launch import (Call, backward_outputs, decode_partial, forward_outputs,
                                                     last_tiles, merge_call, preprocess_call, residual_args,
                                                     residual_output, run, run_calls, sink_args, strides)
from sparse_io_attn._attention.triton.launch import row_delta as _row_delta
from sparse_io_attn._triton.runtime import check_device, density_bucket, dot_dtype
from sparse_io_attn.block_sparse.plan import AttentionPlan, BlockLists
from sparse_io_attn.block_sparse.tiles import KernelTiles, choose_tiles, decode_config, kernel_configs
from sparse_io_attn.block_sparse.traffic import DECODE_TENSORS, DKDV_TENSORS, DQ_TENSORS, FWD_TENSORS
from sparse_io_attn.block_sparse.triton.bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
from sparse_io_attn.block_sparse.triton.decode import _attn_decode_kernel
from sparse_io_attn.block_sparse.triton.fwd import _attn_fwd_kernel

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

TUNE_KEY = ("seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "HEAD_DIM", "IS_CAUSAL", "BLOCK_SIZE_Q", "BLOCK_SIZE_KV")
KERNEL_NAMES = ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv")


@functools.lru_cache(maxsize=None)
def _configs(kind: str, block_size: tuple, head_dim: int, dtype: torch.dtype) -> tuple:
    """The ``triton.Config`` candidates of ``kind`` (:func:`~sparse_io_attn.block_sparse.tiles.kernel_configs`),
    built once per (kernel, block size, head dim, dtype)."""
    return tuple(triton.Config(c.constexprs(), num_warps=c.num_warps,
                               num_stages=c.num_stages) for c in kernel_configs(kind, block_size, head_dim, dtype))


def _common(q, k, v, plan: AttentionPlan, sm_scale: float) -> dict:
    B, Hq, Nq, D = q.shape
    Dv = v.shape[3]
    stride_lb, stride_lh = plan.layout_strides(B, Hq)
    causal_offset = plan.causal_offset
    head_dim, head_dim_v = padded_head_dim(D), padded_head_dim(Dv)
    return dict(stride_lb=stride_lb, stride_lh=stride_lh, seqlen_q=Nq, seqlen_k=k.shape[2],
                num_heads_q=Hq, num_heads_kv=k.shape[1], head_dim=D, head_dim_v=Dv, sm_scale=float(sm_scale),
                causal_offset=0 if causal_offset is None else int(causal_offset),
                BLOCK_SIZE_Q=plan.BLOCK_SIZE_Q, BLOCK_SIZE_KV=plan.BLOCK_SIZE_KV,
                MASK_WORDS=plan.masks.shape[-1], HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, DV_IS_D=Dv == D,
                EVEN_D=head_dim == D and head_dim_v == Dv,
                IS_CAUSAL=causal_offset is not None, DOT_DTYPE=dot_dtype(q.dtype), ELEM_BYTES=q.element_size())


def _lists(lists: BlockLists, masks: torch.Tensor) -> dict:
    return dict(full_ptr_ptr=lists.full_ptr, full_idx_ptr=lists.full_idx, part_ptr_ptr=lists.part_ptr,
                part_idx_ptr=lists.part_idx, part_mask_ptr=lists.part_mask, mask_ptr=masks)


def _forward_call(q, k, v, out, lse, stats, plan: AttentionPlan, sm_scale: float, sinks2=None, res=None) -> Call:
    B, Hq, Nq, D = q.shape
    return Call("attn_fwd", _attn_fwd_kernel, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq),
                FWD_TENSORS, _configs("fwd", plan.block_size, tile_head_dim(D, v.shape[3]), q.dtype), dict(
                    q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats,
                    **_lists(plan.rows, plan.masks), **strides(q, "q"), **strides(k, "k"), **strides(v, "v"),
                    **strides(out, "o"), num_q_blocks=plan.num_q_blocks, stats_stride=B * Hq * Nq,
                    **sink_args(sinks2, lse), **residual_args(res, out), **_common(q, k, v, plan, sm_scale)),
                density_bucket(plan.kept_fraction))


def forward_calls(q, k, v, plan: AttentionPlan, sm_scale: float, sinks2=None):
    """``(call, out, lse, stats)``: the forward launch and its (uninitialised) outputs (``sinks2``: the
    heads' sinks in base-2 units, :func:`~sparse_io_attn._attention.triton.launch.sink_args`)."""
    out, lse, stats = forward_outputs(q, v)
    return _forward_call(q, k, v, out, lse, stats, plan, sm_scale, sinks2), out, lse, stats


def decode_calls(q, k, v, plan: AttentionPlan, sm_scale: float, sinks2=None):
    """``(calls, out, lse, stats)``: the decode launches (split-K over each row's kept blocks; a merge
    when the rows are split: :func:`~sparse_io_attn.block_sparse.tiles.decode_config`) and their
    (uninitialised) outputs. K and V are passed as they are (any strides)."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    cfg = decode_config(plan, B, Hq, Hkv, tile_head_dim(D, v.shape[3]), q.dtype)
    out, lse, stats = forward_outputs(q, v)
    common = _common(q, k, v, plan, sm_scale)
    rows = B * Hq * Nq
    partial = decode_partial(cfg.splits, rows, common["HEAD_DIM_V"], q.device)
    config = triton.Config({}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (cfg.splits, B * (Hq // cfg.heads) * plan.num_q_blocks)
    calls = [Call("attn_decode", _attn_decode_kernel, grid, DECODE_TENSORS, [config], dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats, partial_ptr=partial,
        **_lists(plan.rows, plan.masks), **strides(q, "q"), **strides(k, "k"), **strides(v, "v"),
        **strides(out, "o"), num_q_blocks=plan.num_q_blocks, stats_stride=rows, HEADS=cfg.heads,
        TOKENS=cfg.tokens, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.splits,
        **sink_args(sinks2 if cfg.splits == 1 else None, lse), **common))]
    if cfg.splits > 1:
        calls.append(merge_call("attn_decode_merge", partial, out, lse, stats, cfg.splits, common["HEAD_DIM_V"],
                                sinks2))
    return calls, out, lse, stats


def _backward_calls(do, q, k, v, out, stats, delta, dq, dk, dv, plan: AttentionPlan, sm_scale: float,
                    preprocess: bool = True) -> list:
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    common = _common(q, k, v, plan, sm_scale)
    bucket = density_bucket(plan.kept_fraction)
    tile_dim = tile_head_dim(D, v.shape[3])
    dkdv = Call("attn_bwd_dkdv", _attn_bwd_dkdv_kernel, lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * Hkv),
                DKDV_TENSORS, _configs("dkdv", plan.block_size, tile_dim, q.dtype), dict(
                    q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv,
                    **_lists(plan.cols, plan.masks), **strides(q, "q"), **strides(k, "k"), **strides(v, "v"),
                    **strides(do, "do"), **strides(dk, "dk"), **strides(dv, "dv"),
                    num_kv_blocks=plan.num_kv_blocks, stats_stride=B * Hq * Nq, **common), bucket)
    dq_call = Call("attn_bwd_dq", _attn_bwd_dq_kernel, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq),
                   DQ_TENSORS, _configs("dq", plan.block_size, tile_dim, q.dtype), dict(
                       q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dq_ptr=dq,
                       **_lists(plan.rows, plan.masks), **strides(q, "q"), **strides(k, "k"),
                       **strides(v, "v"), **strides(do, "do"), **strides(dq, "dq"),
                       num_q_blocks=plan.num_q_blocks, stats_stride=B * Hq * Nq, **common), bucket)
    if not preprocess:      # (the caller formed ``delta``: :func:`row_delta`)
        return [dkdv, dq_call]
    pre_m = _configs("dq", plan.block_size, tile_dim, q.dtype)[0].kwargs["BLOCK_M"]
    return [preprocess_call("attn_bwd_preprocess", out, do, delta, pre_m, common["HEAD_DIM_V"]), dkdv, dq_call]


def backward_calls(do, q, k, v, out, stats, plan: AttentionPlan, sm_scale: float):
    """``([preprocess, dkdv, dq] calls, dq, dk, dv)``: the backward launches, in order, and their outputs."""
    delta, dq, dk, dv = backward_outputs(q, k, v)
    return _backward_calls(do, q, k, v, out, stats, delta, dq, dk, dv, plan, sm_scale), dq, dk, dv


def tiles_for(q: torch.Tensor, block_size, v: torch.Tensor | None = None) -> KernelTiles:
    """The default kernel tiles for these inputs (``v``: when its head dim is not q's) and
    ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` (what the traffic model assumes by default)."""
    return choose_tiles(block_size, tile_head_dim(q.shape[-1], None if v is None else v.shape[-1]), q.dtype)


def launched_tiles() -> KernelTiles | None:
    """The tiles the last forward and backward launches used (autotuning's choice on CUDA), for
    :func:`sparse_io_attn.accounting.traffic.block_sparse` ``(tiles=...)``; None before any launch."""
    tiles = last_tiles(*KERNEL_NAMES)
    if tiles is None:
        return None
    fwd, dq, dkdv = tiles
    return KernelTiles(fwd=fwd, dq=dq, dkdv=dkdv, preprocess=dq[0])


def _key(kind: str, q, k, v, plan: AttentionPlan, sm_scale: float, *more) -> tuple:
    """What the calls' non-tensor arguments depend on (:func:`~sparse_io_attn._attention.triton.launch.run_calls`):
    the plan's integers and causal offset (not its identity: a new plan of the same shapes, a new layout
    every step, reuses the launches), shapes, strides, dtype, ``sm_scale``."""
    return (kind, plan.meta[:-1], plan.causal_offset, sm_scale, q.shape, q.stride(), k.shape, k.stride(),
            v.shape, v.stride(), q.dtype, *more)


def forward(q, k, v, plan: AttentionPlan, *, sm_scale: float, decode: bool | None = None,
            sinks: torch.Tensor | None = None, residual: bool = False):
    """``decode``: run the decode kernels (:func:`decode_calls`); ``None`` (default): when ``Nq <= 16``
    and no residual is asked for. ``sinks [Hq]``: each head's sink logit, folded into every row when it
    is stored. ``residual``: a 16-bit forward also returns its output's rounding residual (``(out, lse,
    stats, residual)``; :mod:`sparse_io_attn._attention.delta`), for :func:`row_delta`."""
    check_device(q, "backend 'triton'")
    sinks2 = None if sinks is None else sinks_base2(sinks)
    made = residual_made(q.dtype, residual)
    if decode is None:
        decode = q.shape[2] <= DECODE_MAX_QUERIES and not made
    if decode:
        calls, out, lse, stats = decode_calls(q, k, v, plan, sm_scale, sinks2)
        for call in calls:
            run(call, q.device, TUNE_KEY)
        return out, lse, stats
    out, lse, stats = forward_outputs(q, v)
    res = residual_output(out, made)
    extra = tuple(t for t in (sinks2, res) if t is not None)
    run_calls(_key("fwd", q, k, v, plan, sm_scale, sinks2 is not None, res is not None),
              lambda: [_forward_call(q, k, v, out, lse, stats, plan, sm_scale, sinks2, res)],
              (q, k, v, out, lse, stats, *plan.rows.tensors(), plan.masks, *extra), TUNE_KEY)
    return (out, lse, stats) if res is None else (out, lse, stats, res)


def row_delta(do, out, residual):
    """fp32 ``[B, Hq, Nq]`` ``rowsum(dO * (O + r))``: the ``attn_bwd_preprocess`` launch, run for the op's
    autograd kernel (which then passes it as ``backward(..., delta=)``)."""
    return _row_delta("attn_bwd_preprocess", do, out, residual, padded_head_dim(out.shape[-1]))


def backward(do, q, k, v, out, stats, plan: AttentionPlan, *, sm_scale: float, delta: torch.Tensor | None = None):
    """``delta``: the row deltas the caller formed (:func:`row_delta`); otherwise the backward's own
    preprocess forms them from ``out``."""
    check_device(q, "backend 'triton'")
    do, stats = do.to(q.dtype), stats.contiguous()
    own, dq, dk, dv = backward_outputs(q, k, v)
    delta = own if delta is None else delta.to(torch.float32).contiguous()
    run_calls(_key("bwd", q, k, v, plan, sm_scale, do.stride(), out.stride(), delta is own),
              lambda: _backward_calls(do, q, k, v, out, stats, delta, dq, dk, dv, plan, sm_scale, delta is own),
              (do, q, k, v, out, stats, delta, dq, dk, dv, *plan.rows.tensors(), *plan.cols.tensors(), plan.masks),
              TUNE_KEY)
    return dq, dk, dv
