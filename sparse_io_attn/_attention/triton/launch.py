"""How the attention ops describe and run their Triton launches, once.

A launch is a :class:`Call` (kernel, grid, counter names, configurations, arguments): each op's
launcher builds its calls (``forward_calls``, ``backward_calls``, ``decode_calls``), runs them with
:func:`run` or :func:`run_calls`, and its compile report compiles the same calls for a GPU
architecture. This module also builds the calls of the shared kernels (:func:`preprocess_call`,
:func:`merge_call`), the strides keyword arguments (:func:`strides`), the outputs a forward writes
(:func:`forward_outputs`), and remembers the tiles each named launch last used (:func:`last_tiles`:
autotuning's choice on CUDA, what the traffic models take as ``tiles=``).

**Host cost.** A call's description holds 40-70 arguments and its configurations; building it and
passing it through Triton's autotuner wrapper costs tens of microseconds per launch. :func:`run_calls`
builds and runs the calls of a key once (tuning them on CUDA), keeps each as a :class:`Prepared`
launch (``kernel[grid]`` bound, the configuration chosen, every non-tensor argument fixed) and
afterwards only puts the call's tensors in: no autotuner, no configuration list, no host read
of a device tensor, no allocation but the outputs the launcher makes (sizes from shapes only).
Counted (``IOCounter``) and recorded (``recording()``) launches always take :func:`run`, the
counted path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from sparse_io_attn._attention.delta import residual_made
from sparse_io_attn._attention.traffic import DECODE_MERGE_TENSORS, PREPROCESS_TENSORS
from sparse_io_attn._attention.triton.kernels import attn_bwd_preprocess_kernel, attn_decode_merge_kernel
from sparse_io_attn._triton.runtime import autotune_enabled, dummy_io, launch, uncounted

import triton  # noqa: E402  (after the runtime set TRITON_INTERPRET)

PREPROCESS_CONFIG = triton.Config({}, num_warps=4, num_stages=1)
MERGE_CONFIG = triton.Config({}, num_warps=4, num_stages=2)
PREPROCESS_BLOCK_M = 64     # rows per program of a preprocess launched on its own (:func:`row_delta`)
MERGE_ROWS = 16   # rows per program of the decode merge
_KEY_AXES = ("k", "v", "dk", "dv")   # tensors whose third axis is a key position (stride_*n)
_LAST_TILES: dict[str, tuple[int, int]] = {}
_PREPARED: dict = {}   # run_calls key -> tuple of Prepared launches
PREPARED_MAX = 512     # keys kept (lengths varying from call to call must not grow the cache without end)


@dataclass
class Call:
    """One kernel launch: ``kernel[grid(meta)](**kwargs, **config.kwargs)`` for ``config`` in ``configs``
    (a tuple ``grid`` is fixed: the first configuration runs, no autotuning). ``bucket``: a class of the
    work that the autotuning key's shapes do not show (the block-sparse plan's
    :func:`~sparse_io_attn._triton.runtime.density_bucket`): configurations are tuned per bucket."""
    name: str
    kernel: object
    grid: object
    tensors: tuple
    configs: list
    kwargs: dict = field(default_factory=dict)
    bucket: int = 0


def strides(t: torch.Tensor, prefix: str) -> dict:
    """``stride_{prefix}z, _h, _m|_n, _d`` of a ``[B, H, N, D]`` tensor (``n`` for key-side tensors)."""
    axes = "zh" + ("n" if prefix in _KEY_AXES else "m") + "d"
    return {f"stride_{prefix}{ax}": s for ax, s in zip(axes, t.stride())}


def forward_outputs(q: torch.Tensor, v: torch.Tensor):
    """``(out, lse, stats)``, uninitialised: ``out`` contiguous ``[B, Hq, Nq, Dv]`` in ``q``'s dtype (``Dv``:
    ``v``'s head dim), ``lse`` fp32 ``[B, Hq, Nq]``, ``stats`` fp32 ``[2, B, Hq, Nq]``."""
    B, Hq, Nq, _ = q.shape
    out = q.new_empty(B, Hq, Nq, v.shape[-1])
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, B, Hq, Nq, dtype=torch.float32, device=q.device)
    return out, lse, stats


def backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``(delta, dq, dk, dv)`` of a backward, uninitialised: ``delta`` fp32 ``[B, Hq, Nq]`` (the
    preprocess's row sums), ``dq``/``dk``/``dv`` like ``q``/``k``/``v`` (contiguous)."""
    B, Hq, Nq, _ = q.shape
    return (torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device),
            *(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)))


def preprocess_call(name: str, out: torch.Tensor, do: torch.Tensor, delta: torch.Tensor, block_m: int,
                    head_dim: int, residual: torch.Tensor | None = None) -> Call:
    """The backward preprocess ``delta = rowsum(dO * O)`` into ``delta`` (fp32 ``[B, Hq, Nq]``,
    :func:`backward_outputs`) launched as ``name`` over query tiles of ``block_m`` rows (``head_dim``: the
    padded head dim of ``out``, V's); ``residual``: the forward's rounding residual (:func:`residual_output`),
    ``O + r`` in place of ``O``."""
    B, Hq, Nq, D = out.shape
    return Call(name, attn_bwd_preprocess_kernel, (triton.cdiv(Nq, block_m), B * Hq), PREPROCESS_TENSORS,
                [PREPROCESS_CONFIG], dict(o_ptr=out, do_ptr=do, delta_ptr=delta, **strides(out, "o"),
                                          **strides(do, "do"), seqlen_q=Nq, num_heads_q=Hq, head_dim=D,
                                          BLOCK_M=block_m, HEAD_DIM=head_dim, ELEM_BYTES=out.element_size(),
                                          **residual_args(residual, out)))


def row_delta(name: str, do: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
              head_dim: int) -> torch.Tensor:
    """fp32 ``[B, Hq, Nq]``: ``rowsum(dO * (O + r))`` by the preprocess kernel launched as ``name``
    (:func:`preprocess_call`): the row deltas a backend's ``row_delta`` hands the op's autograd kernel
    (:mod:`sparse_io_attn._attention.delta`), which passes them back to its backward as ``delta=``."""
    delta = torch.empty(out.shape[:3], dtype=torch.float32, device=out.device)
    residual = residual if residual is not None and residual.numel() else None
    run(preprocess_call(name, out, do.to(out.dtype), delta, PREPROCESS_BLOCK_M, head_dim, residual), out.device, ())
    return delta


def residual_output(out: torch.Tensor, residual: bool) -> torch.Tensor | None:
    """A forward's rounding-residual buffer (uninitialised, like ``out``: the kernels store it at ``o``'s
    offsets) when ``residual`` is asked for and ``out`` is 16-bit, else None."""
    return torch.empty_like(out) if residual_made(out.dtype, residual) else None


def residual_args(res: torch.Tensor | None, dummy: torch.Tensor) -> dict:
    """A row-storing kernel's residual arguments: ``res_ptr`` (``dummy``, never written, without one) and
    ``HAS_RESIDUAL`` (:func:`~.softmax.store_rows`)."""
    return dict(res_ptr=dummy if res is None else res, HAS_RESIDUAL=res is not None)


def decode_partial(splits: int, rows: int, head_dim: int, device) -> torch.Tensor:
    """The split-K decode's fp32 work buffer ``[splits, rows, m, l, acc]`` (a placeholder with one split)."""
    return torch.empty((splits, rows, 2 + head_dim) if splits > 1 else (1,), dtype=torch.float32, device=device)


def sink_args(sinks2: torch.Tensor | None, dummy: torch.Tensor) -> dict:
    """A row-storing kernel's sink arguments: ``sinks_ptr`` (fp32 base-2 ``[Hq]``,
    :func:`~sparse_io_attn._attention.sinks.sinks_base2`; ``dummy``, never read, without sinks) and
    ``HAS_SINKS``."""
    return dict(sinks_ptr=dummy if sinks2 is None else sinks2, HAS_SINKS=sinks2 is not None)


def merge_call(name: str, partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor,
               splits: int, head_dim: int, sinks2: torch.Tensor | None = None) -> Call:
    """The decode merge launched as ``name``: every row's ``splits`` partial results (``partial``) merged in
    split order into ``out``, ``lse``, ``stats`` (``head_dim``: the padded head dim of ``out``, V's; ``sinks2``:
    the heads' sinks folded in, :func:`sink_args`)."""
    B, Hq, Nq, D = out.shape
    rows = B * Hq * Nq
    return Call(name, attn_decode_merge_kernel, (triton.cdiv(rows, MERGE_ROWS),), DECODE_MERGE_TENSORS,
                [MERGE_CONFIG], dict(partial_ptr=partial, o_ptr=out, lse_ptr=lse, stats_ptr=stats,
                                     **strides(out, "o"), num_rows=rows, seqlen_q=Nq, num_heads_q=Hq, head_dim=D,
                                     BLOCK_R=MERGE_ROWS, HEAD_DIM=head_dim, NUM_SPLITS=splits,
                                     ELEM_BYTES=out.element_size(), **sink_args(sinks2, lse)))


def run(call: Call, device, tune_key: tuple[str, ...]):
    """Launch ``call`` (:func:`sparse_io_attn._triton.runtime.launch`): a fixed grid with its one
    configuration; otherwise autotuned over ``call.configs`` keyed on ``tune_key`` and ``call.bucket``
    (on CUDA), the tiles used remembered under the call's name: ``(rows, BLOCK_N)``, the rows being the
    configuration's ``BLOCK_M``, else the call's ``BLOCK_H`` (the head rows of a query-major selection
    kernel). Returns ``(grid, configuration)`` as launched, or None for an empty grid (not launched)."""
    if call.grid.__class__ is tuple:
        if 0 in call.grid:
            return None
        launch(call.kernel, call.grid, call.name, call.tensors, device, **call.kwargs,
               num_warps=call.configs[0].num_warps, num_stages=call.configs[0].num_stages)
        return call.grid, call.configs[0]
    if 0 in call.grid(dict(call.kwargs, **call.configs[0].kwargs)):
        return None
    used = launch(call.kernel, call.grid, call.name, call.tensors, device, configs=call.configs, key=tune_key,
                  bucket=call.bucket, **call.kwargs)
    _LAST_TILES[call.name] = _tiles(call, used)
    return call.grid(dict(call.kwargs, **used.kwargs)), used


def _tiles(call: Call, config) -> tuple:
    return config.kwargs.get("BLOCK_M", call.kwargs.get("BLOCK_H")), config.kwargs["BLOCK_N"]


@dataclass(frozen=True)
class Prepared:
    """A :class:`Call` as :func:`run` launched it, fixed but for its tensors: ``kernel.run(*args,
    grid=grid, warmup=False, **options)`` with ``args`` every argument in the kernel's signature order
    (built from the call's keyword arguments, never written by hand; the configuration's constexprs,
    ``io_ptr`` and ``COUNT_IO`` included), ``options`` the launch options (warps, stages, CTAs), and
    ``slots`` (argument position, position in the calls' tensor tuple) for each tensor argument;
    ``tiles``: what :func:`last_tiles` reports (None for a fixed-grid call). Positional arguments:
    Triton's ``kernel[grid](**kwargs)`` passes 40-70 keyword arguments through two ``**kwargs``
    frames, about 10 us per launch on a slow host, positional ones about 1 us."""
    name: str
    kernel: object
    grid: tuple
    args: tuple
    options: dict
    slots: tuple
    tiles: tuple | None

    @classmethod
    def of(cls, call: Call, grid: tuple, config, tensors: tuple, device) -> "Prepared":
        position = {id(t): i for i, t in enumerate(tensors)}
        kwargs = dict(call.kwargs, io_ptr=dummy_io(device), COUNT_IO=False, **config.all_kwargs())
        missing = [n for n, v in call.kwargs.items() if isinstance(v, torch.Tensor) and id(v) not in position]
        assert not missing, f"{call.name}: {missing} are not among the tensors given to run_calls"
        args, slots = [], []
        for name in call.kernel.arg_names:
            if name not in kwargs:
                break      # a defaulted parameter: it and the rest go by keyword
            value = kwargs.pop(name)
            if isinstance(value, torch.Tensor) and id(value) in position:
                slots.append((len(args), position[id(value)]))
                value = None
            args.append(value)
        assert not any(isinstance(v, torch.Tensor) and id(v) in position for v in kwargs.values()), \
            f"{call.name}: a tensor argument after a defaulted parameter"
        tiles = None if call.grid.__class__ is tuple else _tiles(call, config)
        return cls(call.name, call.kernel, grid, tuple(args), kwargs, tuple(slots), tiles)

    def __call__(self, tensors: tuple) -> None:
        args = list(self.args)
        for a, t in self.slots:
            args[a] = tensors[t]
        self.kernel.run(*args, grid=self.grid, warmup=False, **self.options)
        if self.tiles is not None:
            _LAST_TILES[self.name] = self.tiles


def run_calls(key: tuple, build: Callable[[], list], tensors: tuple, tune_key: tuple[str, ...]) -> None:
    """Run the calls ``build()`` returns, in order, each through :func:`run`; and keep them as
    :class:`Prepared` launches under ``key``, so that the next call of the same key launches those
    with its own ``tensors`` and never builds the calls again.

    ``tensors``: every tensor the calls take (inputs, outputs the launcher allocated, the plan's
    tensors), distinct objects; ``key``: everything else the calls' arguments depend on (the plan's
    integers, shapes, strides, dtype, ``sm_scale``); the device and whether autotuning is on are
    added here. Counted or recorded launches, and tensors passed twice (``q is k``), take :func:`run`
    every time."""
    device = tensors[0].device
    if uncounted() and len(set(map(id, tensors))) == len(tensors):
        key = (key, device, autotune_enabled())
        prepared = _PREPARED.get(key)
        if prepared is not None:
            for launch_ in prepared:
                launch_(tensors)
            return
    else:
        key = None
    prepared = []
    for call in build():
        launched = run(call, device, tune_key)
        if key is not None and launched is not None:
            prepared.append(Prepared.of(call, *launched, tensors, device))
    if key is not None:
        if len(_PREPARED) >= PREPARED_MAX:
            _PREPARED.clear()     # many shapes (lengths varying per batch): start over (one atomic call)
        _PREPARED[key] = tuple(prepared)


def last_tiles(*names: str) -> list[tuple[int, int]] | None:
    """The tiles the last launches of ``names`` used, in that order; None until each has run."""
    if not all(n in _LAST_TILES for n in names):
        return None
    return [_LAST_TILES[n] for n in names]


__all__ = ["Call", "MERGE_ROWS", "PREPROCESS_BLOCK_M", "PREPROCESS_CONFIG", "Prepared", "backward_outputs",
           "decode_partial", "forward_outputs", "last_tiles", "merge_call", "preprocess_call",
           "residual_args", "residual_output", "row_delta", "run", "run_calls", "sink_args", "strides"]
