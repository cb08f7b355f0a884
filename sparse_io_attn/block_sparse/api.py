"""`block_sparse_attention`: the public entry point, its autograd Function and input checks.

Backends share one interface (inputs already validated):

* ``forward(q, k, v, layout, *, causal_offset, sm_scale) -> (out, lse, stats)``
* ``backward(do, q, k, v, out, stats, layout, *, causal_offset, sm_scale) -> (dq, dk, dv)``

``stats`` (fp32 ``[2, B, Hq, Nq]``: each row's base-2 score maximum and log2 of its sum) is what
backward needs to recompute the probabilities exactly as the forward did.

``causal_offset`` is ``None`` (no causal mask) or ``delta``: key ``j`` is allowed for query ``i``
only if ``j <= i + delta`` (:func:`causal_offset`).

``"cpu"`` is :mod:`sparse_io_attn.block_sparse.cpu` (the fused C++ kernel, compiled on first use; the
fastest on CPU); ``"torch"`` is :mod:`sparse_io_attn.block_sparse.torch_path` (plain PyTorch, any
device: the portable fallback); ``"triton"`` is :mod:`sparse_io_attn.block_sparse.triton.launch`
(compiled on CUDA, Triton's interpreter on CPU: slow, counts I/O).
"""
from __future__ import annotations

import importlib
import math

import torch

from sparse_io_attn.layout.core import BlockSparseLayout

BACKENDS = ("auto", "torch", "triton", "cpu")
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKEND_MODULES = {"torch": "sparse_io_attn.block_sparse.torch_path", "triton": "sparse_io_attn.block_sparse.triton.launch",
                    "cpu": "sparse_io_attn.block_sparse.cpu"}


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA; on CPU ``"cpu"`` (the fused C++ kernel, built on first use)
    when it can be built, else ``"torch"`` (with one warning); ``"torch"`` on other devices. Other
    names are checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu":
            from sparse_io_attn.block_sparse.cpu._build import available_for_auto
            return "cpu" if available_for_auto() else "torch"
        return "torch"
    return backend


def backend_module(name: str):
    return importlib.import_module(_BACKEND_MODULES[name])


CAUSAL_MODES = (False, True, "top_left", "bottom_right")


def causal_offset(causal, seqlen_q: int, seqlen_k: int) -> int | None:
    """``causal`` -> the offset ``delta`` of the causal mask ``j <= i + delta``, or ``None``.

    ``False``: no causal mask. ``True`` or ``"top_left"``: ``delta = 0`` (query ``i`` sees keys
    ``0..i``, like ``scaled_dot_product_attention(is_causal=True)``). ``"bottom_right"``:
    ``delta = seqlen_k - seqlen_q`` (the last query sees every key; FlashAttention-2's convention
    for ``seqlen_q != seqlen_k``, what decoding with a KV cache and chunked prefill need).
    """
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return 0
    if causal == "bottom_right":
        return int(seqlen_k) - int(seqlen_q)
    raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                 sm_scale: float | None) -> float:
    """Validate shapes, dtypes, devices and the layout; return the resolved ``sm_scale``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, seqlen, head_dim], got {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not isinstance(layout, BlockSparseLayout):
        raise TypeError(f"layout must be a BlockSparseLayout (see sparse_io_attn.layout.patterns), "
                        f"got {type(layout).__name__}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    for what, size in (("batch", B), ("num_heads_q", Hq), ("head_dim", D)):
        if size == 0:
            raise ValueError(f"q has {what} 0 (shape {tuple(q.shape)}); block_sparse_attention needs "
                             f"at least one batch element, query head and head-dim channel")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q has batch {B} and k has batch {Bk}; they must match")
    if Dk != D:
        raise ValueError(f"q has head_dim {D} and k/v have {Dk}; they must match")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads and k has {Hkv}; num_heads_q must be a multiple of "
                         f"num_heads_kv (GQA/MQA)")
    if (Nq, Nk) != layout.seqlen:
        raise ValueError(f"layout was built for seqlen (q, k) = {layout.seqlen} but the inputs have "
                         f"({Nq}, {Nk}); build the layout with seqlen=({Nq}, {Nk})")
    layout.broadcast_strides(B, Hq)
    layout.check()   # index ranges, once per layout: no kernel may read outside its tensors
    if sm_scale is None:
        return D ** -0.5
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite number, got {sm_scale}; leave it None for "
                         f"head_dim ** -0.5")
    return float(sm_scale)


def _no_double_backward(where: str) -> None:
    """Backward runs with grad mode on only under ``create_graph=True`` (double backward)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{where}: double backward (torch.autograd.grad(..., create_graph=True) through block-sparse "
            f"attention) is not supported: the backward kernels are not differentiable. Compute the "
            f"gradient penalty without create_graph, or use dense attention for that term")


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, delta, sm_scale, backend):
        impl = backend_module(backend)
        out, lse, stats = impl.forward(q, k, v, layout, causal_offset=delta, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.layout, ctx.delta, ctx.sm_scale, ctx.backend = layout, delta, sm_scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        _no_double_backward("block_sparse_attention")
        q, k, v, out, stats = ctx.saved_tensors
        impl = backend_module(ctx.backend)
        dq, dk, dv = impl.backward(do, q, k, v, out, stats, ctx.layout, causal_offset=ctx.delta,
                                   sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None, None, None


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                           *, causal=False, sm_scale: float | None = None,
                           return_lse: bool = False, backend: str = "auto"):
    """Block-sparse scaled dot-product attention.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query
            head ``h`` reads kv head ``h // (Hq // Hkv)``). float32, float16 or bfloat16.
        layout: a :class:`BlockSparseLayout` with ``seqlen == (Nq, Nk)``; its masks are shared or
            per (batch, query head). The layout is the mask: full blocks and element-masked
            partial blocks, exactly the elements it allows are attended.
        causal: intersect the layout with a causal mask: ``True`` or ``"top_left"`` (key ``j``
            allowed for query ``i`` iff ``j <= i``, like ``scaled_dot_product_attention(
            is_causal=True)``), ``"bottom_right"`` (iff ``j <= i + Nk - Nq``: KV-cache decoding,
            chunked prefill), ``False`` (default; a layout built with ``causal=True`` carries its
            causality already).
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the row log-sum-exp ``[B, Hq, Nq]`` (float32, natural log; not
            differentiable).
        backend: ``"auto"`` (triton on CUDA; cpu on CPU, or torch with one warning if the C++
            kernel cannot be built), ``"cpu"``, ``"torch"`` or ``"triton"``.

    Softmax runs over the allowed keys of each query row. A row with no allowed key gets output 0,
    lse ``-inf`` and zero gradients.
    """
    sm_scale = check_inputs(q, k, v, layout, sm_scale)
    delta = causal_offset(causal, q.shape[2], k.shape[2])
    name = resolve_backend(backend, q.device)
    layout = layout.to(q.device)
    out, lse = _BlockSparseAttention.apply(q, k, v, layout, delta, sm_scale, name)
    return (out, lse) if return_lse else out
