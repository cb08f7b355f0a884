"""The compile report: every block-sparse kernel, in every configuration autotuning may pick,
compiled for a CUDA architecture exactly as a real launch would compile it, without a GPU.

:func:`compile_report` builds the launches :mod:`.launch` would make for representative inputs
(``[2, 8, 1024, head_dim]`` queries, 2 KV heads, a sliding-window layout whose window is not a
multiple of the block, so there are full and element-masked partial blocks; ``causal`` adds the
causal test), compiles each (kernel, config) with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory
and asynchronous copies from ``ptxas -v`` and the PTX, and the matrix products and how many are
Hopper ``wgmma`` from the TTGIR (:func:`sparse_io_attn._triton.aot.ptx_report`); ``scores`` is dK/dV's
score form (``direct``: ``S^T = K Q^T``; ``exact``: the forward's ``Q K^T`` transposed).
``pipelined`` means the main loops' loads are asynchronous: ``cp.async`` (multi-buffered
global->shared copies) or ``cp.async.bulk.tensor`` (TMA) in the PTX. The preprocess kernel has no
loop and is reported for completeness.

Needs Triton imported with ``TRITON_INTERPRET=0`` (the ``compile-report`` command sets it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import compile_call, ptx_report
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.block_sparse.triton.launch import backward_calls, forward_calls
from sparse_io_attn.layout import patterns

#: dK/dV's score form (``EXACT_SCORES``): S^T = K Q^T formed directly, or the forward's Q K^T transposed
_SCORES = {False: "direct", True: "exact", None: ""}
KERNELS = ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv", "attn_bwd_preprocess")
COLUMNS = ("kernel", "BLOCK_M", "BLOCK_N", "scores", "num_warps", "num_stages", "registers", "spill_stores",
           "spill_loads", "shared_bytes", "cp_async", "tma", "wgmma", "dots", "wgmma_dots", "pipelined")


def example_calls(dtype: torch.dtype, head_dim: int, block: int, causal: bool) -> list:
    """The launches of one forward + backward at representative sizes (CPU tensors, no launch)."""
    B, Hq, Hkv, N = 2, 8, 2, 1024
    layout = patterns.sliding_window(N, block, 2 * block + 7)
    q = torch.randn(B, Hq, N, head_dim).to(dtype)
    k, v = (torch.randn(B, Hkv, N, head_dim).to(dtype) for _ in range(2))
    p = plan(layout, causal=causal)
    fwd, out, _, stats = forward_calls(q, k, v, p, head_dim ** -0.5)
    bwd, *_ = backward_calls(torch.randn_like(q), q, k, v, out, stats, p, head_dim ** -0.5)
    return [fwd] + bwd


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, block: int = 128, *,
                   causal: bool = False, arch: int = 90, configs: str = "all", kernels=KERNELS,
                   ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per (kernel, configuration): tiles, warps, stages, registers, spill bytes, shared
    memory, ``cp.async``/TMA/``wgmma`` counts and ``pipelined``. ``configs``: ``"all"`` (every
    autotuning candidate) or ``"default"`` (the first, what runs without autotuning). ``ptx_dir``:
    write each PTX file there."""
    if configs not in ("all", "default"):
        raise ValueError(f"configs must be 'all' or 'default', got {configs!r}")
    if ptx_dir is not None:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for call in example_calls(dtype, head_dim, block, causal):
        if call.name not in kernels:
            continue
        for cfg in call.configs[:1] if configs == "default" else call.configs:
            kwargs = dict(call.kwargs, io_ptr=torch.zeros(32, dtype=torch.int64), COUNT_IO=False, **cfg.kwargs)
            compiled = compile_call(call.kernel, kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, arch=arch)
            bm, bn = kwargs["BLOCK_M"], kwargs.get("BLOCK_N", 0)
            ptx_file = None
            if ptx_dir is not None:
                ptx_file = Path(ptx_dir) / f"{call.name}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}_sm{arch}.ptx"
            stats = ptx_report(compiled, arch=arch, ptx_file=ptx_file)
            rows.append({"kernel": call.name, "BLOCK_M": bm, "BLOCK_N": bn, "scores": _SCORES[kwargs.get("EXACT_SCORES")],
                         "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **stats,
                         "pipelined": stats["cp_async"] + stats["tma"] > 0})
    return rows
