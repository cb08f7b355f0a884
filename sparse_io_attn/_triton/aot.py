"""Ahead-of-time compilation of ``@triton.jit`` kernels for CUDA on a machine without a GPU, and what
the compiled code says about speed (registers, spills, shared memory, asynchronous copies).

* :func:`compile_call`: compile a kernel exactly as launching it with these arguments would: the
  JIT's own specialisation (``native_specialize_impl``: pointers 16-byte aligned and integers
  divisible by 16 get ``tt.divisibility``, integers equal to 1 become constexpr), so the software
  pipeliner sees what it sees at a real launch.
* :func:`compile_for_cuda`: compile from argument *names* (no example tensors): ``*_ptr`` point to
  ``dtype`` (all 16-byte aligned), other scalars i32 unless named in ``float_args``.
* :func:`ptx_report`: ``ptxas -v`` (Triton's bundled ``ptxas-blackwell``, which accepts the PTX ISA
  Triton 3.9 emits) for registers and spill bytes, plus counts of ``cp.async`` (multi-buffered
  global->shared copies), ``cp.async.bulk.tensor`` (TMA), ``wgmma.mma_async`` (Hopper tensor-core MMAs)
  and ``mma.sync`` (warp-level MMAs: a product Triton did not lower to wgmma) in the PTX, and the matrix
  products in the TTGIR (``dots``) and how many of them are Hopper ``wgmma`` (``wgmma_dots``).

Needs Triton imported with ``TRITON_INTERPRET`` unset (``=0``): run it in a fresh process.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from sparse_io_attn._triton.runtime import INTERPRET

_TL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_FLOAT_ARGS = ("sm_scale", "alpha", "scale")
#: an asynchronous global->shared copy of a 2-D tile in the TTGIR (not a scalar index prefetch)
_TILE_COPY = re.compile(r"async_copy_global_to_local [^\n]*: tensor<\d+x\d+x!tt\.ptr")
#: a matrix product in the TTGIR: ``tt.dot`` (mma.sync, FMA) or ``ttng.warp_group_dot`` (Hopper's wgmma)
_DOT = re.compile(r"= (tt\.dot|ttng\.warp_group_dot) ")


def _require_compiler() -> None:
    if INTERPRET:
        raise RuntimeError("ahead-of-time compilation needs Triton imported with TRITON_INTERPRET unset "
                           "(run it in a fresh process with TRITON_INTERPRET=0)")


def _compile(kernel, signature: dict, constexprs: dict, attrs: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def compile_call(kernel, kwargs: dict, *, num_warps: int, num_stages: int, arch: int = 90):
    """Compile ``kernel`` as ``kernel[grid](**kwargs, num_warps=..., num_stages=...)`` would be
    specialised and compiled; returns Triton's compiled kernel (``.metadata``, ``.asm``)."""
    _require_compiler()
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = kwargs[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize, True)
        if ty == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", spec
            continue
        signature[p.name] = ty
        if spec and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return _compile(kernel, signature, constexprs, attrs, arch, num_warps, num_stages)


def compile_for_cuda(kernel, constexprs: dict, dtype: torch.dtype, *, int_ptrs=(), fp32_ptrs=(),
                     float_args=_FLOAT_ARGS, arch: int = 90, num_warps: int = 4, num_stages: int = 2):
    """Compile ``kernel`` for ``sm_<arch>`` from argument names; returns Triton's compiled kernel.

    Argument types: names in ``constexprs`` are constexpr; ``io_ptr`` is ``*i64``; ``int_ptrs``
    ``*i32`` (index arrays); ``fp32_ptrs`` ``*fp32`` (statistics); other ``*_ptr`` arguments point to
    ``dtype``; scalars named in ``float_args`` are fp32, every other scalar i32. Pointers are marked
    16-byte aligned, as at a launch with tensors from PyTorch's allocator."""
    _require_compiler()
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        if arg == "io_ptr":
            signature[arg] = "*i64"
        elif arg in int_ptrs:
            signature[arg] = "*i32"
        elif arg in fp32_ptrs:
            signature[arg] = "*fp32"
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + _TL_DTYPES[dtype]
        else:
            signature[arg] = "fp32" if arg in float_args else "i32"
        if signature[arg].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return _compile(kernel, signature, constexprs, attrs, arch, num_warps, num_stages)


def ptxas_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def ptx_report(compiled, *, arch: int = 90, ptx_file: str | Path | None = None) -> dict:
    """Registers and spill bytes from ``ptxas -v``, shared memory from Triton's metadata, and counts
    of asynchronous copies (``cp.async``: multi-buffered loads; ``cp.async.bulk.tensor``: TMA) and
    tensor-core MMAs (``wgmma.mma_async``) in the PTX; the matrix products of the TTGIR (``dots``: each
    ``tl.dot`` as compiled, loop bodies included once per copy) and those lowered to ``wgmma``
    (``wgmma_dots``; the others run ``mma.sync`` or FMA). ``ptx_file``: also keep the PTX there."""
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(ptx_file) if ptx_file is not None else Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        res = subprocess.run([ptxas_path(), "-v", "--gpu-name", gpu, str(path), "-o", os.devnull],
                             capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed on {compiled.name}: {res.stderr[-2000:]}")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", res.stderr)]
    stores = [int(x) for x in re.findall(r"(\d+) bytes spill stores", res.stderr)]
    loads = [int(x) for x in re.findall(r"(\d+) bytes spill loads", res.stderr)]
    tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    ttgir = compiled.asm.get("ttgir", "")
    dots = _DOT.findall(ttgir)
    return {"registers": max(regs, default=0), "spill_stores": sum(stores), "spill_loads": sum(loads),
            "shared_bytes": int(compiled.metadata.shared),
            "cp_async": len(re.findall(r"cp\.async\.(?:ca|cg)\.shared", ptx)), "tma": tma,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": len(re.findall(r"\bmma\.sync\.", ptx)),
            "dots": len(dots), "wgmma_dots": dots.count("ttng.warp_group_dot"),
            "async_copy_ops": ttgir.count("async_copy_global_to_local"),
            "tile_async": len(_TILE_COPY.findall(ttgir))}


def report_split_calls(shape_calls, *, kernels, arch: int = 90, ptx_dir: str | Path | None = None,
                       block_m_key: str = "BLOCK_M", pipelined=lambda stats: stats["cp_async"] + stats["tma"] > 0
                       ) -> list[dict]:
    """The compile report of split-K decode launches: ``shape_calls`` yields ``(shape, calls)`` (each
    call with one launch configuration); one row per (shape, kernel in ``kernels``): tiles
    (``block_m_key`` of the kernel, else the merge's ``BLOCK_R``), splits, warps, stages and
    :func:`ptx_report`'s counts, ``pipelined`` as the op defines it. ``ptx_dir``: keep each PTX."""
    if ptx_dir is not None:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for shape, calls in shape_calls:
        for call in calls:
            if call.name not in kernels:
                continue
            cfg = call.configs[0]
            kwargs = dict(call.kwargs, io_ptr=torch.zeros(32, dtype=torch.int64), COUNT_IO=False)
            compiled = compile_call(call.kernel, kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, arch=arch)
            bm, bn = kwargs.get(block_m_key, kwargs.get("BLOCK_R")), kwargs.get("BLOCK_N", 0)
            ptx_file = None
            if ptx_dir is not None:
                ptx_file = (Path(ptx_dir) / f"{shape}_{call.name}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}"
                                            f"_sm{arch}.ptx")
            stats = ptx_report(compiled, arch=arch, ptx_file=ptx_file)
            rows.append({"shape": shape, "kernel": call.name, "BLOCK_M": bm, "BLOCK_N": bn,
                         "splits": kwargs["NUM_SPLITS"], "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                         **stats, "pipelined": pipelined(stats)})
    return rows

