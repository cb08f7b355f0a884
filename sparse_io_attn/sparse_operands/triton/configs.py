"""Launch configurations (``num_warps``, ``num_stages``) of the sparse-operand kernels on CUDA, one
place read by the launcher (:mod:`.launch`) and the compile report (:mod:`.report`); the
interpreter ignores them.

Chosen from the sm_90 compile report (bf16, 64 x 64 tiles, 32-wide head-dim tiles, head dims 64
and 128): with 4 warps the dK/dV kernel (``a2``, ``h`` and the ``dA2``/``dH`` accumulators held for
the whole program) and the dQ kernel spill registers; 8 warps halve every thread's share of those
tiles. The forward kernel does not spill with 4 warps and keeps its multi-buffered loads with 2
stages. At head dim 128 the dK/dV kernel still spills a few hundred bytes with 8 warps (its
``64 x 128`` fp32 ``dA2`` and ``dH`` accumulators alone take 64 registers a thread); a smaller key
block (the operands' block size) removes that. This module imports nothing, so the compile report
can read it without loading the launcher's runtime.
"""

#: kernel report name (or ``"matmul"`` for every row-panel product) -> (num_warps, num_stages)
LAUNCH = {
    "paper_attn_fwd": (4, 2),
    "paper_attn_bwd_preprocess": (4, 1),
    "paper_attn_bwd_dkv": (8, 2),
    "paper_attn_bwd_dq": (8, 2),
    "matmul": (8, 2),
}


#: kernels whose main loop is a ``tl.range(..., num_stages=LOOP_STAGES)``
LOOPED = ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "matmul")


def launch_options(kernel: str) -> dict:
    """``{"num_warps": ..., "num_stages": ...}`` of a kernel for ``kernel[grid](..., **options)``,
    and for a kernel with a main loop its ``LOOP_STAGES`` constexpr (the same stage count)."""
    warps, stages = LAUNCH[kernel]
    return {"num_warps": warps, "num_stages": stages, **({"LOOP_STAGES": stages} if kernel in LOOPED else {})}



def dkv_query_slice(block_m: int, head_dim: int) -> int:
    """Rows of a query block the dK/dV kernel processes per loop iteration (its ``BLOCK_M_SUB``,
    dividing ``block_m``; ``head_dim`` rounded up to whole d-tiles): the whole block up to head dim
    64, 32-row slices above, where the ``[BLOCK_N, 128]`` fp32 ``dA2`` and ``dH`` accumulators held
    for the whole program leave no room for a 64-row slice's tiles (sm_90 compile report: spills at
    64 rows, none at 32). Every product keeps the key block's rows as its ``M`` (tensor-core
    ``wgmma`` needs 64)."""
    return min(block_m, 64 if head_dim <= 64 else 32)
