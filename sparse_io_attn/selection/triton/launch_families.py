"""Launch descriptions of the key-major (``"key"``) and element-masked (``"masked"``) selection families
(:func:`~sparse_io_attn.selection.tiles.kernel_family`), as the attention kit's
:class:`~sparse_io_attn._attention.triton.launch.Call`\\ s that :mod:`.launch` runs and :mod:`.report`
compiles, and the arguments every selection kernel shares (:func:`common_args`).

Each family's tiles come from :func:`~sparse_io_attn.selection.tiles.family_tiles` (shapes and dtype
only); the work lists they walk are derived from the plan once per tile shape and kept with it
(:meth:`~sparse_io_attn.selection.plan.SelectionPlan.derived`, :mod:`~sparse_io_attn.selection.worklists`).
On CUDA each family kernel is autotuned over its warps/stages candidates; its tiles stay fixed.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.tiles import padded_head_dim, tile_head_dim
from sparse_io_attn._attention.triton.launch import (MERGE_ROWS, PREPROCESS_BLOCK_M, Call, forward_outputs,
                                                     preprocess_call, residual_args, sink_args, strides)
from sparse_io_attn._triton.runtime import dot_dtype
from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import FamilyTiles, family_tiles, kernel_configs, key_tile, sel_heads
from sparse_io_attn.selection.traffic_terms import (DECODE_TENSORS, DKDV_TENSORS, DQ_MERGE_TENSORS, DQ_TENSORS,
                                                    FWD_TENSORS, MERGE_TENSORS)
from sparse_io_attn.selection.triton.bwd import _sel_bwd_dkdv_kernel
from sparse_io_attn.selection.triton.key import _key_dq_merge_kernel, _key_fwd_kernel, _key_merge_kernel
from sparse_io_attn.selection.triton.launch_plan import (device_key_lists, device_key_work, device_masked_tiles,
                                                         on_device)
from sparse_io_attn.selection.triton.masked import _masked_dkdv_kernel, _masked_rows_kernel
from sparse_io_attn.selection.worklists import KeyWork, MaskedTiles, key_work, masked_tiles

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

MERGE_CONFIG = triton.Config({}, num_warps=4, num_stages=2)


def common_args(q, k, v, plan: SelectionPlan, sm_scale: float) -> dict:
    """The keyword arguments every selection kernel takes: head map, lengths, head dims (q/k's, v's), scale,
    causality, tiles' shared constexprs."""
    B, Hq, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    hm = plan.head_map(B, Hq, Hkv)
    head_dim, head_dim_v = padded_head_dim(D), padded_head_dim(Dv)
    delta = plan.causal_offset
    return dict(stride_lb=hm.stride_lb, heads_per_selection=hm.heads_per_selection, seqlen_q=Nq,
                seqlen_k=k.shape[2], num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D, head_dim_v=Dv,
                sm_scale=float(sm_scale), causal_offset=0 if delta is None else int(delta), BLOCK_SIZE=plan.block_size,
                SEL_HEADS=sel_heads(Hq, Hkv, plan.num_selections), HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                DV_IS_D=Dv == D, EVEN_D=head_dim == D and head_dim_v == Dv, IS_CAUSAL=delta is not None,
                DOT_DTYPE=dot_dtype(q.dtype), ELEM_BYTES=q.element_size())


def tile_dim(common: dict) -> int:
    """The head dim a call's tiles are chosen for (:func:`~sparse_io_attn._attention.tiles.tile_head_dim`)."""
    return tile_head_dim(common["head_dim"], common["head_dim_v"])


def preprocess_of(out, do, delta, common: dict, preprocess: bool = True) -> list:
    """``[selection_bwd_preprocess]`` forming ``delta = rowsum(dO * O)`` into the buffer ``delta``, or no launch
    when not ``preprocess`` (the caller formed ``delta``: :func:`~.launch.row_delta`)."""
    return [preprocess_call("selection_bwd_preprocess", out, do, delta, PREPROCESS_BLOCK_M,
                            common["HEAD_DIM_V"])] if preprocess else []


def table_args(plan: SelectionPlan) -> dict:
    """A kernel's block-table arguments: ``table_ptr`` (the plan's table, :mod:`~sparse_io_attn.selection.varlen`;
    its ``row_counts``, never read, on the fixed grid), ``num_kv_blocks`` and ``IS_VARLEN``."""
    return dict(table_ptr=plan.row_counts if plan.table is None else plan.table, num_kv_blocks=plan.num_kv_blocks,
                IS_VARLEN=plan.varlen)


def _configs(t: FamilyTiles) -> list:
    """The autotuning candidates: the family's fixed tiles, each (warps, stages) pair."""
    return [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=w, num_stages=s)
            for w, s in t.launches]


def _units(q, k, plan: SelectionPlan, common: dict) -> int:
    """Programs per stored selection along axis 1: batch elements using it x units of ``R`` heads."""
    mult = 1 if plan.batched else q.shape[0]
    return mult * (common["heads_per_selection"] // common["SEL_HEADS"])


def key_tiles_of(q, plan: SelectionPlan, common: dict) -> FamilyTiles:
    return family_tiles("key", plan.block_size, tile_dim(common), q.dtype, common["SEL_HEADS"])


def plan_keys(plan: SelectionPlan):
    """The plan's key-major lists (built once, kept with the plan; on CUDA by the device builder)."""
    return plan.keys(build=device_key_lists if on_device(plan.rows) else None)


def key_work_of(plan: SelectionPlan, block_t: int) -> KeyWork:
    """The plan's key-major work tiles of ``block_t`` tokens (built once, kept with the plan; on CUDA with
    the lists by the device builders, :mod:`.launch_plan`)."""
    def build():
        if on_device(plan.rows):
            return device_key_work(plan, block_t)
        entries = plan.num_layouts * plan.seqlen[0] * plan.max_blocks
        return key_work(plan.keys(), plan.num_layouts, plan.num_kv_blocks, entries, block_t)
    return plan.derived(("key_work", block_t), build)


def key_forward_calls(q, k, v, plan: SelectionPlan, sm_scale: float, outputs: tuple | None = None, sinks2=None,
                      res=None):
    """``([key_fwd, key_merge], out, lse, stats)``: the key-major forward (each key block against the
    tiles of tokens that chose it, partials per (row, slot)) and the merge of each row's slots (``outputs``:
    the buffers, :func:`forward_outputs`, allocated here when not given; ``res``: the rounding residual's
    buffer, :func:`~sparse_io_attn._attention.triton.launch.residual_output`)."""
    B, Hq, Nq, D = q.shape
    common = common_args(q, k, v, plan, sm_scale)
    t = key_tiles_of(q, plan, common)
    work = key_work_of(plan, t.block_t)
    keys = plan_keys(plan)
    rows = B * Hq * Nq
    partial = torch.empty(plan.max_blocks, rows, 2 + common["HEAD_DIM_V"], dtype=torch.float32, device=q.device)
    out, lse, stats = forward_outputs(q, v) if outputs is None else outputs
    grid = (work.capacity, _units(q, k, plan, common))
    fwd = Call("selection_key_fwd", _key_fwd_kernel, lambda meta: grid, DECODE_TENSORS, _configs(t), dict(
        q_ptr=q, k_ptr=k, v_ptr=v, partial_ptr=partial, work_ptr=work.work, col_ptr_ptr=keys.col_ptr,
        col_query_ptr=keys.col_query, col_slot_ptr=keys.col_slot, **strides(q, "q"), **strides(k, "k"),
        **strides(v, "v"), num_selections=plan.num_selections, units=grid[1] // (1 if plan.batched else B),
        **table_args(plan), work_capacity=work.capacity, num_rows=rows, SEL_ROWS=t.sel_rows,
        **{a: x for a, x in common.items() if a != "stride_lb"}))
    merge = Call("selection_key_merge", _key_merge_kernel, (triton.cdiv(rows, MERGE_ROWS),), MERGE_TENSORS,
                 [MERGE_CONFIG], dict(
                     partial_ptr=partial, o_ptr=out, lse_ptr=lse, stats_ptr=stats, row_counts_ptr=plan.row_counts,
                     **strides(out, "o"), stride_lb=common["stride_lb"],
                     heads_per_selection=common["heads_per_selection"], num_rows=rows, seqlen_q=Nq, num_heads_q=Hq,
                     head_dim=v.shape[3], BLOCK_R=MERGE_ROWS, HEAD_DIM=common["HEAD_DIM_V"],
                     ELEM_BYTES=q.element_size(), **sink_args(sinks2, lse), **residual_args(res, out)))
    return [fwd, merge], out, lse, stats


def _dkdv_configs(q: torch.Tensor, plan: SelectionPlan, key: FamilyTiles | None, head_dim: int) -> list:
    """The dK/dV kernel's candidates: the query-major family's (:func:`~.tiles.kernel_configs` for
    ``head_dim``, :func:`tile_dim`), or the key-major family's fixed tiles (``key``) with its warps/stages
    candidates."""
    if key is not None:
        return [triton.Config({"BLOCK_M": key.dkdv_m, "BLOCK_N": key.block_n, "KEY_TILES": key.key_tiles},
                              num_warps=w, num_stages=st) for w, st in key.dkdv_launches]
    out = []
    for c in kernel_configs("dkdv", plan.block_size, head_dim, q.dtype):
        n, key_tiles = key_tile(plan.block_size, c.block_n)
        out.append(triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": n, "KEY_TILES": key_tiles},
                                 num_warps=c.num_warps, num_stages=c.num_stages))
    return out


def dkdv_call(name: str, do, q, k, v, stats, delta, plan: SelectionPlan, common: dict, partial,
              key: FamilyTiles | None = None, dk=None, dv=None):
    """``(call, dk, dv)``: the key-major dK/dV kernel (:func:`.bwd._sel_bwd_dkdv_kernel`) launched as
    ``name``; with a ``partial`` buffer ``[K * KEY_TILES, B * Hq * Nq, HEAD_DIM]`` (fp32) it also writes
    each gathered row's dQ partial there (the key-major family, tiles ``key``), else not (the
    query-major family); ``dk``, ``dv``: their buffers (contiguous), allocated here when not given."""
    B, Hq, Nq, _ = q.shape
    keys, nkb = plan_keys(plan), plan.num_kv_blocks
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    call = Call(name, _sel_bwd_dkdv_kernel, lambda meta: (nkb * meta["KEY_TILES"], B * k.shape[1]), DKDV_TENSORS,
                _dkdv_configs(q, plan, key, tile_dim(common)), dict(
                    q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv,
                    col_ptr_ptr=keys.col_ptr, col_query_ptr=keys.col_query, col_slot_ptr=keys.col_slot,
                    partial_ptr=dk if partial is None else partial, **strides(q, "q"), **strides(k, "k"),
                    **strides(v, "v"), **strides(do, "do"), **strides(dk, "dk"), **strides(dv, "dv"),
                    **table_args(plan), stats_stride=B * Hq * Nq, SEL_ROWS=next_pow2(common["SEL_HEADS"]),
                    STORE_DQ=partial is not None, **common))
    return call, dk, dv


def key_dq_calls(do, q, k, v, stats, delta, plan: SelectionPlan, common: dict):
    """``([key_bwd, key_dq_merge], dq, dk, dv)``: dK/dV with the rows' dQ partials, then their merge."""
    B, Hq, Nq, D = q.shape
    rows = B * Hq * Nq
    t = key_tiles_of(q, plan, common)
    partial = torch.empty(plan.max_blocks * t.key_tiles, rows, common["HEAD_DIM"], dtype=torch.float32,
                          device=q.device)
    bwd, dk, dv = dkdv_call("selection_key_bwd", do, q, k, v, stats, delta, plan, common, partial, t)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    merge = Call("selection_key_dq_merge", _key_dq_merge_kernel, (triton.cdiv(rows, MERGE_ROWS),), DQ_MERGE_TENSORS,
                 [MERGE_CONFIG], dict(
                     partial_ptr=partial, dq_ptr=dq, rows_ptr=plan.rows, row_counts_ptr=plan.row_counts,
                     **strides(dq, "dq"), stride_lb=common["stride_lb"],
                     heads_per_selection=common["heads_per_selection"], max_blocks=plan.max_blocks, num_rows=rows,
                     **table_args(plan),
                     seqlen_q=Nq, seqlen_k=k.shape[2], num_heads_q=Hq, head_dim=D, sm_scale=common["sm_scale"],
                     BLOCK_SIZE=plan.block_size, BLOCK_N=t.block_n, KEY_TILES=t.key_tiles, BLOCK_R=MERGE_ROWS,
                     HEAD_DIM=common["HEAD_DIM"], ELEM_BYTES=q.element_size()))
    return [bwd, merge], dq, dk, dv


def masked_tiles_of(q, plan: SelectionPlan, common: dict) -> tuple[FamilyTiles, MaskedTiles]:
    """The masked family's tiles for these inputs and the plan's tile lists for them (built once, kept)."""
    t = family_tiles("masked", plan.block_size, tile_dim(common), q.dtype, common["SEL_HEADS"])

    def build():
        if on_device(plan.rows):
            return device_masked_tiles(plan, t.block_t, t.block_n)
        return masked_tiles(plan.rows, plan.block_size, plan.seqlen[1], plan.causal_offset, t.block_t, t.block_n,
                            plan.table)
    return t, plan.derived(("masked", t.block_t), build)


def _masked_args(q, k, v, plan: SelectionPlan, common: dict, t: FamilyTiles, m: MaskedTiles) -> dict:
    B, Hq, Nq, _ = q.shape
    return dict(q_ptr=q, k_ptr=k, v_ptr=v, bits_ptr=m.bits, **strides(q, "q"), **strides(k, "k"), **strides(v, "v"),
                num_query_tiles=m.row_counts.shape[1], num_key_tiles=m.col_counts.shape[1], stats_stride=B * Hq * Nq,
                SEL_ROWS=t.sel_rows, **common)


def masked_forward_calls(q, k, v, plan: SelectionPlan, sm_scale: float, outputs: tuple | None = None, sinks2=None,
                         res=None):
    """``([masked_fwd], out, lse, stats)``: each query tile against the key tiles of its tokens' union
    (``outputs``, ``res``: as :func:`key_forward_calls`)."""
    B, Hq, Nq, _ = q.shape
    common = common_args(q, k, v, plan, sm_scale)
    t, m = masked_tiles_of(q, plan, common)
    out, lse, stats = forward_outputs(q, v) if outputs is None else outputs
    grid = (m.row_counts.shape[1], B * (Hq // common["SEL_HEADS"]))
    call = Call("selection_masked_fwd", _masked_rows_kernel, lambda meta: grid, FWD_TENSORS, _configs(t), dict(
        out_ptr=out, lse_ptr=lse, stats_ptr=stats, do_ptr=q, delta_ptr=lse, union_ptr=m.union, tiles_ptr=m.row_tiles,
        counts_ptr=m.row_counts, **strides(out, "o"), **strides(q, "do"), DQ=False, **sink_args(sinks2, lse),
        **residual_args(res, out), **_masked_args(q, k, v, plan, common, t, m)))
    return [call], out, lse, stats


def masked_backward_calls(do, q, k, v, out, stats, plan: SelectionPlan, sm_scale: float, delta=None):
    """``([preprocess, masked_dkdv, masked_dq], dq, dk, dv)``: dK/dV per key tile over the query tiles
    holding a bit of it (the transposed lists), dQ per query tile as the forward walks it (``delta``: the
    row deltas the caller formed, no preprocess)."""
    B, Hq, Nq, _ = q.shape
    common = common_args(q, k, v, plan, sm_scale)
    t, m = masked_tiles_of(q, plan, common)
    own = delta is None
    delta = torch.empty(out.shape[:3], dtype=torch.float32, device=out.device) if own else delta
    pre = preprocess_of(out, do, delta, common, own)
    args = dict(do_ptr=do, stats_ptr=stats, delta_ptr=delta, tiles_ptr=m.row_tiles, counts_ptr=m.row_counts,
                **strides(do, "do"), **_masked_args(q, k, v, plan, common, t, m))
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dkdv_grid = (m.col_counts.shape[1], B * k.shape[1])
    dkdv_configs = [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "SUB_M": t.dkdv_m}, num_warps=w,
                                  num_stages=st) for w, st in t.dkdv_launches]
    dkdv = Call("selection_masked_dkdv", _masked_dkdv_kernel, lambda meta: dkdv_grid, DKDV_TENSORS, dkdv_configs,
                dict(args, dk_ptr=dk, dv_ptr=dv, union_ptr=m.col_union, tiles_ptr=m.col_tiles, counts_ptr=m.col_counts,
                     **strides(dk, "dk"), **strides(dv, "dv")))
    dq_grid = (m.row_counts.shape[1], B * (Hq // common["SEL_HEADS"]))
    dq_call = Call("selection_masked_dq", _masked_rows_kernel, lambda meta: dq_grid, DQ_TENSORS, _configs(t),
                   dict(args, out_ptr=dq, lse_ptr=delta, union_ptr=m.union, DQ=True, **sink_args(None, delta), **residual_args(None, delta),
                        **strides(dq, "o")))
    return [*pre, dkdv, dq_call], dq, dk, dv


__all__ = ["common_args", "preprocess_of", "dkdv_call", "plan_keys", "key_dq_calls", "key_forward_calls", "key_tiles_of",
           "key_work_of", "masked_backward_calls", "masked_forward_calls", "masked_tiles_of", "table_args", "tile_dim"]
