"""The compile report of the sparse-operand kernels: ahead-of-time compilation for CUDA without a
GPU (Triton's bundled ``ptxas`` only), which checks the compiled path (typing, tuples of d-tiles,
runtime tile skips, shared memory) on machines where only the interpreter runs. Needs Triton
imported with ``TRITON_INTERPRET`` unset; run it in a fresh process."""
from __future__ import annotations

import torch

from sparse_io_attn._triton.aot import compile_for_cuda
from sparse_io_attn._triton.runtime import dot_dtype
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.sparse_operands.triton import kernels
from sparse_io_attn.sparse_operands.triton.configs import LAUNCH

#: pointer arguments of the kernels that are not operand data: int32 index lists and block maps, fp32 statistics
INT_PTRS = ("qmap_ptr", "a2map_ptr", "kept_crow_ptr", "kept_col_ptr", "zero_crow_ptr", "zero_col_ptr",
            "kept_ccol_ptr", "kept_row_ptr", "zero_ccol_ptr", "zero_row_ptr", "bmap_ptr", "cmap_ptr",
            "pair_ptr_ptr", "pair_a_ptr", "pair_k_ptr", "plan_ids_ptr")
FP32_PTRS = ("lse_ptr", "delta_ptr", "w_ptr", "hsum_ptr", "colsum_ptr")


def kernel_jobs(dtype: torch.dtype, head_dim: int, dv: int, *, block_m: int = 64, block_n: int = 64,
                block_d: int = 32, has_zero: bool = True, count_io: bool = True) -> dict:
    """``{kernel: (jit function, constexprs)}`` for ``paper_attn_fwd``, ``paper_attn_bwd_dkv``,
    ``paper_attn_bwd_dq`` and the row-panel product (``matmul``: ``[block_m, block_d] x
    [block_d, head_dim]`` panels), with the constexprs the launchers pass: ``head_dim`` cut into
    ``ceil(head_dim / block_d)`` d-tiles, ``dv`` padded by
    :func:`~sparse_io_attn._triton.shapes.padded_dim`, ``DOT_DTYPE`` from
    :func:`~sparse_io_attn._triton.runtime.dot_dtype` (``tl.float32``, IEEE products, for fp32; the
    input's 16-bit type, tensor-core MMAs, for bf16/fp16)."""
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_D_TILES=-(-head_dim // block_d),
                DV_PAD=padded_dim(dv), DOT_DTYPE=dot_dtype(dtype), COUNT_IO=count_io)
    product = dict(BLOCK_M=block_m, BLOCK_K=block_d, BLOCK_N=block_d, NUM_N_TILES=meta["NUM_D_TILES"],
                   WRITE_COLSUM=has_zero, DOT_DTYPE=meta["DOT_DTYPE"], COUNT_IO=count_io)
    return {"paper_attn_fwd": (kernels._paper_attn_fwd_kernel, dict(meta, HAS_ZERO=has_zero)),
            "paper_attn_bwd_dkv": (kernels._paper_attn_bwd_dkv_kernel, dict(meta, HAS_ZERO=has_zero)),
            "paper_attn_bwd_dq": (kernels._paper_attn_bwd_dq_kernel, meta),
            "matmul": (kernels._bsr_matmul_kernel, product)}


def compile_kernel(kernel, constexprs: dict, dtype: torch.dtype, *, arch: int = 90, num_warps: int = 4,
                   num_stages: int = 2):
    """One job of :func:`kernel_jobs` compiled for ``sm_<arch>`` (Triton's compiled kernel), with the
    kernels' index and statistics pointers typed as :data:`INT_PTRS` / :data:`FP32_PTRS`."""
    return compile_for_cuda(kernel, constexprs, dtype, int_ptrs=INT_PTRS, fp32_ptrs=FP32_PTRS, arch=arch,
                            num_warps=num_warps, num_stages=num_stages)


def aot_compile(dtype: torch.dtype, head_dim: int, dv: int, *, block_m: int = 64, block_n: int = 64,
                block_d: int = 32, has_zero: bool = True, count_io: bool = True, arch: int = 90,
                num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Compile every job of :func:`kernel_jobs` for ``sm_<arch>``; returns ``{kernel: {"shared":
    shared memory bytes, "scf_if": runtime branches in the TTGIR, "mma": (w)gmma instructions in the
    PTX}}``. Each per-tile product over the head dimension sits behind one runtime branch
    (``scf.if``) on the tile-presence flags. ``num_warps``/``num_stages``: None compiles each kernel
    with the launcher's configuration (:data:`~.configs.LAUNCH`)."""
    jobs = kernel_jobs(dtype, head_dim, dv, block_m=block_m, block_n=block_n, block_d=block_d,
                       has_zero=has_zero, count_io=count_io)
    out = {}
    for name, (kernel, constexprs) in jobs.items():
        warps, stages = LAUNCH[name]
        compiled = compile_kernel(kernel, constexprs, dtype, arch=arch, num_warps=num_warps or warps,
                                  num_stages=num_stages or stages)
        ptx = compiled.asm["ptx"]
        out[name] = dict(shared=compiled.metadata.shared, scf_if=compiled.asm["ttgir"].count("scf.if "),
                         mma=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"))
    return out
