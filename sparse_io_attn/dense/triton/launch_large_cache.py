"""Launcher of the large-cache backward, Algorithm 9 (Appendix D: Algorithms 7 and 8).

No ``n x n`` matrix is ever stored or read: score tiles are recomputed from ``S``, ``A2`` and the
forward's ``lse``. Two variants, by name:

* ``"faithful"``: Algorithm 9 as written. ``large.phase1`` (Algorithm 7: ``S = A1 X``, ``h = A3 Y``),
  then ``large.phase2`` (Algorithm 8: rows outer with ``B_r = min(M/4d, d)``, keys inner with
  ``B_c = M/4d``, ``g`` resident; it also writes ``dS = p A2``). Because ``B_r`` is capped at
  ``d``, every one of the ``n/B_r`` row blocks re-reads all of ``h`` and ``A2``: the traffic stops
  falling once ``M`` passes a few ``d^2`` (see ``benchmarks/results/dense_figure1.md``).
* ``"fa2"``: FlashAttention-2's loop orders, which keep the ``1/M`` scaling: ``large.dq`` (rows
  outer with the long side ``M/4d`` on the rows, computing ``dS``), then ``large.g``:
  ``g = scale * A1^T dS``. It needs no ``d x d`` resident gradient, so it also runs below ``d^2``.

Both then run ``large.delta`` (``v = (O o dO) 1``), ``large.dkdh`` (keys outer:
``dA2 = scale * p^T S``, ``dh = f^T dO``) and the projections ``large.dA1`` (``scale * dS X^T``),
``large.dA3`` (``dh Y^T``) and ``large.dY`` (``A3^T dh``).
"""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import dot_dtype, launch
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.dense.triton.launch import (DenseGrads, atb, check_inputs, check_like, delta, finish, proj,
                                                triton_cdiv)
from sparse_io_attn.dense.tiles import large_cache_blocks
from sparse_io_attn.dense.traffic import COL_TENSORS, DQ_TENSORS, ROW_TENSORS, VARIANTS
from sparse_io_attn.dense.triton.bwd_large_cache import _col_kernel, _row_kernel


def backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, *, M: int, scale: float = 1.0,
                         variant: str = "faithful", num_splits: int = 1) -> DenseGrads:
    """Gradients of ``O = softmax(scale * A1 X A2^T) A3 Y`` by Algorithm 9 (large cache).

    Args:
        A1, A2, A3, dO, O: ``[..., n, d]``; X, Y: ``[d, d]``; lse: fp32 ``[..., n]`` (natural log of
            the softmax row sums, from :func:`~sparse_io_attn.dense.forward`).
        M: fast memory in words; tile sides start at the paper's ``B_c = M/(4d)``,
            ``B_r = min(M/(4d), d)`` (powers of two) and shrink until each kernel's working set fits
            (:func:`~.tiles.large_cache_blocks`).
        variant: ``"faithful"`` (Algorithm 8 as written) or ``"fa2"`` (keeps ``1/M`` scaling).
        num_splits: programs per batch element sharing Algorithm 8's row blocks (``"faithful"``
            only); each writes its own ``d x d`` partial of ``g``.

    Returns :class:`DenseGrads` ``(dX, dY, dA1, dA2, dA3)``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    inp = check_inputs(A1, A2, A3, X, Y)
    do = check_like("dO", dO, inp)
    o = check_like("O", O, inp)
    lse = check_like("lse", lse, inp, dtype=torch.float32, shape=inp.batch_shape + (inp.n,))
    Z, n, d = inp.a1.shape
    a1, a2, a3 = inp.a1, inp.a2, inp.a3
    dev = a1.device
    D = padded_dim(d)
    dt = dot_dtype(a1.dtype)

    # Algorithm 7: S = A1 X, h = A3 Y
    pc_long, pc_short = large_cache_blocks("large.phase1", M, d)
    S = proj("large.phase1", ("A1", "X", "S"), a1, inp.x, block_m=pc_short, block_c=pc_long)
    h = proj("large.phase1", ("A3", "Y", "h"), a3, inp.y, block_m=pc_short, block_c=pc_long)
    _, dl_short = large_cache_blocks("large.delta", M, d)
    v = delta("large.delta", o, do, block_m=dl_short)
    dS = torch.empty(Z, n, d, dtype=torch.float32, device=dev)
    common = dict(s_ptr=S, a2_ptr=a2, h_ptr=h, do_ptr=do, lse_ptr=lse, ds_ptr=dS,
                  seqlen=n, head_dim=d, sm_scale=float(scale), HEAD_DIM=D, DOT_DTYPE=dt)
    at_long, at_short = large_cache_blocks("large.atb", M, d)
    if variant == "faithful":
        # Algorithm 8: B_c = long side on the keys, B_r = short side on the rows
        long, short = large_cache_blocks("large.phase2", M, d)
        dX = torch.empty(Z, num_splits, d, d, dtype=torch.float32, device=dev)
        launch(_row_kernel, (num_splits, Z), "large.phase2",
               ROW_TENSORS, dev,
               ov_ptr=o, a1_ptr=a1, g_ptr=dX, num_splits=num_splits,
               BLOCK_M=short, BLOCK_N=long, FAITHFUL=True, **common)
    else:
        long, short = large_cache_blocks("large.dq", M, d)
        launch(_row_kernel, (triton_cdiv(n, long), Z), "large.dq",
               DQ_TENSORS, dev,
               ov_ptr=v, a1_ptr=a1, g_ptr=dS, num_splits=triton_cdiv(n, long),
               BLOCK_M=long, BLOCK_N=short, FAITHFUL=False, **common)
        dX = atb("large.g", ("A1", "dS", "dX"), a1, dS, block_m=at_short, block_c=at_long, alpha=scale)
    # keys outer: dA2 = scale * p^T S, dh = f^T dO
    long, short = large_cache_blocks("large.dkdh", M, d)
    dA2 = torch.empty(Z, n, d, dtype=a1.dtype, device=dev)
    dh = torch.empty(Z, n, d, dtype=torch.float32, device=dev)
    launch(_col_kernel, (triton_cdiv(n, long), Z), "large.dkdh",
           COL_TENSORS, dev,
           s_ptr=S, a2_ptr=a2, h_ptr=h, do_ptr=do, lse_ptr=lse, v_ptr=v, da2_ptr=dA2, dh_ptr=dh,
           seqlen=n, head_dim=d, sm_scale=float(scale),
           BLOCK_M=short, BLOCK_N=long, HEAD_DIM=D, DOT_DTYPE=dt)
    dA1 = proj("large.dA1", ("dS", "X", "dA1"), dS, inp.x.t(), block_m=pc_short, block_c=pc_long,
               out_dtype=a1.dtype, alpha=scale)
    dA3 = proj("large.dA3", ("dh", "Y", "dA3"), dh, inp.y.t(), block_m=pc_short, block_c=pc_long,
               out_dtype=a1.dtype)
    dY = atb("large.dY", ("A3", "dh", "dY"), a3, dh, block_m=at_short, block_c=at_long)
    return finish(inp, dX, dY, dA1, dA2, dA3)
