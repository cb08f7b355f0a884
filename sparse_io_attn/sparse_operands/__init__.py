"""The paper's attention with block-sparse operands: ``softmax(A1 X A2^T * scale) A3 Y`` where every
operand may be a :class:`~sparse_io_attn.BlockSparseMatrix` (Section 4.3 / Appendix F of the
paper), for one head or batched: ``A [B, n, d]`` dense or a list of ``B`` matrices (a block pattern
per batch element), per-head ``X``/``Y`` (``[H, ...]`` dense or a list of per-head matrices), output
``[B, H, nq, dv]``, every group in one launch per kernel.

* :func:`attention` — the public, differentiable function (backends ``"torch"`` / ``"triton"``).
* :func:`predict_traffic` — the exact traffic model of the Triton kernels (``TrafficReport``),
  summed over the ``(batch element, head)`` groups; :func:`predict_traffic_per_head` per group.
* :func:`predict_dot_macs` — the exact model of the ``tl.dot`` multiply-adds of the attention
  kernels (head-dim tiles absent from either operand are skipped: no load, no FLOPs).
* :func:`kernel_fast_memory_words` — the kernels' largest per-program working set (words).

Modules: ``api.py`` (the public function and its autograd Function), ``batch.py`` (the batched
form: which operand varies along which axis), ``operands.py`` (validation and tile addressing),
``plan.py`` (symbolic product and score plans, one per distinct pattern), ``problem.py`` (one call's
structure), ``torch_path.py`` (backend ``"torch"``), ``reference.py`` (float64 reference),
``traffic.py`` and ``flops.py`` (exact models), ``triton/`` (backend ``"triton"``).
"""
from sparse_io_attn.sparse_operands.api import attention
from sparse_io_attn.sparse_operands.flops import predict_dot_macs
from sparse_io_attn.sparse_operands.traffic import kernel_fast_memory_words, predict_traffic, predict_traffic_per_head

__all__ = ["attention", "predict_traffic", "predict_traffic_per_head", "predict_dot_macs", "kernel_fast_memory_words"]
