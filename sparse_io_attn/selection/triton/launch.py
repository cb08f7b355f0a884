"""Backend ``"triton"`` of :func:`~sparse_io_attn.selection.api.selection_attention`: host launchers of
the selection kernels.

Implements the backend interface of :mod:`sparse_io_attn.selection.api` (inputs arrive validated, the
plan on the tensors' device):

* ``forward(q, k, v, plan, *, sm_scale) -> (out, lse, stats)``: ``lse`` fp32 ``[B, Hq, Nq]`` natural
  log, ``-inf`` on rows with no allowed key (output 0); ``stats`` fp32 ``[2, B, Hq, Nq]``: base-2 row
  maximum and log2 row sum (``+inf``/``0`` on empty rows), for backward.
* ``backward(do, q, k, v, out, stats, plan, *, sm_scale) -> (dq, dk, dv)``: dk/dv summed over each
  GQA group; deterministic (no atomics on data).

Three kernel families run the prefill forward and the backward, chosen per call from the plan and the
shapes (:func:`family`, :func:`~sparse_io_attn.selection.tiles.kernel_family`; ``family_name=`` or
``$SPARSE_IO_ATTN_TRITON_SELECTION_FAMILY`` force one):

* ``"query"`` (a selection shared by 16 heads or more of a KV head: their rows fill a tile): the forward
  and dQ query-major (one program per query token and unit of heads sharing a selection and a KV head,
  :mod:`.fwd`), dK/dV key-major over ``plan.keys()`` (:mod:`.bwd`);
* ``"key"`` (blocks of 16 keys and more: MoBA, NSA): key-major gathered tiles (:mod:`.key`): the forward
  per tile of tokens of a key-major list, partials merged per row in slot order; dK/dV writing each
  gathered row's dQ partial, merged likewise (:mod:`.launch_families`);
* ``"masked"`` (smaller blocks: DSA's single tokens): tiles of consecutive tokens x 64 consecutive keys
  with an element mask (:mod:`.masked`).

For ``Nq <= 16`` the forward runs the decode kernels (:mod:`.decode`: the query-major row programs
split-K over each row's key steps, then a merge in split order; :func:`decode_calls`), whose outputs
every family's backward takes; they read the plan's rows only, never its key lists. Each launch is
described once by the attention kit's :class:`~sparse_io_attn._attention.triton.launch.Call`
(:func:`forward_calls`, :func:`backward_calls`, :data:`FORWARD_CALLS`, :data:`BACKWARD_CALLS`), used by
the launchers and by :mod:`.report`, which compiles the same calls for a GPU architecture. The
query-major configurations come from :func:`sparse_io_attn.selection.tiles.kernel_configs`, the other
families' from :func:`~sparse_io_attn.selection.tiles.family_tiles`: autotuned on CUDA, the first under
the interpreter, while counting and with ``SPARSE_IO_ATTN_NO_AUTOTUNE=1`` (the tiles the traffic model
assumes by default; :func:`launched_tiles` gives those the last query-major launches used).
:func:`prepare` builds what a family derives from the plan ahead of the first launch.
"""
from __future__ import annotations

import torch

from sparse_io_attn._attention.delta import residual_made
from sparse_io_attn._attention.sinks import sinks_base2
from sparse_io_attn._attention.tiles import padded_head_dim, tile_head_dim
from sparse_io_attn._attention.triton.launch import (Call, backward_outputs, decode_partial, forward_outputs,
                                                     last_tiles, merge_call, residual_args, residual_output, run,
                                                     run_calls, sink_args, strides)
from sparse_io_attn._attention.triton.launch import row_delta as _row_delta
from sparse_io_attn._triton.runtime import check_device
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.tiles import (DECODE_MAX_QUERIES, DECODE_SPLIT_KEYS, SelectionTiles, choose_tiles,
                                            decode_config, head_rows, kernel_configs, kernel_family, key_step,
                                            sel_heads)
from sparse_io_attn.selection.traffic_terms import DECODE_TENSORS, DQ_TENSORS, FWD_TENSORS
from sparse_io_attn.selection.triton.bwd import _sel_bwd_dq_kernel
from sparse_io_attn.selection.triton.decode import _sel_decode_kernel
from sparse_io_attn.selection.triton.fwd import _sel_fwd_kernel
from sparse_io_attn.selection.triton.launch_families import (common_args, dkdv_call, key_dq_calls, key_forward_calls,
                                                             key_tiles_of, key_work_of, masked_backward_calls,
                                                             masked_forward_calls, masked_tiles_of, plan_keys,
                                                             preprocess_of, table_args, tile_dim)

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

TUNE_KEY = ("seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "HEAD_DIM", "IS_CAUSAL", "IS_VARLEN", "BLOCK_SIZE",
            "SEL_HEADS",
            "max_blocks")
KERNEL_NAMES = ("selection_fwd", "selection_bwd_dq", "selection_bwd_dkdv")


def _row_configs(kind: str, q: torch.Tensor, plan: SelectionPlan, head_dim: int) -> list:
    """Forward / dQ configurations (for ``head_dim``: :func:`~.launch_families.tile_dim`): ``BLOCK_N`` with
    its ``SLOTS``, ``TILES``, ``MASK_LANES``."""
    out = []
    bs = plan.block_size
    for c in kernel_configs(kind, bs, head_dim, q.dtype):
        n, slots, tiles = key_step(bs, c.block_n)
        out.append(triton.Config({"BLOCK_N": n, "SLOTS": slots, "TILES": tiles,
                                  "MASK_LANES": slots * bs != n if slots > 1 else tiles * n != bs},
                                 num_warps=c.num_warps, num_stages=c.num_stages))
    return out


def _row_grid(q, common: dict, block_h: int):
    B, Hq, Nq, _ = q.shape
    r = common["SEL_HEADS"]
    return (Nq, B * (Hq // r) * triton.cdiv(r, block_h))


def forward_calls(q, k, v, plan: SelectionPlan, sm_scale: float, outputs: tuple | None = None, sinks2=None,
                  res=None):
    """``([call], out, lse, stats)``: the query-major forward launch and its (uninitialised) outputs
    (``outputs``: their buffers, from :func:`forward_outputs`, allocated here when not given; ``res``: the
    rounding residual's buffer, :func:`~sparse_io_attn._attention.triton.launch.residual_output`)."""
    B, Hq, Nq, D = q.shape
    common = common_args(q, k, v, plan, sm_scale)
    block_h = head_rows(common["SEL_HEADS"], tile_dim(common), q.dtype)
    out, lse, stats = forward_outputs(q, v) if outputs is None else outputs
    grid = _row_grid(q, common, block_h)
    call = Call("selection_fwd", _sel_fwd_kernel, lambda meta: grid, FWD_TENSORS,
                _row_configs("fwd", q, plan, tile_dim(common)), dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats, rows_ptr=plan.rows,
        row_counts_ptr=plan.row_counts, **strides(q, "q"), **strides(k, "k"), **strides(v, "v"),
        **strides(out, "o"), max_blocks=plan.max_blocks, **table_args(plan), stats_stride=B * Hq * Nq, BLOCK_H=block_h,
        **sink_args(sinks2, lse), **residual_args(res, out), **common))
    return [call], out, lse, stats


def decode_calls(q, k, v, plan: SelectionPlan, sm_scale: float, *, split_keys: int = DECODE_SPLIT_KEYS, sinks2=None):
    """``(calls, out, lse, stats)``: the decode launches (split-K over each row's key steps; a merge
    when the rows are split: :func:`~sparse_io_attn.selection.tiles.decode_config`, ``split_keys``
    passed on) and their (uninitialised) outputs. K and V are passed as they are (any strides); only
    the plan's rows are read."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    common = common_args(q, k, v, plan, sm_scale)
    cfg = decode_config(plan.block_size, plan.max_blocks, B, Hq, Hkv, plan.num_selections, Nq, tile_dim(common),
                        q.dtype, split_keys=split_keys)
    out, lse, stats = forward_outputs(q, v)
    rows = B * Hq * Nq
    partial = decode_partial(cfg.splits, rows, common["HEAD_DIM_V"], q.device)
    r = common["SEL_HEADS"]
    grid = (B * (Hq // r) * triton.cdiv(r, cfg.block_h) * Nq, cfg.splits)
    calls = [Call("selection_decode", _sel_decode_kernel, grid, DECODE_TENSORS,
                  [triton.Config({}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)], dict(
                      q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, stats_ptr=stats, partial_ptr=partial,
                      rows_ptr=plan.rows, row_counts_ptr=plan.row_counts, **strides(q, "q"), **strides(k, "k"),
                      **strides(v, "v"), **strides(out, "o"), max_blocks=plan.max_blocks, **table_args(plan),
                      stats_stride=rows,
                      BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SLOTS=cfg.slots, TILES=cfg.tiles,
                      MASK_LANES=cfg.mask_lanes, NUM_SPLITS=cfg.splits,
                      **sink_args(sinks2 if cfg.splits == 1 else None, lse), **common))]
    if cfg.splits > 1:
        calls.append(merge_call("selection_decode_merge", partial, out, lse, stats, cfg.splits, common["HEAD_DIM_V"],
                                sinks2))
    return calls, out, lse, stats


def backward_calls(do, q, k, v, out, stats, plan: SelectionPlan, sm_scale: float, outputs: tuple | None = None,
                   preprocess: bool = True):
    """``([preprocess, dkdv, dq] calls, dq, dk, dv)``: the query-major family's backward launches, in
    order, and their outputs (``outputs``: ``(delta, dq, dk, dv)`` buffers from :func:`backward_outputs`,
    allocated here when not given; not ``preprocess``: ``delta`` holds the caller's row deltas)."""
    B, Hq, Nq, D = q.shape
    common = common_args(q, k, v, plan, sm_scale)
    delta, dq, dk, dv = backward_outputs(q, k, v) if outputs is None else outputs   # delta: rowsum(dO * O)
    pre = preprocess_of(out, do, delta, common, preprocess)
    dkdv, dk, dv = dkdv_call("selection_bwd_dkdv", do, q, k, v, stats, delta, plan, common, None, dk=dk, dv=dv)
    block_h = head_rows(common["SEL_HEADS"], tile_dim(common), q.dtype)
    grid = _row_grid(q, common, block_h)
    dq_call = Call("selection_bwd_dq", _sel_bwd_dq_kernel, lambda meta: grid, DQ_TENSORS,
                   _row_configs("dq", q, plan, tile_dim(common)), dict(
                       q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=do, stats_ptr=stats, delta_ptr=delta, dq_ptr=dq,
                       rows_ptr=plan.rows, row_counts_ptr=plan.row_counts, **strides(q, "q"), **strides(k, "k"),
                       **strides(v, "v"), **strides(do, "do"), **strides(dq, "dq"), max_blocks=plan.max_blocks,
                       **table_args(plan), stats_stride=B * Hq * Nq, BLOCK_H=block_h, **common))
    return [*pre, dkdv, dq_call], dq, dk, dv


def key_backward_calls(do, q, k, v, out, stats, plan: SelectionPlan, sm_scale: float, delta=None):
    """``([preprocess, key_bwd, key_dq_merge] calls, dq, dk, dv)``: the key-major family's backward: the
    dK/dV kernel also writing each gathered row's dQ partial at its slot, then their merge (``delta``: the
    row deltas the caller formed, no preprocess)."""
    common = common_args(q, k, v, plan, sm_scale)
    own = delta is None
    delta = torch.empty(out.shape[:3], dtype=torch.float32, device=out.device) if own else delta
    pre = preprocess_of(out, do, delta, common, own)
    calls, dq, dk, dv = key_dq_calls(do, q, k, v, stats, delta, plan, common)
    return pre + calls, dq, dk, dv


def tiles_for(q: torch.Tensor, k: torch.Tensor, plan: SelectionPlan, v: torch.Tensor | None = None) -> SelectionTiles:
    """The default kernel tiles for these inputs (``v``: when its head dim is not q's; what the traffic model
    assumes by default)."""
    return choose_tiles(plan.block_size, tile_head_dim(q.shape[-1], None if v is None else v.shape[-1]), q.dtype,
                        sel_heads(q.shape[1], k.shape[1], plan.num_selections))


def launched_tiles() -> SelectionTiles | None:
    """The tiles the last forward and backward launches used (autotuning's choice on CUDA), for
    :func:`sparse_io_attn.selection.traffic.selection` ``(tiles=...)``; None before any launch. The
    forward's are the prefill kernel's: the decode kernels have one configuration, from the shapes."""
    tiles = last_tiles(*KERNEL_NAMES)
    if tiles is None:
        return None
    fwd, dq, dkdv = tiles
    return SelectionTiles(fwd=fwd, dq=dq, dkdv=dkdv)


def family(q, k, plan: SelectionPlan, name: str | None = None, v=None) -> str:
    """The kernel family of a call's prefill forward and backward
    (:func:`~sparse_io_attn.selection.tiles.kernel_family`; ``name`` forces one; ``v``: when its head dim is
    not q's)."""
    B, Hq, Nq, D = q.shape
    return kernel_family(plan.block_size, plan.max_blocks, plan.num_layouts, B, Hq, k.shape[1], plan.num_selections,
                         Nq, k.shape[2], tile_head_dim(D, None if v is None else v.shape[-1]), q.dtype, name)


def prepare(q, k, plan: SelectionPlan, family_name: str | None = None, v=None) -> str:
    """Build what the family of these inputs derives from the plan (key-major lists and work tiles, or the
    masked tiles; all on the plan's device, kept with it) ahead of the first launch, as a step's plan
    would; returns the family (``v``: when its head dim is not q's)."""
    v = q if v is None else v
    fam = family(q, k, plan, family_name, v)
    common = common_args(q, k, v, plan, 1.0)
    if fam == "masked":
        masked_tiles_of(q, plan, common)
    else:
        plan_keys(plan)
        if fam == "key":
            key_work_of(plan, key_tiles_of(q, plan, common).block_t)
    return fam


def forward(q, k, v, plan: SelectionPlan, *, sm_scale: float, decode: bool | None = None,
            split_keys: int = DECODE_SPLIT_KEYS, family_name: str | None = None, sinks: torch.Tensor | None = None,
            residual: bool = False):
    """``decode``: run the decode kernels (:func:`decode_calls`, ``split_keys`` passed on); ``None``
    (default): when ``Nq <= 16`` (:data:`~sparse_io_attn.selection.tiles.DECODE_MAX_QUERIES`) and no
    residual is asked for. Otherwise the family's forward (:func:`family`; ``family_name`` forces one).
    ``sinks [Hq]``: each head's sink logit, folded into every row when it is stored. ``residual``: a
    16-bit forward also returns its output's rounding residual (``(out, lse, stats, residual)``;
    :mod:`sparse_io_attn._attention.delta`), for :func:`row_delta`."""
    check_device(q, "backend 'triton'")
    sinks2 = None if sinks is None else sinks_base2(sinks)
    made = residual_made(q.dtype, residual)
    if decode is None:
        decode = q.shape[2] <= DECODE_MAX_QUERIES and not made
    if decode:
        calls, out, lse, stats = decode_calls(q, k, v, plan, sm_scale, split_keys=split_keys, sinks2=sinks2)
        res = None
    else:
        fam = family(q, k, plan, family_name, v)
        outputs = out, lse, stats = forward_outputs(q, v)
        res = residual_output(out, made)
        if fam == "query":      # from the launches kept for these shapes after the first call (run_calls)
            extra = tuple(t for t in (sinks2, res) if t is not None)
            run_calls(_key("fwd", q, k, v, plan, sm_scale, sinks2 is not None, res is not None),
                      lambda: forward_calls(q, k, v, plan, sm_scale, outputs, sinks2, res)[0],
                      (q, k, v, out, lse, stats, plan.rows, plan.row_counts, *_table(plan), *extra), TUNE_KEY)
            calls = []
        else:
            calls = FORWARD_CALLS[fam](q, k, v, plan, sm_scale, outputs, sinks2=sinks2, res=res)[0]
    for call in calls:
        run(call, q.device, TUNE_KEY)
    return (out, lse, stats) if res is None else (out, lse, stats, res)


def row_delta(do, out, residual):
    """fp32 ``[B, Hq, Nq]`` ``rowsum(dO * (O + r))``: the ``selection_bwd_preprocess`` launch, run for the
    op's autograd kernel (which then passes it as ``backward(..., delta=)``)."""
    return _row_delta("selection_bwd_preprocess", do, out, residual, padded_head_dim(out.shape[-1]))


def _key(kind: str, q, k, v, plan: SelectionPlan, sm_scale: float, *more) -> tuple:
    """What the query-major calls' non-tensor arguments depend on (:func:`~sparse_io_attn._attention.triton.
    launch.run_calls`): the plan's integers, its rows' shape and causal offset (not its identity: a new
    selection of the same shapes every step reuses the launches), shapes, strides, dtype, ``sm_scale``.
    The key-major and masked families build their calls every time (their work lists come with the plan)."""
    return (kind, plan.meta[:-1], plan.rows.shape, plan.causal_offset, plan.varlen, sm_scale, q.shape, q.stride(),
            k.shape, k.stride(), v.shape, v.stride(), q.dtype, *more)


def _table(plan: SelectionPlan) -> tuple:
    """The plan's block table among a call's tensors (:func:`run_calls`), when it has one."""
    return () if plan.table is None else (plan.table,)


FORWARD_CALLS = {"query": forward_calls, "key": key_forward_calls, "masked": masked_forward_calls}


BACKWARD_CALLS = {"query": backward_calls, "key": key_backward_calls, "masked": masked_backward_calls}


def backward(do, q, k, v, out, stats, plan: SelectionPlan, *, sm_scale: float, family_name: str | None = None,
             delta: torch.Tensor | None = None):
    """The family's backward (:func:`family`; ``family_name`` forces one), whatever forward made ``stats``;
    ``delta``: the row deltas the caller formed (:func:`row_delta`), otherwise the backward's own
    preprocess forms them from ``out``."""
    check_device(q, "backend 'triton'")
    fam = family(q, k, plan, family_name, v)
    do, stats = do.to(q.dtype), stats.contiguous()
    if delta is not None:
        delta = delta.to(torch.float32).contiguous()
    if fam == "query":
        own, dq, dk, dv = backward_outputs(q, k, v)
        outputs = (own if delta is None else delta), dq, dk, dv
        keys = plan_keys(plan)
        run_calls(_key("bwd", q, k, v, plan, sm_scale, do.stride(), out.stride(), delta is None),
                  lambda: backward_calls(do, q, k, v, out, stats, plan, sm_scale, outputs, delta is None)[0],
                  (do, q, k, v, out, stats, outputs[0], dq, dk, dv, plan.rows, plan.row_counts, keys.col_ptr,
                   keys.col_query, keys.col_slot, *_table(plan)), TUNE_KEY)
        return dq, dk, dv
    calls, dq, dk, dv = BACKWARD_CALLS[fam](do, q, k, v, out, stats, plan, sm_scale, delta)
    for call in calls:
        run(call, q.device, TUNE_KEY)
    return dq, dk, dv


__all__ = ["backward", "backward_calls", "decode_calls", "family", "forward", "forward_calls", "key_backward_calls",
           "launched_tiles", "prepare", "row_delta", "tiles_for"]
