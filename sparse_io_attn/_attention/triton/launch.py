"""How the attention ops describe and run their Triton launches, once.

A launch is a :class:`Call` (kernel, grid, counter names, configurations, arguments): each op's
launcher builds its calls (``forward_calls``, ``backward_calls``, ``decode_calls``), runs them with
:func:`run`, and its compile report compiles the same calls for a GPU architecture. This module also
builds the calls of the shared kernels (:func:`preprocess_call`, :func:`merge_call`), the strides
keyword arguments (:func:`strides`), the outputs a forward writes (:func:`forward_outputs`), and
remembers the tiles each named launch last used (:func:`last_tiles`: autotuning's choice on CUDA,
what the traffic models take as ``tiles=``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparse_io_attn._attention.traffic import DECODE_MERGE_TENSORS, PREPROCESS_TENSORS
from sparse_io_attn._attention.triton.kernels import attn_bwd_preprocess_kernel, attn_decode_merge_kernel
from sparse_io_attn._triton.runtime import launch

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

PREPROCESS_CONFIG = triton.Config({}, num_warps=4, num_stages=1)
MERGE_CONFIG = triton.Config({}, num_warps=4, num_stages=2)
MERGE_ROWS = 16   # rows per program of the decode merge
_KEY_AXES = ("k", "v", "dk", "dv")   # tensors whose third axis is a key position (stride_*n)
_LAST_TILES: dict[str, tuple[int, int]] = {}


@dataclass
class Call:
    """One kernel launch: ``kernel[grid(meta)](**kwargs, **config.kwargs)`` for ``config`` in ``configs``
    (a tuple ``grid`` is fixed: the first configuration runs, no autotuning)."""
    name: str
    kernel: object
    grid: object
    tensors: tuple
    configs: list
    kwargs: dict = field(default_factory=dict)


def strides(t: torch.Tensor, prefix: str) -> dict:
    """``stride_{prefix}z, _h, _m|_n, _d`` of a ``[B, H, N, D]`` tensor (``n`` for key-side tensors)."""
    axes = "zh" + ("n" if prefix in _KEY_AXES else "m") + "d"
    return {f"stride_{prefix}{ax}": s for ax, s in zip(axes, t.stride())}


def forward_outputs(q: torch.Tensor):
    """``(out, lse, stats)``, uninitialised: ``out`` like ``q`` (contiguous), ``lse`` fp32 ``[B, Hq, Nq]``,
    ``stats`` fp32 ``[2, B, Hq, Nq]``."""
    B, Hq, Nq, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, B, Hq, Nq, dtype=torch.float32, device=q.device)
    return out, lse, stats


def preprocess_call(name: str, out: torch.Tensor, do: torch.Tensor, block_m: int, head_dim: int):
    """``(call, delta)``: the backward preprocess ``delta = rowsum(dO * O)`` launched as ``name`` over
    query tiles of ``block_m`` rows, and its (uninitialised) fp32 ``delta [B, Hq, Nq]``."""
    B, Hq, Nq, D = out.shape
    delta = torch.empty(B, Hq, Nq, dtype=torch.float32, device=out.device)
    call = Call(name, attn_bwd_preprocess_kernel, (triton.cdiv(Nq, block_m), B * Hq), PREPROCESS_TENSORS,
                [PREPROCESS_CONFIG], dict(o_ptr=out, do_ptr=do, delta_ptr=delta, **strides(out, "o"),
                                          **strides(do, "do"), seqlen_q=Nq, num_heads_q=Hq, head_dim=D,
                                          BLOCK_M=block_m, HEAD_DIM=head_dim, ELEM_BYTES=out.element_size()))
    return call, delta


def decode_partial(splits: int, rows: int, head_dim: int, device) -> torch.Tensor:
    """The split-K decode's fp32 work buffer ``[splits, rows, m, l, acc]`` (a placeholder with one split)."""
    return torch.empty((splits, rows, 2 + head_dim) if splits > 1 else (1,), dtype=torch.float32, device=device)


def merge_call(name: str, partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor,
               splits: int, head_dim: int) -> Call:
    """The decode merge launched as ``name``: every row's ``splits`` partial results (``partial``) merged in
    split order into ``out``, ``lse``, ``stats``."""
    B, Hq, Nq, D = out.shape
    rows = B * Hq * Nq
    return Call(name, attn_decode_merge_kernel, (triton.cdiv(rows, MERGE_ROWS),), DECODE_MERGE_TENSORS,
                [MERGE_CONFIG], dict(partial_ptr=partial, o_ptr=out, lse_ptr=lse, stats_ptr=stats,
                                     **strides(out, "o"), num_rows=rows, seqlen_q=Nq, num_heads_q=Hq, head_dim=D,
                                     BLOCK_R=MERGE_ROWS, HEAD_DIM=head_dim, NUM_SPLITS=splits,
                                     ELEM_BYTES=out.element_size()))


def run(call: Call, device, tune_key: tuple[str, ...]) -> None:
    """Launch ``call`` (:func:`sparse_io_attn._triton.runtime.launch`): a fixed grid with its one
    configuration; otherwise autotuned over ``call.configs`` keyed on ``tune_key`` (on CUDA), the tiles
    used remembered under the call's name: ``(rows, BLOCK_N)``, the rows being the configuration's
    ``BLOCK_M``, else the call's ``BLOCK_H`` (the head rows of a query-major selection kernel). An
    empty grid is not launched."""
    if call.grid.__class__ is tuple:
        if 0 in call.grid:
            return
        launch(call.kernel, call.grid, call.name, call.tensors, device, **call.kwargs,
               num_warps=call.configs[0].num_warps, num_stages=call.configs[0].num_stages)
        return
    if 0 in call.grid(dict(call.kwargs, **call.configs[0].kwargs)):
        return
    used = launch(call.kernel, call.grid, call.name, call.tensors, device, configs=call.configs, key=tune_key,
                  **call.kwargs)
    _LAST_TILES[call.name] = (used.kwargs.get("BLOCK_M", call.kwargs.get("BLOCK_H")), used.kwargs["BLOCK_N"])


def last_tiles(*names: str) -> list[tuple[int, int]] | None:
    """The tiles the last launches of ``names`` used, in that order; None until each has run."""
    if not all(n in _LAST_TILES for n in names):
        return None
    return [_LAST_TILES[n] for n in names]


__all__ = ["Call", "MERGE_ROWS", "PREPROCESS_CONFIG", "decode_partial", "forward_outputs", "last_tiles",
           "merge_call", "preprocess_call", "run", "strides"]
