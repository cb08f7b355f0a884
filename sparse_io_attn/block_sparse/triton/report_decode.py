"""The compile report of the block-sparse decode kernels (``attn_decode``, ``attn_decode_merge``):
compiled for a CUDA architecture exactly as a real launch would compile them, without a GPU.

:func:`example_calls` builds the launches :func:`.launch.decode_calls` would make (CPU tensors,
nothing runs) for two representative shapes against an 8192-key cache, 8 query heads and 2 KV heads
(one list per GQA group), a sliding window of ``8 * block + 7`` keys in the last rows (partial
blocks at its start and on the diagonal, full blocks between), bottom-right causal, so both
kernels run (the rows are split):

* ``"decode"``: one token (``BLOCK_M = 16``: 4 heads x 1 token, padded);
* ``"verify"``: 16 tokens (speculative verification: ``BLOCK_M = 64``, 4 heads x 16 tokens).

:func:`compile_report` compiles each with the JIT's specialisation
(:func:`sparse_io_attn._triton.aot.compile_call`) and reads registers, spill bytes, shared memory,
asynchronous copies and tensor-core MMAs (:func:`sparse_io_attn._triton.aot.ptx_report`).
``pipelined``: the main loops' loads are asynchronous (``cp.async`` or TMA in the PTX); the merge
kernel's loop over splits reads fp32 partial rows (its loads multi-buffered too).

Needs Triton imported with ``TRITON_INTERPRET=0`` (the ``compile-report`` command sets it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparse_io_attn._triton.aot import report_split_calls
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.block_sparse.triton.launch import decode_calls
from sparse_io_attn.layout.core import BlockSparseLayout

KERNELS = ("attn_decode", "attn_decode_merge")
LOOPLESS = ""  # every decode kernel has a main loop
COLUMNS = ("shape", "kernel", "BLOCK_M", "BLOCK_N", "splits", "num_warps", "num_stages", "registers",
           "spill_stores", "spill_loads", "shared_bytes", "cp_async", "tma", "wgmma", "pipelined")
SHAPES = {"decode": 1, "verify": 16}   # query tokens
NUM_KEYS = 8192


def window_layout(num_queries: int, num_keys: int, block: int, window: int) -> BlockSparseLayout:
    """The decode layout of a bottom-right sliding window: query ``i`` (position ``num_keys -
    num_queries + i``) sees keys ``[position - window, position]``; element-exact, one query block
    row per ``block`` tokens, built from the window's key blocks only."""
    pos = torch.arange(num_keys - num_queries, num_keys)
    first, last = (pos - window).clamp(min=0) // block, pos // block
    c0, c1 = int(first.min()), int(last.max()) + 1
    keys = torch.arange(c0 * block, min(c1 * block, num_keys))
    allowed = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= pos[:, None] - window)
    dense = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    dense[:, c0 * block:c0 * block + keys.numel()] = allowed
    return BlockSparseLayout.from_dense_mask(dense, block)


def example_calls(dtype: torch.dtype, head_dim: int, block: int, shape: str = "decode") -> list:
    """The decode launches at a representative size (CPU tensors, no launch)."""
    B, Hq, Hkv, Nq = 1, 8, 2, SHAPES[shape]
    layout = window_layout(Nq, NUM_KEYS, block, 8 * block + 7)
    q = torch.randn(B, Hq, Nq, head_dim).to(dtype)
    k, v = (torch.randn(B, Hkv, NUM_KEYS, head_dim).to(dtype) for _ in range(2))
    calls, *_ = decode_calls(q, k, v, plan(layout, causal="bottom_right"), head_dim ** -0.5)
    return calls


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, block: int = 128, *,
                   causal: bool = True, arch: int = 90, configs: str = "all", kernels=KERNELS,
                   shapes=tuple(SHAPES), ptx_dir: str | Path | None = None) -> list[dict]:
    """One row per (shape, kernel): tiles, splits, warps, stages, registers, spill bytes, shared
    memory, ``cp.async``/TMA/``wgmma`` counts and ``pipelined``. The decode kernels have one launch
    configuration each (``configs`` is accepted for the command's sake); the example layouts are
    causal whatever ``causal`` says (decoding is bottom-right causal)."""
    if configs not in ("all", "default"):
        raise ValueError(f"configs must be 'all' or 'default', got {configs!r}")
    return report_split_calls(((shape, example_calls(dtype, head_dim, block, shape)) for shape in shapes),
                              kernels=kernels, arch=arch, ptx_dir=ptx_dir)
