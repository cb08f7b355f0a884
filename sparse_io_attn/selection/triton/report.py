"""The compile report of the selection kernels: every kernel, in every configuration autotuning may
pick, compiled for a CUDA architecture exactly as a real launch would compile it, without a GPU.

:func:`example_calls` builds the launches :mod:`.launch` would make (its :func:`~.launch.forward_calls`
and :func:`~.launch.backward_calls`, on CPU tensors, nothing runs) for two representative shapes,
``[2, Hq, 1024, head_dim]`` queries with 1024 keys, ``K = 16`` selected blocks per token, causal or not:

* ``"gqa"``: NSA-shaped, one selection per GQA group (``Hq = 16``, ``Hkv = 2``, ``G = 2``): 8 heads
  per tile (``BLOCK_H = 16``);
* ``"mqa"``: one selection shared by 64 query heads of one KV head (``Hq = 64``, ``Hkv = 1``,
  ``G = 1``): ``BLOCK_H = 64``, the widest forward/dQ tile, and 64 gathered rows per token in dK/dV.

:func:`compile_report` compiles each (kernel, config) with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory,
asynchronous copies and tensor-core MMAs (:func:`sparse_io_attn._triton.aot.ptx_report`).
``pipelined`` means the main loop's gathered 2-D tiles (K/V in the forward and dQ, Q/dO in dK/dV)
are copied asynchronously (``tile_async``: ``ttg.async_copy_global_to_local`` of 2-D tiles, i.e.
multi-buffered ``cp.async``), not only the scalar plan entries. The preprocess kernel has no loop
and is reported for completeness.

Needs Triton imported with ``TRITON_INTERPRET=0`` (the ``compile-report`` command sets it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import compile_call, ptx_report
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.triton.launch import backward_calls, forward_calls

KERNELS = ("selection_fwd", "selection_bwd_dq", "selection_bwd_dkdv", "selection_bwd_preprocess")
LOOPLESS = "selection_bwd_preprocess"
COLUMNS = ("shape", "kernel", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "registers", "spill_stores",
           "spill_loads", "shared_bytes", "cp_async", "tile_async", "wgmma", "pipelined")
SHAPES = {"gqa": (16, 2, 2), "mqa": (64, 1, 1)}  # (Hq, Hkv, G)


def example_calls(dtype: torch.dtype, head_dim: int, block: int, causal: bool, shape: str = "gqa") -> list:
    """The launches of one forward + backward at representative sizes (CPU tensors, no launch)."""
    Hq, Hkv, G = SHAPES[shape]
    B, N, K = 2, 1024, 16
    g = torch.Generator().manual_seed(0)
    nkb = -(-N // block)
    indices = torch.randint(0, nkb, (B, G, N, K), generator=g)
    plan = SelectionPlan(Selection(indices, block), N, causal_offset(causal, N, N))
    q = torch.randn(B, Hq, N, head_dim).to(dtype)
    k, v = (torch.randn(B, Hkv, N, head_dim).to(dtype) for _ in range(2))
    fwd, out, _, stats = forward_calls(q, k, v, plan, head_dim ** -0.5)
    bwd, *_ = backward_calls(torch.randn_like(q), q, k, v, out, stats, plan, head_dim ** -0.5)
    return fwd + bwd


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, block: int = 64, *,
                   causal: bool = False, arch: int = 90, configs: str = "all", kernels=KERNELS,
                   shapes=tuple(SHAPES), ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per (shape, kernel, configuration): tiles (``BLOCK_M`` = the forward/dQ heads tile
    ``BLOCK_H``, or the dK/dV gathered rows), warps, stages, registers, spill bytes, shared memory,
    ``cp.async``/``tile_async``/``wgmma`` counts and ``pipelined``. ``configs``: ``"all"`` (every
    autotuning candidate) or ``"default"`` (the first). ``ptx_dir``: write each PTX file there."""
    if configs not in ("all", "default"):
        raise ValueError(f"configs must be 'all' or 'default', got {configs!r}")
    if ptx_dir is not None:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in shapes:
        for call in example_calls(dtype, head_dim, block, causal, shape):
            if call.name not in kernels:
                continue
            for cfg in call.configs[:1] if configs == "default" else call.configs:
                kwargs = dict(call.kwargs, io_ptr=torch.zeros(32, dtype=torch.int64), COUNT_IO=False, **cfg.kwargs)
                compiled = compile_call(call.kernel, kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                        arch=arch)
                bm, bn = kwargs.get("BLOCK_M", kwargs.get("BLOCK_H")), kwargs.get("BLOCK_N", 0)
                ptx_file = None
                if ptx_dir is not None:
                    ptx_file = (Path(ptx_dir) / f"{shape}_{call.name}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}"
                                                f"_sm{arch}.ptx")
                stats = ptx_report(compiled, arch=arch, ptx_file=ptx_file)
                rows.append({"shape": shape, "kernel": call.name, "BLOCK_M": bm, "BLOCK_N": bn,
                             "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **stats,
                             "pipelined": stats["tile_async"] > 0})
    return rows
