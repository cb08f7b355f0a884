"""Launcher of the dense forward: ``O = softmax(scale * A1 X A2^T) A3 Y`` and ``lse``.

Kernels (traffic-report names): ``fwd.proj`` (twice: ``S = A1 X`` and ``h = A3 Y``, Algorithm 7's
schedule) and ``fwd.attn`` (FlashAttention-style online softmax, rows outer with
``B_r = min(M/4d, d)``, keys inner with ``B_c = M/4d``, shrunk to fit ``M``).
"""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import dot_dtype, launch
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.dense.launch import check_inputs, proj, triton_cdiv
from sparse_io_attn.dense.regime import default_M
from sparse_io_attn.dense.tiling import forward_blocks


def forward(A1, A2, A3, X, Y, *, scale: float = 1.0, M: int | None = None):
    """The paper's attention forward (Definition 3.1) with a numerically safe softmax.

    ``f`` is the normalized softmax ``D^-1 exp(scale * A1 X A2^T)``, computed with the row maximum
    subtracted (the paper's plain ``exp`` would overflow). ``scale`` defaults to 1.0 as in the
    paper; pass ``1/sqrt(d)`` for the usual transformer scaling.

    Args:
        A1, A2, A3: ``[..., n, d]``; X, Y: ``[d, d]`` (one dtype: fp32, bf16 or fp16).
        M: fast memory in words for the tile sizes (default :func:`~.regime.default_M`); below what
            16 x 16 tiles need, 16 x 16 tiles are used (:func:`~.tiling.forward_blocks`).

    Returns:
        ``(O, lse)``: ``O`` like ``A1``; ``lse`` fp32 ``[..., n]``, natural log of the row sums of
        ``exp(scale * A1 X A2^T)``.
    """
    inp = check_inputs(A1, A2, A3, X, Y)
    Z, n, d = inp.a1.shape
    M = default_M(inp.a1.dtype, inp.a1.device) if M is None else M
    pc_long, pc_short = forward_blocks("large.phase1", M, d)
    S = proj("fwd.proj", ("A1", "X", "S"), inp.a1, inp.x, block_m=pc_short, block_c=pc_long)
    h = proj("fwd.proj", ("A3", "Y", "h"), inp.a3, inp.y, block_m=pc_short, block_c=pc_long)
    long, short = forward_blocks("fwd.attn", M, d)
    O = torch.empty(Z, n, d, dtype=inp.a1.dtype, device=inp.a1.device)
    lse = torch.empty(Z, n, dtype=torch.float32, device=inp.a1.device)
    from sparse_io_attn.dense.kernels_fwd import _dense_fwd_kernel
    launch(_dense_fwd_kernel, (triton_cdiv(n, short), Z), "fwd.attn", ("S", "A2", "h", "O", "lse"),
           inp.a1.device, s_ptr=S, a2_ptr=inp.a2, h_ptr=h, o_ptr=O, lse_ptr=lse,
           seqlen=n, head_dim=d, sm_scale=float(scale),
           BLOCK_M=short, BLOCK_N=long, HEAD_DIM=padded_dim(d), DOT_DTYPE=dot_dtype(inp.a1.dtype))
    return O.reshape(inp.batch_shape + (n, d)), lse.reshape(inp.batch_shape + (n,))
