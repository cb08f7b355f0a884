"""``backward`` (kernel dispatch) and ``attention`` (the differentiable autograd Function)."""
from __future__ import annotations

import torch

from sparse_io_attn.dense.triton.launch_forward import forward
from sparse_io_attn.dense.triton.launch_large_cache import backward_large_cache
from sparse_io_attn.dense.triton.launch import DenseGrads
from sparse_io_attn.dense.regime import REGIMES, choose_backward, default_M
from sparse_io_attn.dense.buffers import free_memory_bytes
from sparse_io_attn.dense.triton.launch_small_cache import backward_small_cache


def backward_choice(A1, dO=None, O=None, *, M: int | None = None, regime: str = "auto", variant: str | None = None,
                    num_splits: int = 1):
    """The :class:`~.regime.KernelChoice` :func:`backward` makes for these inputs (``A1`` gives
    ``n, d``, the batch, dtype and device; ``O``: whether the forward's outputs are given)."""
    if not isinstance(A1, torch.Tensor) or A1.dim() < 2:
        raise TypeError("A1 must be a torch.Tensor [..., n, d]")
    n, d = A1.shape[-2], A1.shape[-1]
    batch = A1.numel() // max(1, n * d) if n * d else 0
    if M is None:
        M = default_M(A1.dtype, A1.device)
    memory = free_memory_bytes(A1.device)[0] if regime == "auto" else None
    return choose_backward(n, d, M, dtype=A1.dtype, batch=max(1, batch), regime=regime, variant=variant,
                           num_splits=num_splits, memory_bytes=memory, with_forward=O is None)


def backward(A1, A2, A3, X, Y, dO, O=None, lse=None, *, M: int | None = None, regime: str = "auto",
             scale: float = 1.0, variant: str | None = None, num_splits: int = 1) -> DenseGrads:
    """All five gradients ``(dX, dY, dA1, dA2, dA3)`` by the chosen kernel.

    ``regime="auto"`` runs, among the feasible kernels (tiles fit ``M``; the small-cache kernel's
    ``n x n`` buffers fit the free memory), the one with the fewest predicted bytes for these
    ``(n, d, M, dtype)``: Algorithm 6 (small cache), Algorithm 9 as written or in FlashAttention-2
    order (``variant`` restricts the large-cache candidates to one) -- see
    :func:`~.regime.choose_backward` and :func:`backward_choice`. When ``O``/``lse`` are not given
    the large-cache kernels are charged for the forward they need. ``"small"`` / ``"large"`` force
    a family (``"large"``: ``variant`` or ``"faithful"``). The paper's asymptotic split
    (``M < d^2``) is :func:`~.regime.choose_regime`. ``M`` (words) defaults to
    :func:`~.regime.default_M`. The large-cache kernel needs the forward's ``O`` and ``lse``; when
    they are not given, :func:`forward` computes them first.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if (O is None) != (lse is None):
        raise ValueError("pass both O and lse from the forward, or neither")
    if M is None:
        M = default_M(A1.dtype, A1.device)
    choice = backward_choice(A1, dO, O, M=M, regime=regime, variant=variant, num_splits=num_splits)
    if choice.kernel == "small":
        return backward_small_cache(A1, A2, A3, X, Y, dO, M=M, scale=scale)
    if O is None:
        try:
            O, lse = forward(A1, A2, A3, X, Y, scale=scale, M=M)
        except ValueError:  # no forward kernel fits M: 16 x 16 tiles (more than M words)
            O, lse = forward(A1, A2, A3, X, Y, scale=scale, M=M, regime="large")
    return backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, scale=scale, variant=choice.variant,
                                num_splits=num_splits)


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A1, A2, A3, X, Y, M, regime, scale, variant):
        O, lse = _forward_for(A1, A2, A3, X, Y, scale, M, regime)
        ctx.save_for_backward(A1, A2, A3, X, Y, O, lse)
        ctx.M, ctx.regime, ctx.scale, ctx.variant = M, regime, scale, variant
        return O

    @staticmethod
    def backward(ctx, dO):
        A1, A2, A3, X, Y, O, lse = ctx.saved_tensors
        g = backward(A1, A2, A3, X, Y, dO.contiguous(), O, lse, M=ctx.M, regime=ctx.regime,
                     scale=ctx.scale, variant=ctx.variant)
        return g.dA1, g.dA2, g.dA3, g.dX, g.dY, None, None, None, None


def _forward_for(A1, A2, A3, X, Y, scale, M, regime):
    """The forward of :func:`attention`: ``regime`` picks it too (auto: fewest predicted bytes,
    falling back to the ``16 x 16``-tile large-cache forward when no forward kernel fits ``M``)."""
    if regime == "auto":
        try:
            return forward(A1, A2, A3, X, Y, scale=scale, M=M)
        except ValueError as e:
            if "no forward kernel fits" not in str(e):
                raise
    return forward(A1, A2, A3, X, Y, scale=scale, M=M, regime=regime if regime != "auto" else "large")


def attention(A1, A2, A3, X, Y, *, M: int | None = None, regime: str = "auto", scale: float = 1.0,
              variant: str | None = None) -> torch.Tensor:
    """Differentiable ``O = softmax(scale * A1 X A2^T) A3 Y`` (the paper's Definition 3.1).

    Forward: :func:`forward` (``regime`` as there: ``"auto"`` picks the small-cache or the
    large-cache forward by predicted bytes). Backward: the kernel :func:`backward` picks with the
    same ``regime`` and ``M`` (Algorithm 6, Algorithm 9 as written or in FA2 order). Gradients flow
    to ``A1, A2, A3, X, Y``.

    Example::

        O = dense.attention(A1, A2, A3, X, Y, scale=d ** -0.5)   # A*: [B, H, n, d], X, Y: [d, d]
        O.square().sum().backward()                              # X.grad is the paper's g
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if variant not in (None, "faithful", "fa2"):
        raise ValueError(f"variant must be 'faithful', 'fa2' or None, got {variant!r}")
    if M is None:
        M = default_M(A1.dtype, A1.device)
    return _DenseAttention.apply(A1, A2, A3, X, Y, M, regime, float(scale), variant)
