"""The compile report of the selection kernels: every kernel, in every configuration autotuning may
pick, compiled for a CUDA architecture exactly as a real launch would compile it, without a GPU.

:func:`example_calls` builds the launches :mod:`.launch` would make (the calls of a kernel family's
forward and backward, on CPU tensors, nothing runs) for representative shapes, ``[B, Hq, 1024,
head_dim]`` queries with 1024 keys, ``K = 16`` selected blocks per token, causal or not:

* ``"gqa"``: NSA-shaped, one selection per GQA group (``Hq = 16``, ``Hkv = 2``, ``G = 2``): 8 heads per
  selection and KV head; ``"moba"``: one selection per query head (``Hq = 16``, ``Hkv = 4``, ``G = 16``);
  ``"dsa"``: one selection shared by all heads with 4 per KV head (``Hq = 16``, ``Hkv = 4``, ``G = 1``);
  each compiled for the family ``"auto"`` picks (key-major for blocks of 16 keys and more, element-masked
  below) and for the query-major family (the previous kernels, kept as candidates until a GPU run shows
  which wins);
* ``"mqa"``: one selection shared by 64 query heads of one KV head (``Hq = 64``, ``Hkv = 1``, ``G = 1``):
  query-major (``BLOCK_H = 64``, the widest forward/dQ tile, and 64 gathered rows per token in dK/dV).

:func:`compile_report` compiles each (kernel, config) with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory,
asynchronous copies and tensor-core MMAs (:func:`sparse_io_attn._triton.aot.ptx_report`: ``wgmma`` the
Hopper MMAs, ``mma_sync`` the older warp-level ones; a kernel whose every product runs on wgmma has
``wgmma > 0`` and ``mma_sync == 0``). ``pipelined`` means the main loop's 2-D tiles (K/V in the forward
and dQ, Q/dO in dK/dV, the partial rows in the merges) are copied asynchronously (``tile_async``:
``ttg.async_copy_global_to_local`` of 2-D tiles, i.e. multi-buffered ``cp.async``), not only the scalar
plan entries. The preprocess kernel has no loop and is reported for completeness.

Needs Triton imported with ``TRITON_INTERPRET=0`` (the ``compile-report`` command sets it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import compile_call, ptx_report
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.triton.launch import BACKWARD_CALLS, FORWARD_CALLS, family

KERNELS = ("selection_fwd", "selection_bwd_dq", "selection_bwd_dkdv", "selection_bwd_preprocess",
           "selection_key_fwd", "selection_key_merge", "selection_key_bwd", "selection_key_dq_merge",
           "selection_masked_fwd", "selection_masked_dkdv", "selection_masked_dq")
LOOPLESS = "selection_bwd_preprocess"
COLUMNS = ("shape", "family", "kernel", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "registers",
           "spill_stores", "spill_loads", "shared_bytes", "cp_async", "tile_async", "wgmma", "mma_sync", "pipelined")
SHAPES = {"gqa": (16, 2, 2), "mqa": (64, 1, 1), "moba": (16, 4, 16), "dsa": (16, 4, 1)}  # (Hq, Hkv, G)


def _inputs(dtype: torch.dtype, head_dim: int, block: int, causal: bool, shape: str):
    Hq, Hkv, G = SHAPES[shape]
    B, N, K = 2, 1024, 16
    g = torch.Generator().manual_seed(0)
    nkb = -(-N // block)
    indices = torch.randint(0, nkb, (B, G, N, K), generator=g)
    plan = SelectionPlan(Selection(indices, block), N, causal_offset(causal, N, N))
    q = torch.randn(B, Hq, N, head_dim).to(dtype)
    k, v = (torch.randn(B, Hkv, N, head_dim).to(dtype) for _ in range(2))
    return q, k, v, plan


def families(dtype: torch.dtype, head_dim: int, block: int, causal: bool, shape: str) -> list[str]:
    """The families the report compiles for a shape: ``"auto"``'s choice, and the query-major one."""
    q, k, _, plan = _inputs(dtype, head_dim, block, causal, shape)
    chosen = family(q, k, plan)
    return [chosen] if chosen == "query" else [chosen, "query"]


def example_calls(dtype: torch.dtype, head_dim: int, block: int, causal: bool, shape: str = "gqa",
                  family_name: str | None = None) -> list:
    """The launches of one forward + backward of ``family_name`` (``None``: the launcher's choice) at
    representative sizes (CPU tensors, no launch)."""
    q, k, v, plan = _inputs(dtype, head_dim, block, causal, shape)
    fam = family(q, k, plan, family_name)
    fwd, out, _, stats = FORWARD_CALLS[fam](q, k, v, plan, head_dim ** -0.5)
    bwd, *_ = BACKWARD_CALLS[fam](torch.randn_like(q), q, k, v, out, stats, plan, head_dim ** -0.5)
    return fwd + bwd


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, block: int = 64, *,
                   causal: bool = False, arch: int = 90, configs: str = "all", kernels=KERNELS,
                   shapes=tuple(SHAPES), ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per (shape, family, kernel, configuration): tiles (``BLOCK_M`` = the query-major forward/dQ
    heads tile ``BLOCK_H``, the gathered or tile rows of the others, a merge's ``BLOCK_R``), warps,
    stages, registers, spill bytes, shared memory, ``cp.async``/``tile_async``/``wgmma``/``mma_sync``
    counts and ``pipelined``. ``configs``: ``"all"`` (every autotuning candidate) or ``"default"`` (the
    first). ``ptx_dir``: write each PTX file there."""
    if configs not in ("all", "default"):
        raise ValueError(f"configs must be 'all' or 'default', got {configs!r}")
    if ptx_dir is not None:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in shapes:
        for fam in families(dtype, head_dim, block, causal, shape):
            for call in example_calls(dtype, head_dim, block, causal, shape, fam):
                if call.name not in kernels:
                    continue
                for cfg in call.configs[:1] if configs == "default" else call.configs:
                    rows.append(_row(shape, fam, call, cfg, arch, ptx_dir))
    return rows


def _row(shape: str, fam: str, call, cfg, arch: int, ptx_dir) -> dict:
    kwargs = dict(call.kwargs, io_ptr=torch.zeros(32, dtype=torch.int64), COUNT_IO=False, **cfg.kwargs)
    compiled = compile_call(call.kernel, kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, arch=arch)
    bm = kwargs.get("BLOCK_M", kwargs.get("BLOCK_H", kwargs.get("BLOCK_R")))
    bn = kwargs.get("BLOCK_N", 0)
    ptx_file = None
    if ptx_dir is not None:
        ptx_file = Path(ptx_dir) / f"{shape}_{call.name}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}_sm{arch}.ptx"
    stats = ptx_report(compiled, arch=arch, ptx_file=ptx_file)
    return {"shape": shape, "family": fam, "kernel": call.name, "BLOCK_M": bm, "BLOCK_N": bn,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **stats, "pipelined": stats["tile_async"] > 0}
