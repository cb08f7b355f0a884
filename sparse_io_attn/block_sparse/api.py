"""`block_sparse_attention`: the public entry point, its autograd Function, the one prologue (input
checks, causal offset, backend choice, layout strides) it shares with the custom op
(:mod:`sparse_io_attn.nn.ops`), and the backend registry.

Backends share one interface (inputs already validated):

* ``forward(q, k, v, layout, *, causal_offset, sm_scale, layout_strides) -> (out, lse, stats)``
* ``backward(do, q, k, v, out, stats, layout, *, causal_offset, sm_scale, layout_strides) -> (dq, dk, dv)``

``layout_strides`` is ``(stride_lb, stride_lh)``: batch ``b``, query head ``h`` use the layout's
mask ``b * stride_lb + h * stride_lh`` (:meth:`BlockSparseLayout.broadcast_strides`, decided once
by :func:`prologue`, the one prologue of both entry points).

``stats`` (fp32 ``[2, B, Hq, Nq]``: each row's base-2 score maximum and log2 of its sum) is what
backward needs to recompute the probabilities exactly as the forward did.

``causal_offset`` is ``None`` (no causal mask) or ``delta``: key ``j`` is allowed for query ``i``
only if ``j <= i + delta`` (:func:`sparse_io_attn.layout.causal.causal_offset`, re-exported here).

``"cpu"`` is :mod:`sparse_io_attn.block_sparse.cpu` (the fused C++ kernel, compiled on first use; the
fastest on CPU); ``"torch"`` is :mod:`sparse_io_attn.block_sparse.torch_path` (plain PyTorch, any
device: the portable fallback); ``"triton"`` is :mod:`sparse_io_attn.block_sparse.triton.launch`
(compiled on CUDA, Triton's interpreter on CPU: slow, counts I/O).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from sparse_io_attn.block_sparse import torch_path
from sparse_io_attn.layout.causal import CAUSAL_MODES, causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout

BACKENDS = ("auto", "torch", "triton", "cpu")
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(backend: str, device: torch.device, *, supported: tuple[str, ...] = ("torch", "triton", "cpu")) -> str:
    """The backend ``backend`` names for tensors on ``device``, among the ``supported`` ones of an op.

    ``"auto"`` -> ``"triton"`` on CUDA; on CPU ``"cpu"`` (the fused C++ kernel, built on first use)
    when the op has it and it can be built (else ``"torch"``, with one warning); ``"torch"``
    elsewhere. An op without ``"cpu"`` (``supported=("torch", "triton")``) gets ``"torch"`` on CPU.
    Any other name must be one of ``supported``.
    """
    if backend == "auto":
        if device.type == "cuda" and "triton" in supported:
            return "triton"
        if device.type == "cpu" and "cpu" in supported and _cpu_backend().available_for_auto():
            return "cpu"
        return "torch"
    if backend not in supported:
        raise ValueError(f"backend must be one of {('auto',) + tuple(supported)}, got {backend!r}")
    return backend


def _cpu_backend():
    """Backend ``"cpu"``, imported on first use: its build module marks ``available_for_auto`` as a
    constant for ``torch.compile``, which imports ``torch._dynamo`` (and with it Triton)."""
    from sparse_io_attn.block_sparse import cpu
    return cpu


def _triton_backend():
    """Backend ``"triton"``, imported on first use (importing Triton is slow and optional)."""
    from sparse_io_attn.block_sparse.triton import launch
    return launch


def backend_module(name: str):
    """The module implementing backend ``name`` (``forward``/``backward`` of the interface above)."""
    if name == "triton":
        return _triton_backend()
    if name == "cpu":
        return _cpu_backend()
    return torch_path


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                 sm_scale: float | None) -> float:
    """Validate shapes, dtypes, devices and the layout's index ranges; return the resolved
    ``sm_scale``. Whether the layout's masks broadcast over ``[batch, heads]`` is decided (and
    checked) once by :func:`prologue`, which hands the strides to the backends."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} has layout {t.layout}; block_sparse_attention takes dense (strided) "
                            f"tensors and the sparsity from `layout`: pass {name}.to_dense()")
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
    layout.check()   # index ranges, once per layout: no kernel may read outside its tensors
    return _resolve_sm_scale(sm_scale, D)


def _resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """``head_dim ** -0.5`` for ``None``; else any finite real scalar (Python int/float, NumPy
    scalar, 0-d real tensor) as a Python float. Complex numbers, bools, strings, tensors that are
    not 0-d and real, and non-finite values are refused (``TypeError``/``ValueError``)."""
    if sm_scale is None:
        return head_dim ** -0.5
    value = sm_scale
    if isinstance(sm_scale, torch.Tensor):
        if sm_scale.dim() != 0 or sm_scale.dtype == torch.bool or sm_scale.is_complex():
            raise TypeError(f"sm_scale as a tensor must be 0-d and real, got shape {tuple(sm_scale.shape)} "
                            f"dtype {sm_scale.dtype}; pass a Python float")
        value = sm_scale.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"sm_scale must be a real number (int, float, NumPy scalar, 0-d tensor) or None, "
                        f"got {type(sm_scale).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"sm_scale must be a finite number, got {value}; leave it None for "
                         f"head_dim ** -0.5")
    return value


class Prologue(NamedTuple):
    """What both entry points (:func:`block_sparse_attention`, the custom op's
    :func:`sparse_io_attn.nn.ops.block_sparse_attention_op`) hand a backend, decided once per call."""
    layout: BlockSparseLayout            # on the inputs' device
    causal_offset: int | None            # delta of ``j <= i + delta``, or None
    sm_scale: float
    backend: str                         # "torch", "triton" or "cpu"
    layout_strides: tuple[int, int]      # (stride_lb, stride_lh): mask ``b * stride_lb + h * stride_lh``


def prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout, *, causal,
             sm_scale, backend: str) -> Prologue:
    """Validate the inputs (:func:`check_inputs`) and decide the causal offset, the backend, the
    layout's device copy and its broadcast strides: the one prologue of every entry point."""
    sm_scale = check_inputs(q, k, v, layout, sm_scale)
    layout = layout.for_query_heads(q.shape[1], k.shape[1])   # a per-KV-head selection serves its group
    layout_strides = layout.broadcast_strides(q.shape[0], q.shape[1])
    delta = causal_offset(causal, q.shape[2], k.shape[2])
    return Prologue(layout.to(q.device), delta, sm_scale, resolve_backend(backend, q.device), layout_strides)


def _no_double_backward(where: str) -> None:
    """Backward runs with grad mode on only under ``create_graph=True`` (double backward)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{where}: double backward (torch.autograd.grad(..., create_graph=True) through block-sparse "
            f"attention) is not supported: the backward kernels are not differentiable. Compute the "
            f"gradient penalty without create_graph, or use dense attention for that term")


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: Prologue):
        out, lse, stats = backend_module(call.backend).forward(
            q, k, v, call.layout, causal_offset=call.causal_offset, sm_scale=call.sm_scale,
            layout_strides=call.layout_strides)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        _no_double_backward("block_sparse_attention")
        q, k, v, out, stats = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv = backend_module(call.backend).backward(
            do, q, k, v, out, stats, call.layout, causal_offset=call.causal_offset, sm_scale=call.sm_scale,
            layout_strides=call.layout_strides)
        return dq, dk, dv, None


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                           *, causal=False, sm_scale: float | None = None,
                           return_lse: bool = False, backend: str = "auto"):
    """Block-sparse scaled dot-product attention.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query
            head ``h`` reads kv head ``h // (Hq // Hkv)``). float32, float16 or bfloat16.
        layout: a :class:`BlockSparseLayout` with ``seqlen == (Nq, Nk)``; its masks are shared or
            per batch, and shared, per query head or per KV head (``layout_heads == Hkv``: one mask
            for the query heads of each GQA group). The layout is the mask: full blocks and element-masked
            partial blocks, exactly the elements it allows are attended.
        causal: intersect the layout with a causal mask: ``True`` or ``"top_left"`` (key ``j``
            allowed for query ``i`` iff ``j <= i``, like ``scaled_dot_product_attention(
            is_causal=True)``), ``"bottom_right"`` (iff ``j <= i + Nk - Nq``: KV-cache decoding,
            chunked prefill), ``False`` (default; a layout built with ``causal=True`` carries its
            causality already).
        sm_scale: softmax scale, default ``D ** -0.5``: a finite real scalar (Python or NumPy
            number, 0-d real tensor).
        return_lse: also return the row log-sum-exp ``[B, Hq, Nq]`` (float32, natural log; not
            differentiable).
        backend: ``"auto"`` (triton on CUDA; cpu on CPU, or torch with one warning if the C++
            kernel cannot be built), ``"cpu"``, ``"torch"`` or ``"triton"``.

    Softmax runs over the allowed keys of each query row. A row with no allowed key gets output 0,
    lse ``-inf`` and zero gradients.
    """
    call = prologue(q, k, v, layout, causal=causal, sm_scale=sm_scale, backend=backend)
    out, lse = _BlockSparseAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


__all__ = ["BACKENDS", "CAUSAL_MODES", "Prologue", "backend_module", "block_sparse_attention", "causal_offset",
           "check_inputs", "prologue", "resolve_backend"]
