"""The compile report of the selection decode kernels (``selection_decode``, ``selection_decode_merge``):
compiled for a CUDA architecture exactly as a real launch would compile them, without a GPU.

:func:`example_calls` builds the launches :func:`.launch.decode_calls` would make (CPU tensors,
nothing runs) against an 8192-key cache, bottom-right causal, each token selecting ``2048 // block``
blocks of ``block`` keys (2048 keys: the rows are split, so both kernels run):

* ``"decode"``: one token, NSA-shaped (a selection per GQA group: ``Hq = 16``, ``Hkv = 2``, ``G = 2``,
  8 heads per tile, ``BLOCK_H = 16``);
* ``"verify"``: 16 tokens (speculative verification), one selection shared by the 64 query heads of
  one KV head (``Hq = 64``, ``Hkv = 1``, ``G = 1``: ``BLOCK_H = 64``, the widest tile).

:func:`compile_report` compiles each with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory,
asynchronous copies and tensor-core MMAs (:func:`sparse_io_attn._triton.aot.ptx_report`).
``pipelined``: the main loop's 2-D tiles are copied asynchronously (``tile_async``: the gathered K/V
tiles of the decode kernel, the fp32 partial rows of the merge's loop over splits).

Needs Triton imported with ``TRITON_INTERPRET=0`` (the ``compile-report`` command sets it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import report_split_calls
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.triton.launch import decode_calls

KERNELS = ("selection_decode", "selection_decode_merge")
LOOPLESS = ""  # every decode kernel has a main loop
COLUMNS = ("shape", "kernel", "BLOCK_M", "BLOCK_N", "splits", "num_warps", "num_stages", "registers",
           "spill_stores", "spill_loads", "shared_bytes", "cp_async", "tile_async", "wgmma", "pipelined")
SHAPES = {"decode": (1, 16, 2, 2), "verify": (16, 64, 1, 1)}   # (Nq, Hq, Hkv, G)
NUM_KEYS = 8192
ROW_KEYS = 2048


def example_calls(dtype: torch.dtype, head_dim: int, block: int, shape: str = "decode") -> list:
    """The decode launches at a representative size (CPU tensors, no launch)."""
    Nq, Hq, Hkv, G = SHAPES[shape]
    nkb = -(-NUM_KEYS // block)
    K = max(1, ROW_KEYS // block)
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, nkb, (1, G, Nq, K), generator=g)
    plan = SelectionPlan(Selection(indices, block), NUM_KEYS, causal_offset("bottom_right", Nq, NUM_KEYS))
    q = torch.randn(1, Hq, Nq, head_dim).to(dtype)
    k, v = (torch.randn(1, Hkv, NUM_KEYS, head_dim).to(dtype) for _ in range(2))
    calls, *_ = decode_calls(q, k, v, plan, head_dim ** -0.5)
    return calls


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, block: int = 64, *,
                   arch: int = 90, kernels=KERNELS, shapes=tuple(SHAPES),
                   ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per (shape, kernel): tiles (``BLOCK_M``: the decode kernel's ``BLOCK_H`` heads, the
    merge's ``BLOCK_R`` rows), splits, warps, stages, registers, spill bytes, shared memory,
    ``cp.async``/``tile_async``/``wgmma`` counts and ``pipelined``. The decode kernels have one
    launch configuration each; the example selections are bottom-right causal (decoding)."""
    return report_split_calls(((shape, example_calls(dtype, head_dim, block, shape)) for shape in shapes),
                              kernels=kernels, arch=arch, ptx_dir=ptx_dir, block_m_key="BLOCK_H",
                              pipelined=lambda stats: stats["tile_async"] > 0)
