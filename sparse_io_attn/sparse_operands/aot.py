"""Ahead-of-time compilation of the paper attention kernels for CUDA without a GPU (Triton's bundled
``ptxas`` only): checks the compiled path (typing, tuples of d-tiles, runtime tile skips, shared
memory) on machines where only the interpreter runs. Needs Triton imported with ``TRITON_INTERPRET``
unset; run it in a fresh process."""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import dot_dtype
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.sparse_operands import kernels as K

_INT_PTRS = ("qmap_ptr", "a2map_ptr", "kept_crow_ptr", "kept_col_ptr", "zero_crow_ptr", "zero_col_ptr",
             "kept_ccol_ptr", "kept_row_ptr", "zero_ccol_ptr", "zero_row_ptr", "bmap_ptr", "cmap_ptr",
             "pair_ptr_ptr", "pair_a_ptr", "pair_k_ptr")
_FP32_PTRS = ("lse_ptr", "delta_ptr", "w_ptr", "hsum_ptr", "colsum_ptr")


def aot_compile(dtype: torch.dtype, head_dim: int, dv: int, *, block_m: int = 64, block_n: int = 64,
                block_d: int = 32, has_zero: bool = True, count_io: bool = True, arch: int = 90,
                num_warps: int = 4, num_stages: int = 2) -> dict:
    """Compile ``paper_attn_fwd``, ``paper_attn_bwd_dkv``, ``paper_attn_bwd_dq`` and the row-panel
    product (``matmul``: ``[block_m, block_d] x [block_d, head_dim]`` panels) for ``sm_<arch>``;
    returns ``{kernel: {"shared": shared memory bytes, "scf_if": runtime branches in the TTGIR,
    "mma": (w)gmma instructions in the PTX}}``. ``head_dim`` is cut into ``ceil(head_dim / block_d)``
    d-tiles, as the launchers do; each per-tile product over the head dimension sits behind one
    runtime branch (``scf.if``) on the tile-presence flags. ``DOT_DTYPE`` is the launchers'
    (:func:`~sparse_io_attn._triton.runtime.dot_dtype`): ``tl.float32`` (IEEE products) for fp32,
    the input's 16-bit type (tensor-core MMAs) for bf16/fp16."""
    from sparse_io_attn._triton.aot import compile_for_cuda

    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_D_TILES=-(-head_dim // block_d),
                DV_PAD=padded_dim(dv), DOT_DTYPE=dot_dtype(dtype), COUNT_IO=count_io)
    jobs = {"paper_attn_fwd": (K._paper_attn_fwd_kernel, dict(meta, HAS_ZERO=has_zero)),
            "paper_attn_bwd_dkv": (K._paper_attn_bwd_dkv_kernel, dict(meta, HAS_ZERO=has_zero)),
            "paper_attn_bwd_dq": (K._paper_attn_bwd_dq_kernel, meta),
            "matmul": (K._bsr_matmul_kernel, dict(BLOCK_M=block_m, BLOCK_K=block_d, BLOCK_N=block_d,
                                                  NUM_N_TILES=meta["NUM_D_TILES"], WRITE_COLSUM=has_zero,
                                                  DOT_DTYPE=meta["DOT_DTYPE"], COUNT_IO=count_io))}
    out = {}
    for name, (kernel, consts) in jobs.items():
        compiled = compile_for_cuda(kernel, consts, dtype, int_ptrs=_INT_PTRS, fp32_ptrs=_FP32_PTRS, arch=arch,
                                    num_warps=num_warps, num_stages=num_stages)
        ptx = compiled.asm["ptx"]
        out[name] = dict(shared=compiled.metadata.shared, scf_if=compiled.asm["ttgir"].count("scf.if "),
                         mma=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"))
    return out
