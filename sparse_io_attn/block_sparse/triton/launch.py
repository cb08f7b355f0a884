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
grid, counter names, configs, arguments: :func:`forward_calls`, :func:`backward_calls`), used by
the launchers and by :mod:`.report`, which compiles the same calls for a GPU architecture. Launch
configurations (tiles, warps, stages) come from :func:`sparse_io_attn.block_sparse.tiles.kernel_configs`:
on CUDA the kernels are autotuned over them, otherwise (interpreter, counting with
:class:`~sparse_io_attn.accounting.IOCounter`, ``SPARSE_IO_ATTN_NO_AUTOTUNE=1``) the first runs,
whose tiles the traffic model assumes by default; :func:`launched_tiles` gives the tiles the last
launches used (pass them to the traffic model after autotuning).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparse_io_attn._triton.runtime import check_device, dot_dtype, launch
from sparse_io_attn.block_sparse.plan import AttentionPlan, BlockLists
from sparse_io_attn.block_sparse.tiles import (DECODE_MAX_QUERIES, KernelTiles, choose_tiles, decode_config,
                                               kernel_configs, padded_head_dim)
from sparse_io_attn.block_sparse.traffic import (DECODE_MERGE_TENSORS, DECODE_TENSORS, DKDV_TENSORS, DQ_TENSORS,
                                                 FWD_TENSORS, PREPROCESS_TENSORS)
from sparse_io_attn.block_sparse.triton.bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
                                                    _attn_bwd_preprocess_kernel)
from sparse_io_attn.block_sparse.triton.decode import _attn_decode_kernel, _attn_decode_merge_kernel
from sparse_io_attn.block_sparse.triton.fwd import _attn_fwd_kernel

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

TUNE_KEY = ("seqlen_q", "seqlen_k", "head_dim", "HEAD_DIM", "IS_CAUSAL", "BLOCK_SIZE_Q", "BLOCK_SIZE_KV")
PREPROCESS_CONFIG = triton.Config({}, num_warps=4, num_stages=1)
MERGE_ROWS = 16   # rows per program of the decode merge
_LAST_TILES: dict[str, tuple[int, int]] = {}


@dataclass
class Call:
    """One kernel launch: ``kernel[grid(meta)](**kwargs, **config.kwargs)`` for ``config`` in ``configs``."""
    name: str
    kernel: object
    grid: object
    tensors: tuple
    configs: list
    kwargs: dict = field(default_factory=dict)


def _configs(kind: str, q: torch.Tensor, plan: AttentionPlan) -> list:
    return [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in kernel_configs(kind, plan.block_size, q.shape[-1], q.dtype)]


def _strides(t: torch.Tensor, prefix: str) -> dict:
    return {f"stride_{prefix}{ax}": s for ax, s in zip("zh" + ("n" if prefix in ("k", "v", "dk", "dv") else "m") + "d",
                                                         t.stride())}


def _common(q, k, plan: AttentionPlan, sm_scale: float) -> dict:
    B, Hq, Nq, D = q.shape
    stride_lb, stride_lh = plan.layout_strides(B, Hq)
    causal_offset = plan.causal_offset
    head_dim = padded_head_dim(D)
    return dict(stride_lb=stride_lb, stride_lh=stride_lh, seqlen_q=Nq, seqlen_k=k.shape[2],
                num_heads_q=Hq, num_heads_kv=k.shape[1], head_dim=D, sm_scale=float(sm_scale),
                causal_offset=0 if causal_offset is None else int(causal_offset),
                BLOCK_SIZE_Q=plan.BLOCK_SIZE_Q, BLOCK_SIZE_KV=plan.BLOCK_SIZE_KV,
                MASK_WORDS=plan.masks.shape[-1], HEAD_DIM=head_dim, EVEN_D=head_dim == D,
                IS_CAUSAL=causal_offset is not None, DOT_DTYPE=dot_dtype(q.dtype), ELEM_BYTES=q.element_size())


def _lists(lists: BlockLists, masks: torch.Tensor) -> dict:
    return dict(full_ptr_ptr=lists.full_ptr, full_idx_ptr=lists.full_idx, part_ptr_ptr=lists.part_ptr,
                part_idx_ptr=lists.part_idx, part_mask_ptr=lists.part_mask, mask_ptr=masks)


def forward_calls(q, k, v, plan: AttentionPlan, sm_scale: float):
    """``(call, out, lse, stats)``: the forward launch and its (uninitialised) outputs."""
    B, Hq, Nq, D = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, B, Hq, Nq, dtype=torch.float32, device=q.device)
    call = Call("attn_fwd", _attn_fwd_kernel, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq),
                FWD_TENSORS, _configs("fwd", q, plan), dict(
                    q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats,
                    **_lists(plan.rows, plan.masks), **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"),
                    **_strides(out, "o"), num_q_blocks=plan.num_q_blocks, stats_stride=B * Hq * Nq,
                    **_common(q, k, plan, sm_scale)))
    return call, out, lse, stats


def decode_calls(q, k, v, plan: AttentionPlan, sm_scale: float):
    """``(calls, out, lse, stats)``: the decode launches (split-K over each row's kept blocks; a merge
    when the rows are split: :func:`~sparse_io_attn.block_sparse.tiles.decode_config`) and their
    (uninitialised) outputs. K and V are passed as they are (any strides)."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    cfg = decode_config(plan, B, Hq, Hkv, D, q.dtype)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, B, Hq, Nq, dtype=torch.float32, device=q.device)
    common = _common(q, k, plan, sm_scale)
    rows = B * Hq * Nq
    partial = torch.empty((cfg.splits, rows, 2 + common["HEAD_DIM"]) if cfg.splits > 1 else (1,),
                          dtype=torch.float32, device=q.device)   # [splits, rows, m, l, acc]
    config = triton.Config({}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (cfg.splits, B * (Hq // cfg.heads) * plan.num_q_blocks)
    calls = [Call("attn_decode", _attn_decode_kernel, grid, DECODE_TENSORS, [config], dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats, partial_ptr=partial,
        **_lists(plan.rows, plan.masks), **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"),
        **_strides(out, "o"), num_q_blocks=plan.num_q_blocks, stats_stride=rows, HEADS=cfg.heads,
        TOKENS=cfg.tokens, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.splits, **common))]
    if cfg.splits > 1:
        calls.append(Call("attn_decode_merge", _attn_decode_merge_kernel, (triton.cdiv(rows, MERGE_ROWS),),
                          DECODE_MERGE_TENSORS, [triton.Config({}, num_warps=4, num_stages=2)], dict(
                              partial_ptr=partial, o_ptr=out, lse_ptr=lse, stats_ptr=stats, **_strides(out, "o"),
                              num_rows=rows, seqlen_q=Nq, num_heads_q=Hq, head_dim=D, BLOCK_R=MERGE_ROWS,
                              HEAD_DIM=common["HEAD_DIM"], NUM_SPLITS=cfg.splits,
                              ELEM_BYTES=common["ELEM_BYTES"])))
    return calls, out, lse, stats


def backward_calls(do, q, k, v, out, stats, plan: AttentionPlan, sm_scale: float):
    """``([preprocess, dkdv, dq] calls, dq, dk, dv)``: the backward launches, in order, and their outputs."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    common = _common(q, k, plan, sm_scale)
    delta = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    pre_m = kernel_configs("dq", plan.block_size, D, q.dtype)[0].block_m
    pre = Call("attn_bwd_preprocess", _attn_bwd_preprocess_kernel, (triton.cdiv(Nq, pre_m), B * Hq),
               PREPROCESS_TENSORS, [PREPROCESS_CONFIG], dict(
                   o_ptr=out, do_ptr=do, delta_ptr=delta, **_strides(out, "o"), **_strides(do, "do"),
                   seqlen_q=Nq, num_heads_q=Hq, head_dim=D, BLOCK_M=pre_m, HEAD_DIM=common["HEAD_DIM"],
                   ELEM_BYTES=common["ELEM_BYTES"]))
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dkdv = Call("attn_bwd_dkdv", _attn_bwd_dkdv_kernel, lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * Hkv),
                DKDV_TENSORS, _configs("dkdv", q, plan), dict(
                    q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv,
                    **_lists(plan.cols, plan.masks), **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"),
                    **_strides(do, "do"), **_strides(dk, "dk"), **_strides(dv, "dv"),
                    num_kv_blocks=plan.num_kv_blocks, stats_stride=B * Hq * Nq, **common))
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dq_call = Call("attn_bwd_dq", _attn_bwd_dq_kernel, lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq),
                   DQ_TENSORS, _configs("dq", q, plan), dict(
                       q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dq_ptr=dq,
                       **_lists(plan.rows, plan.masks), **_strides(q, "q"), **_strides(k, "k"),
                       **_strides(v, "v"), **_strides(do, "do"), **_strides(dq, "dq"),
                       num_q_blocks=plan.num_q_blocks, stats_stride=B * Hq * Nq, **common))
    return [pre, dkdv, dq_call], dq, dk, dv


def _run(call: Call, device) -> None:
    if call.grid.__class__ is tuple:   # fixed tiles (preprocess): no tile autotuning
        launch(call.kernel, call.grid, call.name, call.tensors, device, **call.kwargs,
               num_warps=call.configs[0].num_warps, num_stages=call.configs[0].num_stages)
        return
    used = launch(call.kernel, call.grid, call.name, call.tensors, device, configs=call.configs, key=TUNE_KEY,
                  **call.kwargs)
    _LAST_TILES[call.name] = (used.kwargs["BLOCK_M"], used.kwargs["BLOCK_N"])


def tiles_for(q: torch.Tensor, block_size) -> KernelTiles:
    """The default kernel tiles for these inputs and ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` (what the
    traffic model assumes by default)."""
    return choose_tiles(block_size, q.shape[-1], q.dtype)


def launched_tiles() -> KernelTiles | None:
    """The tiles the last forward and backward launches used (autotuning's choice on CUDA), for
    :func:`sparse_io_attn.accounting.traffic.block_sparse` ``(tiles=...)``; None before any launch."""
    if not all(k in _LAST_TILES for k in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv")):
        return None
    return KernelTiles(fwd=_LAST_TILES["attn_fwd"], dq=_LAST_TILES["attn_bwd_dq"], dkdv=_LAST_TILES["attn_bwd_dkdv"],
                       preprocess=_LAST_TILES["attn_bwd_dq"][0])


def forward(q, k, v, plan: AttentionPlan, *, sm_scale: float, decode: bool | None = None):
    """``decode``: run the decode kernels (:func:`decode_calls`); ``None`` (default): when ``Nq <= 16``."""
    check_device(q, "backend 'triton'")
    if decode is None:
        decode = q.shape[2] <= DECODE_MAX_QUERIES
    if decode:
        calls, out, lse, stats = decode_calls(q, k, v, plan, sm_scale)
        for call in calls:
            _run(call, q.device)
        return out, lse, stats
    call, out, lse, stats = forward_calls(q, k, v, plan, sm_scale)
    _run(call, q.device)
    return out, lse, stats


def backward(do, q, k, v, out, stats, plan: AttentionPlan, *, sm_scale: float):
    check_device(q, "backend 'triton'")
    calls, dq, dk, dv = backward_calls(do.to(q.dtype), q, k, v, out, stats.contiguous(), plan, sm_scale)
    for call in calls:
        _run(call, q.device)
    return dq, dk, dv
