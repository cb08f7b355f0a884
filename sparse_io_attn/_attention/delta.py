"""The backward's row term ``delta = rowsum(dO * O)`` from the forward's fp32 output.

In fp16/bf16 the output is rounded once to the input dtype; ``delta`` formed from that rounded ``O``
carries its rounding (``2^-9`` relative in bf16) into every ``dS = P (dP - delta)``, which is what
put bf16 ``dq`` 3-7e-2 off the float64 gradient on native-sparse-attention's test data. The
forward therefore also returns, when a gradient will be needed, the rounding residual ``r = fl(O32 -
fl(O32))`` in the input dtype (:func:`rounding_residual`); the backward forms ``delta = rowsum(dO *
(O + r))`` in fp32 (:func:`row_delta`), ``O + r`` equal to the fp32 output to ``2^-17`` relative in
bf16. fp32 inputs need no residual.
"""
from __future__ import annotations

import torch


def rounding_residual(out32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``fl(out32 - fl(out32))`` in ``dtype`` (None for float32 outputs: nothing is rounded)."""
    if dtype == torch.float32:
        return None
    return (out32 - out32.to(dtype).to(torch.float32)).to(dtype)


def residual_made(dtype: torch.dtype, residual: bool) -> bool:
    """Whether a forward asked for the residual (``residual``) writes one: only a 16-bit output is rounded."""
    return residual and dtype != torch.float32


def wants_residual(dtype: torch.dtype, *inputs) -> bool:
    """Whether a forward should return the rounding residual: a low-precision call some input of
    which (q, k, v, sinks) requires a gradient with grad mode on."""
    return (dtype != torch.float32 and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in inputs))


def row_delta(do: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[B, Hq, Nq]``: ``rowsum(dO * (O + r))`` (``r`` the forward's residual or None)."""
    o = out.to(torch.float32)
    if residual is not None and residual.numel():
        o = o + residual.to(torch.float32)
    return torch.linalg.vecdot(do.to(torch.float32), o)


__all__ = ["residual_made", "rounding_residual", "row_delta", "wants_residual"]
