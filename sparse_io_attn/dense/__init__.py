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
"""
from sparse_io_attn.dense.triton.launch import DenseGrads
from sparse_io_attn.dense.triton.launch_forward import forward
from sparse_io_attn.dense.api import attention, backward, backward_choice
from sparse_io_attn.dense.triton.launch_large_cache import backward_large_cache
from sparse_io_attn.dense.regime import KernelChoice, choose_backward, choose_forward, choose_regime, default_M
from sparse_io_attn.dense.triton.launch_small_cache import backward_small_cache
from sparse_io_attn.dense.tiles import large_cache_blocks, min_large_cache_M, small_cache_block, working_set_words

__all__ = ["forward", "backward", "backward_small_cache", "backward_large_cache", "attention",
           "DenseGrads", "choose_regime", "choose_backward", "choose_forward", "backward_choice", "KernelChoice",
           "default_M", "small_cache_block", "large_cache_blocks",
           "min_large_cache_M", "working_set_words"]
