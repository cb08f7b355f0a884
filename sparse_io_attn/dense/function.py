"""``backward`` (regime dispatch) and ``attention`` (the differentiable autograd Function)."""
from __future__ import annotations

import torch

from sparse_io_attn.dense.launch import DenseGrads
from sparse_io_attn.dense.forward import forward
from sparse_io_attn.dense.large_cache import backward_large_cache
from sparse_io_attn.dense.regime import choose_regime, default_M
from sparse_io_attn.dense.small_cache import backward_small_cache


def backward(A1, A2, A3, X, Y, dO, O=None, lse=None, *, M: int | None = None, regime: str = "auto",
             scale: float = 1.0, variant: str = "faithful", num_splits: int = 1) -> DenseGrads:
    """All five gradients ``(dX, dY, dA1, dA2, dA3)`` by the regime's kernel.

    ``regime="auto"`` runs the small-cache kernel (Algorithm 6) when ``M < d^2`` and the large-cache
    kernel (Algorithm 9, ``variant``) otherwise (see :func:`~.regime.choose_regime`); ``"small"`` /
    ``"large"`` force one. ``M`` (words) defaults to :func:`~.regime.default_M`. The large-cache
    kernel needs the forward's ``O`` and ``lse``; when they are not given, :func:`forward` computes
    them first.
    """
    d = A1.shape[-1] if isinstance(A1, torch.Tensor) else None
    if M is None:
        M = default_M(A1.dtype, A1.device)
    chosen = choose_regime(d, M, regime, variant)
    if chosen == "small":
        return backward_small_cache(A1, A2, A3, X, Y, dO, M=M, scale=scale)
    if (O is None) != (lse is None):
        raise ValueError("pass both O and lse from the forward, or neither")
    if O is None:
        O, lse = forward(A1, A2, A3, X, Y, scale=scale, M=M)
    return backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, scale=scale, variant=variant,
                                num_splits=num_splits)


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A1, A2, A3, X, Y, M, regime, scale, variant):
        O, lse = forward(A1, A2, A3, X, Y, scale=scale, M=M)
        ctx.save_for_backward(A1, A2, A3, X, Y, O, lse)
        ctx.M, ctx.regime, ctx.scale, ctx.variant = M, regime, scale, variant
        return O

    @staticmethod
    def backward(ctx, dO):
        A1, A2, A3, X, Y, O, lse = ctx.saved_tensors
        g = backward(A1, A2, A3, X, Y, dO.contiguous(), O, lse, M=ctx.M, regime=ctx.regime,
                     scale=ctx.scale, variant=ctx.variant)
        return g.dA1, g.dA2, g.dA3, g.dX, g.dY, None, None, None, None


def attention(A1, A2, A3, X, Y, *, M: int | None = None, regime: str = "auto", scale: float = 1.0,
              variant: str = "faithful") -> torch.Tensor:
    """Differentiable ``O = softmax(scale * A1 X A2^T) A3 Y`` (the paper's Definition 3.1).

    Forward: :func:`forward`. Backward: the small-cache (Algorithm 6) or large-cache (Algorithm 9)
    Triton kernel, chosen by ``regime`` and ``M`` as in :func:`backward`. Gradients flow to
    ``A1, A2, A3, X, Y``.

    Example::

        O = dense.attention(A1, A2, A3, X, Y, scale=d ** -0.5)   # A*: [B, H, n, d], X, Y: [d, d]
        O.square().sum().backward()                              # X.grad is the paper's g
    """
    if M is None:
        M = default_M(A1.dtype, A1.device)
    choose_regime(A1.shape[-1], M, regime, variant)  # validate before the forward runs
    return _DenseAttention.apply(A1, A2, A3, X, Y, M, regime, float(scale), variant)
