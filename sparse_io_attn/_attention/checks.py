"""The checks and choices every attention call makes, defined once: the tensors
(:func:`check_tensors`), the softmax scale (:func:`resolve_sm_scale`) and the backend
(:func:`resolve_backend`, the one place ``"auto"`` is decided)."""
from __future__ import annotations

import math
import numbers

import torch

#: the backends of the attention ops (``"auto"`` resolves to one of the others)
BACKENDS = ("auto", "torch", "triton", "cpu")
#: the dtypes every backend takes (fp32 accumulation throughout)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(backend: str, device: torch.device, *, supported: tuple[str, ...] = ("torch", "triton", "cpu")) -> str:
    """The backend ``backend`` names for tensors on ``device``, among the ``supported`` ones of an op.

    ``"auto"`` -> ``"triton"`` on CUDA; on CPU ``"cpu"`` (the fused C++ kernels, built on first use)
    when the op has it and it can be built (else ``"torch"``, with one warning); ``"torch"``
    elsewhere. An op without ``"cpu"`` (``supported=("torch", "triton")``) gets ``"torch"`` on CPU.
    Any other name must be one of ``supported``.
    """
    if backend == "auto":
        if device.type == "cuda" and "triton" in supported:
            return "triton"
        if device.type == "cpu" and "cpu" in supported and _cpu_available():
            return "cpu"
        return "torch"
    if backend not in supported:
        raise ValueError(f"backend must be one of {('auto',) + tuple(supported)}, got {backend!r}")
    return backend


def _cpu_available() -> bool:
    """Whether the C++ kernels build (one extension holds every op's; imported on first use: the
    build module marks ``available_for_auto`` as a constant for ``torch.compile``, which imports
    ``torch._dynamo`` and Triton)."""
    from sparse_io_attn._cpu import build
    return build.available_for_auto()


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate q, k, v: types, layouts, shapes ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B,
    Hkv, Nk, Dv]`` (V's head dim free: MLA's 576/512), dtypes, devices, GQA heads, and no zero-size
    batch, head or head-dim axis (a sequence length may be 0)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} has layout {t.layout}; attention takes dense (strided) tensors and the "
                            f"sparsity from the layout or selection: pass {name}.to_dense()")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, seqlen, head_dim], got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    for what, size in (("batch", B), ("num_heads_q", Hq), ("head_dim", D)):
        if size == 0:
            raise ValueError(f"q has {what} 0 (shape {tuple(q.shape)}); attention needs at least one batch "
                             f"element, query head and head-dim channel")
    if v.shape[3] == 0:
        raise ValueError(f"v has head_dim 0 (shape {tuple(v.shape)}); attention needs at least one value channel")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for v's head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q has batch {B} and k has batch {Bk}; they must match")
    if Dk != D:
        raise ValueError(f"q has head_dim {D} and k has {Dk}; they must match (v's head dim may differ)")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads and k has {Hkv}; num_heads_q must be a multiple of "
                         f"num_heads_kv (GQA/MQA)")


def check_sinks(sinks, q: torch.Tensor) -> None:
    """``sinks``: ``None`` or one sink logit per query head, a floating tensor ``[Hq]`` on q's device
    (natural-log units, like the scaled scores ``sm_scale * q . k``; ``-inf``: no sink for that head).
    On CPU the values are read too: NaN or ``+inf`` is refused (on other devices reading them would
    synchronise; they are trusted)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor [num_heads_q] or None, got {type(sinks).__name__}")
    Hq = q.shape[1]
    if sinks.dim() != 1 or sinks.shape[0] != Hq:
        raise ValueError(f"sinks must have shape [num_heads_q] = [{Hq}] (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.dtype not in SUPPORTED_DTYPES and sinks.dtype != torch.float64:
        raise TypeError(f"sinks has dtype {sinks.dtype}; pass a floating tensor (float32, bfloat16, float16, float64)")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q on {q.device}; move it to q's device")
    if sinks.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = torch.isnan(sinks) | torch.isposinf(sinks)
        if bool(bad.any()):
            raise ValueError(f"sinks holds NaN or +inf at head {int(bad.to(torch.uint8).argmax())}; a sink is a "
                             f"finite logit, or -inf for none")


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
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


__all__ = ["BACKENDS", "SUPPORTED_DTYPES", "check_sinks", "check_tensors", "resolve_backend", "resolve_sm_scale"]
