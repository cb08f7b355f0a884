"""The paper's attention with block-sparse operands: ``softmax(A1 X A2^T * scale) A3 Y`` where A1, X,
A2 may each be a :class:`~sparse_io_attn.BlockSparseMatrix` (Section 4.3 / Appendix F of the paper).

* :func:`attention` — the public, differentiable function (backends ``"torch"`` / ``"triton"``).
* :func:`predict_traffic` — the exact traffic model of the Triton kernels (``TrafficReport``).
* :func:`predict_dot_macs` — the exact model of the ``tl.dot`` multiply-adds of the attention
  kernels (head-dim tiles absent from either operand are skipped: no load, no FLOPs).
* :mod:`.stress` — the sparsity stress test against Theorem 4.5.
"""
from sparse_io_attn.sparse_operands.attention import attention
from sparse_io_attn.sparse_operands.flops import predict_dot_macs
from sparse_io_attn.sparse_operands.traffic import kernel_fast_memory_words, predict_traffic

__all__ = ["attention", "predict_traffic", "predict_dot_macs", "kernel_fast_memory_words"]
