"""The paper's dense attention form and its two regime-specific backward kernels.

``O = D^-1 exp(scale * A1 X A2^T) A3 Y`` (Definition 3.1; ``f`` is the normalized softmax,
computed with the row maximum subtracted; ``scale`` = 1.0 as in the paper, ``1/sqrt(d)`` available)
for ``A1, A2, A3 [..., n, d]`` and ``X, Y [d, d]``.

* :func:`forward` -> ``(O, lse)``; :func:`attention`: differentiable (autograd Function).
* :func:`backward_small_cache`: Algorithm 6 (phases 1-4, ``B x B`` tiles, ``B = sqrt(M/4)``).
* :func:`backward_large_cache`: Algorithm 9 (Algorithms 7-8), ``variant="faithful"|"fa2"``.
* :func:`forward`: the large-cache (FlashAttention order) or the small-cache (Saha & Ye) forward.
* :func:`backward`: ``regime="auto"`` runs the feasible kernel with the fewest predicted bytes
  (:func:`choose_backward`, :func:`choose_forward`); :func:`choose_regime` is the paper's
  asymptotic split ``M < d^2``.
* :mod:`.traffic`: the exact traffic model of every kernel (``TrafficReport(source="predicted")``).

Kernels run on CUDA, or on CPU through Triton's interpreter (slow; for tests and counting).
Importing this package does not import Triton: the kernel entry points (:func:`forward`, the two
backward kernels, :class:`DenseGrads`, and :func:`attention`, :func:`backward`,
:func:`backward_choice` that call them) load on first access, so the traffic model, the regime
choice and the tile rules serve ``bounds`` and ``accounting`` without the kernels.
"""
import importlib

from sparse_io_attn.dense.regime import KernelChoice, choose_backward, choose_forward, choose_regime, default_M
from sparse_io_attn.dense.tiles import large_cache_blocks, min_large_cache_M, small_cache_block, working_set_words

#: name -> the module that defines it, imported on first access (it imports the Triton kernels)
_KERNEL_ENTRY_POINTS = {
    "forward": "triton.launch_forward", "backward_small_cache": "triton.launch_small_cache",
    "backward_large_cache": "triton.launch_large_cache", "DenseGrads": "triton.launch",
    "attention": "api", "backward": "api", "backward_choice": "api",
}


def __getattr__(name):
    if name in _KERNEL_ENTRY_POINTS:
        value = getattr(importlib.import_module(f"{__name__}.{_KERNEL_ENTRY_POINTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_KERNEL_ENTRY_POINTS))


__all__ = ["forward", "backward", "backward_small_cache", "backward_large_cache", "attention",
           "DenseGrads", "choose_regime", "choose_backward", "choose_forward", "backward_choice", "KernelChoice",
           "default_M", "small_cache_block", "large_cache_blocks",
           "min_large_cache_M", "working_set_words"]
