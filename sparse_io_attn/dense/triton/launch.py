"""Host-side helpers shared by the dense launchers: input checks and the launchers of the shared
kernels (projection ``A W``, ``A^T B``, ``v = (O o dO) 1``). Every kernel is launched through
:func:`sparse_io_attn._triton.runtime.launch` with a tensor-name tuple in the kernel's slot order
(:mod:`sparse_io_attn.dense.traffic`'s ``*_TENSORS``; a product names its own ``(A, B, C)``).

Storage convention: inputs and their gradients (``A1, A2, A3, X, Y, dO, O, dA*``) keep the input
dtype; every intermediate (``S, h, f, q, p, T, dS, dh``), ``lse``/``v`` and the per-batch-element
``d x d`` gradient partials are fp32. ``dX``/``dY`` partials are summed over the batch (and over
``num_splits``) by a torch reduction on the host (``Z * splits * d^2`` words, not a kernel, not
counted) and cast to the input dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn._triton.runtime import check_device, dot_dtype, launch
from sparse_io_attn._triton.shapes import padded_dim
from sparse_io_attn.dense.traffic import DELTA_TENSORS
from sparse_io_attn.dense.triton.common import _atb_kernel, _delta_kernel, _proj_kernel

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DenseGrads(NamedTuple):
    """Gradients of the dense form ``O = softmax(scale * A1 X A2^T) A3 Y``: ``dX`` (the paper's
    ``g``, ``[d, d]``), ``dY`` (``[d, d]``), ``dA1, dA2, dA3`` (shaped like the inputs)."""
    dX: torch.Tensor
    dY: torch.Tensor
    dA1: torch.Tensor
    dA2: torch.Tensor
    dA3: torch.Tensor


class DenseInputs(NamedTuple):
    """Validated inputs flattened to contiguous ``[Z, n, d]`` (``Z`` = product of leading dims)."""
    a1: torch.Tensor
    a2: torch.Tensor
    a3: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    batch_shape: tuple
    n: int
    d: int


def check_inputs(A1, A2, A3, X, Y) -> DenseInputs:
    """Validate the paper's inputs and flatten the leading dims (raises ``TypeError``/``ValueError``)."""
    for name, t in (("A1", A1), ("A2", A2), ("A3", A3), ("X", X), ("Y", Y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of float32, bfloat16, float16")
    if A1.dim() < 2:
        raise ValueError(f"A1 must have shape [..., n, d], got {tuple(A1.shape)}")
    for name, t in (("A2", A2), ("A3", A3)):
        if t.shape != A1.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} and A1 {tuple(A1.shape)}; A1, A2, A3 "
                             f"must all be [..., n, d] with the same n, d and leading dims")
    n, d = A1.shape[-2], A1.shape[-1]
    for name, t in (("X", X), ("Y", Y)):
        if t.shape != (d, d):
            raise ValueError(f"{name} must be [d, d] = [{d}, {d}] (d = last dim of A1), got {tuple(t.shape)}")
    dtypes = {t.dtype for t in (A1, A2, A3, X, Y)}
    if len(dtypes) > 1:
        raise TypeError(f"A1, A2, A3, X, Y must share one dtype, got {sorted(map(str, dtypes))}; cast them")
    devices = {t.device for t in (A1, A2, A3, X, Y)}
    if len(devices) > 1:
        raise ValueError(f"A1, A2, A3, X, Y must be on one device, got {sorted(map(str, devices))}")
    if n == 0 or d == 0:
        raise ValueError(f"n and d must be positive, got n = {n}, d = {d}")
    check_device(A1, "sparse_io_attn.dense")
    batch_shape = tuple(A1.shape[:-2])
    flat = lambda t: t.reshape(-1, n, d).contiguous()  # noqa: E731
    return DenseInputs(flat(A1), flat(A2), flat(A3), X.contiguous(), Y.contiguous(), batch_shape, n, d)


def check_like(name: str, t, inp: DenseInputs, *, dtype=None, shape=None) -> torch.Tensor:
    """Validate an extra operand (``dO``, ``O``, ``lse``) against the inputs; return it flattened."""
    shape = shape if shape is not None else inp.batch_shape + (inp.n, inp.d)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    want = dtype or inp.a1.dtype
    if t.dtype != want:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {want}")
    if t.device != inp.a1.device:
        raise ValueError(f"{name} is on {t.device} but A1 on {inp.a1.device}")
    Z = inp.a1.shape[0]
    return t.reshape(Z, *shape[len(inp.batch_shape):]).contiguous()


def proj(name: str, tensors, a: torch.Tensor, w: torch.Tensor, *, block_m: int, block_c: int,
         out_dtype=torch.float32, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ w`` for ``a [Z, n, d_in]`` and ``w [d_in, d_out]`` (any strides); Algorithm 7's
    row-block x column-block schedule (:func:`~.common._proj_kernel`)."""
    Z, n, d_in = a.shape
    d_out = w.shape[1]
    c = torch.empty(Z, n, d_out, dtype=out_dtype, device=a.device)
    launch(_proj_kernel, (triton_cdiv(n, block_m), Z), name, tensors, a.device,
           a_ptr=a, w_ptr=w, c_ptr=c,
           stride_az=a.stride(0), stride_am=a.stride(1), stride_ad=a.stride(2),
           stride_wk=w.stride(0), stride_wn=w.stride(1),
           stride_cz=c.stride(0), stride_cm=c.stride(1), stride_cn=c.stride(2),
           seqlen=n, d_in=d_in, d_out=d_out, alpha=float(alpha),
           BLOCK_M=block_m, BLOCK_C=block_c, HEAD_DIM=padded_dim(d_in),
           DOT_DTYPE=dot_dtype(a.dtype))
    return c


def atb(name: str, tensors, a: torch.Tensor, b: torch.Tensor, *, block_m: int, block_c: int,
        alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a[z]^T b[z]`` per batch element, fp32 ``[Z, d_a, d_b]``
    (:func:`~.common._atb_kernel`)."""
    Z, n, d_a = a.shape
    d_b = b.shape[2]
    c = torch.empty(Z, d_a, d_b, dtype=torch.float32, device=a.device)
    launch(_atb_kernel, (triton_cdiv(d_b, block_c), Z), name, tensors, a.device,
           a_ptr=a, b_ptr=b, c_ptr=c,
           stride_az=a.stride(0), stride_am=a.stride(1), stride_ad=a.stride(2),
           stride_bz=b.stride(0), stride_bm=b.stride(1), stride_bd=b.stride(2),
           stride_cz=c.stride(0), stride_ck=c.stride(1), stride_cn=c.stride(2),
           seqlen=n, d_a=d_a, d_b=d_b, alpha=float(alpha),
           BLOCK_M=block_m, BLOCK_C=block_c, HEAD_DIM=padded_dim(d_a),
           DOT_DTYPE=dot_dtype(a.dtype))
    return c


def delta(name: str, o: torch.Tensor, do: torch.Tensor, *, block_m: int) -> torch.Tensor:
    """``v = (O o dO) 1``, fp32 ``[Z, n]`` (:func:`~.common._delta_kernel`)."""
    Z, n, d = o.shape
    v = torch.empty(Z, n, dtype=torch.float32, device=o.device)
    launch(_delta_kernel, (triton_cdiv(n, block_m), Z), name, DELTA_TENSORS, o.device,
           o_ptr=o, do_ptr=do, v_ptr=v,
           stride_oz=o.stride(0), stride_om=o.stride(1), stride_od=o.stride(2),
           stride_dz=do.stride(0), stride_dm=do.stride(1), stride_dd=do.stride(2),
           seqlen=n, head_dim=d, BLOCK_M=block_m, HEAD_DIM=padded_dim(d))
    return v


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def finish(inp: DenseInputs, dX, dY, dA1, dA2, dA3) -> DenseGrads:
    """Sum the fp32 ``d x d`` partials, cast, and restore the leading dims."""
    dtype = inp.a1.dtype
    shape = inp.batch_shape + (inp.n, inp.d)
    d = inp.d
    return DenseGrads(dX.reshape(-1, d, d).sum(0).to(dtype), dY.reshape(-1, d, d).sum(0).to(dtype),
                      dA1.reshape(shape), dA2.reshape(shape), dA3.reshape(shape))
