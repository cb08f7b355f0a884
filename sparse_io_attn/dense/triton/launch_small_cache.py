"""Launcher of the small-cache backward, Algorithm 6 (Appendix C, phases 1-4 = Algorithms 2-5).

All products run on ``B x B`` tiles, ``B`` = the largest power of two ``<= sqrt(M/4)``; the
``n x n`` matrices ``f, q, p`` are materialized in global memory (fp32), as the algorithm does.
Kernel names in the traffic report (see :mod:`.traffic`)::

    small.phase1.S   S = A1 X                      small.dh    dh = f^T dO
    small.phase1.f   f = softmax(scale * S A2^T)   small.dY    dY = A3^T dh
    small.phase2.h   h = A3 Y                      small.dA3   dA3 = dh Y^T
    small.phase2.q   q = dO h^T                    small.dS    dS = p A2
    small.phase3.p   p = f o q - diag((f o q) 1) f small.dA1   dA1 = scale * dS X^T
    small.phase4.T   T = A1^T p                    small.dA2   dA2 = scale * p^T S
    small.phase4.g   dX = g = scale * T A2

The first seven are the paper's Algorithm 6 (the ``dX`` path); the rest give the other gradients
with the same tiles.
"""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import dot_dtype, launch
from sparse_io_attn.dense.triton.launch import DenseGrads, check_inputs, check_like, finish, triton_cdiv
from sparse_io_attn.dense.buffers import check_buffers, nn_buffer_bytes
from sparse_io_attn.dense.tiles import small_cache_block
from sparse_io_attn.dense.traffic import PHASE3_TENSORS, SOFTMAX_TENSORS
from sparse_io_attn.dense.triton.bwd_small_cache import _phase3_kernel, _softmax_kernel, _tile_matmul_kernel

def _tile_mm(name, tensors, a, b, *, B, out_dtype=torch.float32, alpha=1.0):
    """``alpha * a @ b`` per batch element on ``B x B`` tiles; ``a [Z, m, k]``, ``b [Z, k, n]``
    (any strides, stride 0 for a weight shared by the batch)."""
    Z, m, k = a.shape
    n = b.shape[2]
    c = torch.empty(Z, m, n, dtype=out_dtype, device=a.device)
    launch(_tile_matmul_kernel, (triton_cdiv(m, B), triton_cdiv(n, B), Z), name, tensors, a.device,
           a_ptr=a, b_ptr=b, c_ptr=c,
           stride_az=a.stride(0), stride_am=a.stride(1), stride_ak=a.stride(2),
           stride_bz=b.stride(0), stride_bk=b.stride(1), stride_bn=b.stride(2),
           stride_cz=c.stride(0), stride_cm=c.stride(1), stride_cn=c.stride(2),
           size_m=m, size_n=n, size_k=k, alpha=float(alpha),
           BLOCK=B, DOT_DTYPE=dot_dtype(a.dtype if a.dtype != torch.float32 else b.dtype))
    return c


def backward_small_cache(A1, A2, A3, X, Y, dO, *, M: int, scale: float = 1.0) -> DenseGrads:
    """Gradients of ``O = softmax(scale * A1 X A2^T) A3 Y`` by Algorithm 6 (small cache).

    Args:
        A1, A2, A3: ``[..., n, d]``; X, Y: ``[d, d]``; dO: ``[..., n, d]`` (all one dtype).
        M: fast memory in words (elements); tiles are ``B x B`` with ``B`` the largest power of two
            ``<= sqrt(M/4)``, at least 16 (``M >= 1024``).
        scale: softmax scale (1.0 as in the paper; ``1/sqrt(d)`` is the usual transformer choice).

    Returns:
        :class:`DenseGrads` ``(dX, dY, dA1, dA2, dA3)``; ``dX`` is the paper's ``g`` (Definition 3.2,
        times ``scale``).

    Raises ``ValueError`` when ``M`` is too small or when ``f, q, p`` (``3 n^2`` fp32 words per batch
    element) would not fit in the device's free memory.
    """
    inp = check_inputs(A1, A2, A3, X, Y)
    do = check_like("dO", dO, inp)
    B = small_cache_block(M)
    Z, n, d = inp.a1.shape
    check_buffers(nn_buffer_bytes(n, d, Z), inp.a1.device,
                  f"the small-cache backward materializes f, q, p (n x n, fp32) and T for n = {n}, d = {d}, "
                  f"batch = {Z}", "use regime='large' (it never stores an n x n matrix)")
    a1, a2, a3 = inp.a1, inp.a2, inp.a3
    x3, y3 = inp.x.expand(Z, d, d), inp.y.expand(Z, d, d)
    tr = lambda t: t.transpose(1, 2)  # noqa: E731

    # Phase 1 (Algorithm 2): S = A1 X, then f
    S = _tile_mm("small.phase1.S", ("A1", "X", "S"), a1, x3, B=B)
    f = torch.empty(Z, n, n, dtype=torch.float32, device=a1.device)
    launch(_softmax_kernel, (triton_cdiv(n, B), Z), "small.phase1.f", SOFTMAX_TENSORS[:3], a1.device,
           s_ptr=S, a2_ptr=a2, f_ptr=f, lse_ptr=f,
           stride_sz=S.stride(0), stride_sm=S.stride(1), stride_sd=S.stride(2),
           stride_kz=a2.stride(0), stride_kn=a2.stride(1), stride_kd=a2.stride(2),
           stride_fz=f.stride(0), stride_fm=f.stride(1), stride_fn=f.stride(2),
           seqlen=n, head_dim=d, sm_scale=float(scale), BLOCK=B, DOT_DTYPE=dot_dtype(a2.dtype), WRITE_LSE=False)
    # Phase 2 (Algorithm 3): h = A3 Y, q = dO h^T
    h = _tile_mm("small.phase2.h", ("A3", "Y", "h"), a3, y3, B=B)
    q = _tile_mm("small.phase2.q", ("dO", "h", "q"), do, tr(h), B=B)
    # Phase 3 (Algorithm 4): p = f o q - diag((f o q) 1) f
    p = torch.empty_like(f)
    launch(_phase3_kernel, (triton_cdiv(n, B), Z), "small.phase3.p", PHASE3_TENSORS, a1.device,
           f_ptr=f, q_ptr=q, p_ptr=p, stride_z=f.stride(0), stride_m=f.stride(1), stride_n=f.stride(2),
           seqlen=n, BLOCK=B)
    del q
    # Phase 4 (Algorithm 5): T = A1^T p, g = scale * T A2
    T = _tile_mm("small.phase4.T", ("A1", "p", "T"), tr(a1), p, B=B)
    dX = _tile_mm("small.phase4.g", ("T", "A2", "dX"), T, a2, B=B, alpha=scale)
    del T
    # the other gradients, same tiling
    dh = _tile_mm("small.dh", ("f", "dO", "dh"), tr(f), do, B=B)
    del f
    dY = _tile_mm("small.dY", ("A3", "dh", "dY"), tr(a3), dh, B=B)
    dA3 = _tile_mm("small.dA3", ("dh", "Y", "dA3"), dh, tr(y3), B=B, out_dtype=a1.dtype)
    dS = _tile_mm("small.dS", ("p", "A2", "dS"), p, a2, B=B)
    dA1 = _tile_mm("small.dA1", ("dS", "X", "dA1"), dS, tr(x3), B=B, out_dtype=a1.dtype, alpha=scale)
    dA2 = _tile_mm("small.dA2", ("p", "S", "dA2"), tr(p), S, B=B, out_dtype=a1.dtype, alpha=scale)
    return finish(inp, dX, dY, dA1, dA2, dA3)
