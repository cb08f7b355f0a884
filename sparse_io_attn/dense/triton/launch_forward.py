"""Launcher of the dense forward: ``O = softmax(scale * A1 X A2^T) A3 Y`` and ``lse``.

Two forwards (Table 1 of the paper, "General / Forward Upper"):

* large cache (Dao et al. 2022, FlashAttention order): ``fwd.proj`` (twice: ``S = A1 X`` and
  ``h = A3 Y``, Algorithm 7's schedule) and ``fwd.attn`` (online softmax, rows outer with
  ``B_r = min(M/4d, d)``, keys inner with ``B_c = M/4d``, shrunk to fit ``M``). No ``n x n`` matrix.
* small cache (Saha & Ye 2024, ``O(n^2 d / sqrt(M))``): every product on ``B x B`` tiles,
  ``B = pow2 <= sqrt(M/4)``, so every program holds at most ``3B^2 + 2B <= M`` words:
  ``fwd.small.S`` (``S = A1 X``), ``fwd.small.f`` (``f = softmax(scale * S A2^T)`` stored ``n x n``
  fp32, and ``lse``; the kernel of Algorithm 2's lines 15-35), ``fwd.small.h`` (``h = A3 Y``) and
  ``fwd.small.O`` (``O = f h``).

``regime="auto"`` runs the feasible one with fewer predicted bytes (:func:`~.regime.choose_forward`).
"""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import dot_dtype, launch
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.dense.triton.launch import check_inputs, proj, triton_cdiv
from sparse_io_attn.dense.regime import choose_forward, default_M
from sparse_io_attn.dense.tiles import forward_blocks, large_cache_blocks, small_cache_block
from sparse_io_attn.dense.traffic import FWD_TENSORS, SOFTMAX_TENSORS
from sparse_io_attn.dense.triton.fwd import _dense_fwd_kernel
from sparse_io_attn.dense.triton.bwd_small_cache import _softmax_kernel
from sparse_io_attn.dense.buffers import check_buffers, free_memory_bytes, small_forward_buffer_bytes
from sparse_io_attn.dense.triton.launch_small_cache import _tile_mm



def forward(A1, A2, A3, X, Y, *, scale: float = 1.0, M: int | None = None, regime: str = "auto"):
    """The paper's attention forward (Definition 3.1) with a numerically safe softmax.

    ``f`` is the normalized softmax ``D^-1 exp(scale * A1 X A2^T)``, computed with the row maximum
    subtracted (the paper's plain ``exp`` would overflow). ``scale`` defaults to 1.0 as in the
    paper; pass ``1/sqrt(d)`` for the usual transformer scaling.

    Args:
        A1, A2, A3: ``[..., n, d]``; X, Y: ``[d, d]`` (one dtype: fp32, bf16 or fp16).
        M: fast memory in words (default :func:`~.regime.default_M`).
        regime: ``"auto"`` (the feasible kernel with fewer predicted bytes, see
            :func:`~.regime.choose_forward`; ``ValueError`` when none fits ``M``), ``"small"`` (the
            small-cache forward; ``M >= 1024``) or ``"large"`` (FlashAttention order; below what its
            tiles need it uses ``16 x 16`` tiles, which hold more than ``M`` words,
            :func:`~.tiles.forward_blocks`).

    Returns:
        ``(O, lse)``: ``O`` like ``A1``; ``lse`` fp32 ``[..., n]``, natural log of the row sums of
        ``exp(scale * A1 X A2^T)``.
    """
    inp = check_inputs(A1, A2, A3, X, Y)
    Z, n, d = inp.a1.shape
    M = default_M(inp.a1.dtype, inp.a1.device) if M is None else M
    if regime == "auto":
        kernel = choose_forward(n, d, M, dtype=inp.a1.dtype, batch=Z,
                                memory_bytes=free_memory_bytes(inp.a1.device)[0]).kernel
    else:
        kernel = choose_forward(n, d, M, dtype=inp.a1.dtype, batch=Z, regime=regime).kernel
    if kernel == "small":
        O, lse = _forward_small(inp, M, scale)
    else:
        O, lse = _forward_large(inp, M, scale, fit=regime == "auto")
    return O.reshape(inp.batch_shape + (n, d)), lse.reshape(inp.batch_shape + (n,))


def _forward_large(inp, M, scale, fit):
    Z, n, d = inp.a1.shape
    blocks = large_cache_blocks if fit else forward_blocks
    pc_long, pc_short = blocks("large.phase1", M, d)
    S = proj("fwd.proj", ("A1", "X", "S"), inp.a1, inp.x, block_m=pc_short, block_c=pc_long)
    h = proj("fwd.proj", ("A3", "Y", "h"), inp.a3, inp.y, block_m=pc_short, block_c=pc_long)
    long, short = blocks("fwd.attn", M, d)
    O = torch.empty(Z, n, d, dtype=inp.a1.dtype, device=inp.a1.device)
    lse = torch.empty(Z, n, dtype=torch.float32, device=inp.a1.device)
    launch(_dense_fwd_kernel, (triton_cdiv(n, short), Z), "fwd.attn", FWD_TENSORS,
           inp.a1.device, s_ptr=S, a2_ptr=inp.a2, h_ptr=h, o_ptr=O, lse_ptr=lse,
           seqlen=n, head_dim=d, sm_scale=float(scale),
           BLOCK_M=short, BLOCK_N=long, HEAD_DIM=padded_dim(d), DOT_DTYPE=dot_dtype(inp.a1.dtype))
    return O, lse


def _forward_small(inp, M, scale):
    """The small-cache forward: four counted launches on ``B x B`` tiles (module docstring)."""
    Z, n, d = inp.a1.shape
    B = small_cache_block(M)
    check_buffers(small_forward_buffer_bytes(n, d, Z), inp.a1.device,
                  f"the small-cache forward stores f (n x n, fp32), S and h: n = {n}, d = {d}, batch = {Z}",
                  "use regime='large' (it never stores an n x n matrix)")
    a1, a2, a3 = inp.a1, inp.a2, inp.a3
    x3, y3 = inp.x.expand(Z, d, d), inp.y.expand(Z, d, d)
    S = _tile_mm("fwd.small.S", ("A1", "X", "S"), a1, x3, B=B)
    f = torch.empty(Z, n, n, dtype=torch.float32, device=a1.device)
    lse = torch.empty(Z, n, dtype=torch.float32, device=a1.device)
    launch(_softmax_kernel, (triton_cdiv(n, B), Z), "fwd.small.f", SOFTMAX_TENSORS, a1.device,
           s_ptr=S, a2_ptr=a2, f_ptr=f, lse_ptr=lse,
           stride_sz=S.stride(0), stride_sm=S.stride(1), stride_sd=S.stride(2),
           stride_kz=a2.stride(0), stride_kn=a2.stride(1), stride_kd=a2.stride(2),
           stride_fz=f.stride(0), stride_fm=f.stride(1), stride_fn=f.stride(2),
           seqlen=n, head_dim=d, sm_scale=float(scale), BLOCK=B, DOT_DTYPE=dot_dtype(a2.dtype), WRITE_LSE=True)
    del S
    h = _tile_mm("fwd.small.h", ("A3", "Y", "h"), a3, y3, B=B)
    O = _tile_mm("fwd.small.O", ("f", "h", "O"), f, h, B=B, out_dtype=a1.dtype)
    return O, lse
