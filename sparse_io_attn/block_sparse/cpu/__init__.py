"""Backend ``"cpu"``: fused block-sparse flash attention in C++ (forward and deterministic backward).

Implements the backend interface of :mod:`sparse_io_attn.block_sparse.api`:

* ``forward(q, k, v, plan, *, sm_scale) -> (out, lse, stats)``
* ``backward(do, q, k, v, out, stats, plan, *, sm_scale) -> (dq, dk, dv)``

with the semantics of the other backends (element-exact partial blocks, both causal alignments,
GQA, per-head/per-batch layouts, empty rows -> output 0, lse ``-inf``, zero gradients).

How it works (``kernel.cpp``: op registration, including the shared ``_cpu/`` headers (``simd.h`` vector
helpers, ``tiles.h`` buffers/packing/tile products, ``softmax.h``, ``entry.h``, ``split_k.h``),
``schedule.h`` the problem and the checked schedule lists, ``forward.h``, ``backward.h``, ``decode.h``; one
translation unit):

* It walks the lists of an :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan`:
  forward and dQ run one task per (batch, query head, query tile of up to 128 rows: the layout's
  query block or an equal split of it) over the CSR lists, dK/dV one task per (batch, kv head, key
  tile of up to 128 keys) over the CSC lists of every query head of its GQA group. Full blocks run
  without any mask; partial blocks apply key/query padding, the causal test and the packed
  element-mask bits (AVX-512 mask blends). Blocks a row does not keep are never read.
* Flash-style: online softmax in base 2 (``exp2`` on ``t = (q.k) * sm_scale * log2(e)``, rounded to
  fp32 before the row maximum ``m`` of those same values is subtracted, so finite inputs give
  finite outputs at any logit size), fp32 statistics and accumulators; backward recomputes
  ``P = exp2((t - m) - log2 l)`` from the forward's ``stats`` with the same operations.
* The raw ops check the schedule's index ranges (pointers, block indices, mask ids) once per call
  before any work and raise ``RuntimeError`` on a corrupted schedule.
* Tile products are ``at::native::cpublas::brgemm`` calls on fp32 tiles (oneDNN's ukernel). fp16 and
  bf16 inputs are converted to fp32 once per call and the results rounded once at the end (without
  AMX the fp32 brgemm is the faster one, and it is the more accurate).
* Deterministic: every output element is produced by exactly one task summing in a fixed order
  (no atomics on data, dK/dV reduced over the GQA group inside its task), so results are bitwise
  identical across runs and thread counts. Threads come from ``at::parallel_for``
  (``torch.set_num_threads``).

The C++ source is compiled on first use (:mod:`sparse_io_attn._cpu.build`: ``torch.utils.cpp_extension.load``,
cached per checkout, Python environment, torch version and CPU kind). Without a compiler ``backend="auto"``
falls back to the torch path with one warning and ``backend="cpu"`` raises ``RuntimeError`` saying what is missing.
"""
from sparse_io_attn._cpu.build import available_for_auto, is_available, load, unavailable_reason
from sparse_io_attn._attention.cpu import decode_work_bytes
from sparse_io_attn._attention.tiles import DECODE_MAX_QUERIES
from sparse_io_attn.block_sparse.cpu._launch import backward, forward

__all__ = ["forward", "backward", "available_for_auto", "decode_work_bytes", "DECODE_MAX_QUERIES", "is_available",
           "load", "unavailable_reason"]
