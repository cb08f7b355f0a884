"""The compile report of the sparse-operand kernels: every launch of one forward + backward of the
batched op, compiled for a CUDA architecture exactly as the launch would compile it, without a GPU.

:func:`example_calls` drives the op's own launchers (:mod:`.launch`) on CPU tensors under
:func:`sparse_io_attn._triton.runtime.recording`, which records each launch (kernel, grid, keyword
arguments with the launcher's ``num_warps``/``num_stages``) instead of running it. The example is
representative: ``B = 2`` batch elements, ``H = 4`` heads, 512 tokens in 64-row blocks, 32-wide
head-dim tiles, a per-head block-sparse ``X`` (some d-tiles of ``Q`` absent) and ``Y``, a sliding
window QK pattern (so some score blocks are kept, some structurally zero). :func:`compile_report`
compiles every recorded launch with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory,
asynchronous copies and ``scf.if`` branches (:func:`sparse_io_attn._triton.aot.ptx_report`).

``pipelined`` means the main loop's operand *tiles* are copied asynchronously (``tile_async``:
``ttg.async_copy_global_to_local`` of 2-D tiles in the TTGIR, i.e. multi-buffered ``cp.async``),
not only the scalar indices the loop reads. The preprocess kernel has no loop and is reported for
completeness.

Needs Triton imported with ``TRITON_INTERPRET=0``: run it in a fresh process (the
``compile-report --op sparse-operands`` command does).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import compile_call, ptx_report
from sparse_io_attn._triton.runtime import recording
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.api import attention

KERNELS = ("paper_q", "paper_h", "paper_attn_fwd", "paper_attn_bwd_preprocess", "paper_attn_bwd_dkv",
           "paper_attn_bwd_dq", "paper_da1", "paper_dx", "paper_da3", "paper_dy")
COLUMNS = ("kernel", "BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages", "registers", "spill_stores",
           "spill_loads", "shared_bytes", "cp_async", "tile_async", "scf_if", "wgmma", "pipelined")
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _per_head_sparse(n_heads: int, rows: int, cols: int, block: int, dtype: torch.dtype, seed: int) -> list:
    """``n_heads`` block-sparse matrices with a different pattern each: about half the blocks kept,
    and one block column empty in every head (a d-tile of ``Q = A1 X`` that is never stored)."""
    g = torch.Generator().manual_seed(seed)
    R, C = -(-rows // block), -(-cols // block)
    out = []
    for h in range(n_heads):
        keep = torch.rand(R, C, generator=g) < 0.5
        keep[torch.arange(R), torch.arange(R) % C] = True  # every block row keeps a tile
        keep[:, (h + 1) % C] = False
        out.append(BlockSparseMatrix.from_dense(torch.randn(rows, cols, generator=g).to(dtype) * keep.repeat_interleave(
            block, 0)[:rows].repeat_interleave(block, 1)[:, :cols], block_size=block))
    return out


def example_calls(dtype: torch.dtype, head_dim: int, dv: int | None = None, *, block: int = 64,
                  block_d: int = 32) -> list:
    """The launches (:class:`~sparse_io_attn._triton.runtime.Recorded`) of one forward + backward of
    the batched op on the example described in the module docstring (CPU tensors, nothing runs)."""
    dv = head_dim if dv is None else dv
    B, H, n = 2, 4, 512
    g = torch.Generator().manual_seed(0)
    a1, a2, a3 = (torch.randn(B, n, head_dim, generator=g).to(dtype).requires_grad_() for _ in range(3))
    x = _per_head_sparse(H, head_dim, head_dim, block_d, dtype, 1)
    y = _per_head_sparse(H, head_dim, dv, block_d, dtype, 2)
    for m in x + y:
        m.values.requires_grad_()
    layout = patterns.random(n, block, 0.4, seed=0, num_heads=H)  # whole blocks, a pattern per head
    with recording() as calls:
        o = attention(a1, a2, a3, x, y, qk_layout=layout, scale=head_dim ** -0.5, backend="triton")
        o.backward(torch.ones_like(o))
    return calls


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, dv: int | None = None, *,
                   block: int = 64, block_d: int = 32, arch: int = 90, kernels=KERNELS,
                   ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per recorded launch of :func:`example_calls` (kernels named as in the I/O report;
    the row-panel products ``paper_q`` ... ``paper_dy`` share one kernel): tiles, warps, stages,
    registers, spill bytes, shared memory, ``cp.async``, ``tile_async``, runtime branches
    (``scf.if`` in the TTGIR), ``wgmma`` and ``pipelined``. ``ptx_dir``: write each PTX there."""
    if ptx_dir is not None:
        Path(ptx_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for call in example_calls(dtype, head_dim, dv, block=block, block_d=block_d):
        if call.name not in kernels:
            continue
        kwargs = {k: v for k, v in call.kwargs.items() if k not in _LAUNCH_OPTIONS}
        warps, stages = call.kwargs["num_warps"], call.kwargs["num_stages"]
        compiled = compile_call(call.kernel, kwargs, num_warps=warps, num_stages=stages, arch=arch)
        ptx_file = None if ptx_dir is None else Path(ptx_dir) / f"{call.name}_w{warps}_s{stages}_sm{arch}.ptx"
        stats = ptx_report(compiled, arch=arch, ptx_file=ptx_file)
        bd = kwargs.get("BLOCK_D", kwargs.get("BLOCK_K", 0))
        has_loop = call.name != "paper_attn_bwd_preprocess"
        rows.append({"kernel": call.name, "BLOCK_M": kwargs["BLOCK_M"], "BLOCK_N": kwargs.get("BLOCK_N", 0),
                     "BLOCK_D": bd, "num_warps": warps, "num_stages": stages, **stats,
                     "scf_if": compiled.asm["ttgir"].count("scf.if "),
                     "pipelined": has_loop and stats["tile_async"] > 0})
    return rows
