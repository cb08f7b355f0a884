"""The paper's Figure 1: backward traffic against the fast memory ``M`` at fixed ``n, d``, for the
small-cache algorithm (Algorithm 6) and the large-cache algorithm (Algorithm 9, as written and in
the FlashAttention-2 loop order), from three sources:

* the dense kernels' exact traffic model (:mod:`sparse_io_attn.dense.traffic`; bytes, equal to the
  kernels' counters),
* the dense kernels' own ``COUNT_IO`` counters (:func:`kernel_counted_bytes`; Triton's interpreter
  on a CPU, so small ``n`` only),
* the two-level-memory executor's closed forms and runs (:mod:`sparse_io_attn.experiments.pebble`;
  words, independent of the machine).

This package is the one implementation of the analysis (:mod:`.kernels`: the kernel model and
counters; :mod:`.executor`: the closed forms and runs; :mod:`.summary`: one ``(n, d)``'s numbers;
:mod:`.sweeps`: the sweep tables; :mod:`.common`: kinds and bisection); ``sparse-io-attn sweep cache|dim``,
``benchmarks/dense_figure1.py`` and ``benchmarks/pebble_figure1.py`` only format its results.
Log-log slopes come from :func:`sparse_io_attn.experiments.slopes.loglog_slope`.

Algorithms are named by ``kind``: ``"small"``, ``"large_faithful"``, ``"large_fa2"`` (:data:`KINDS`).

Kernel traffic model (:func:`sweep`, :func:`summarize`). Per ``M``, the bytes each backward moves:

* ``small``: the small-cache kernels (Algorithm 6), ``B = sqrt(M/4)``.
* ``faithful``: the large-cache kernels as the paper writes them (Algorithm 9), where they fit.
* ``fa2``: the FlashAttention-2-style large-cache variant (dQ then ``g = A1^T dQ``) with tiles sized
  for ``M``; ``fa2_model`` extends its schedule below the 16-row tiles ``tl.dot`` needs (model only)
  so it can be set against the small-cache kernel over the whole small-cache range.

``g path`` columns count only the kernels that compute ``dX = g`` (the paper's quantity); ``all``
columns the full backward (all five gradients). Two derived quantities isolate the ``M``-dependent
traffic the bounds are about:

* :func:`small_tiled_reads`: the small-cache traffic less its ``M``-independent part (every write,
  and the element-wise sweeps over ``f, q`` in phases 1 and 3): the operand reads of the tiled
  products, which fall as ``1/B ~ M^(-1/2)``.
* :func:`reread_bytes`: bytes read beyond one pass over each tensor per kernel (the re-reads a larger
  ``M`` saves), used for the large-cache kernels.

Crossings (:func:`kernel_crossing`, :func:`executor_crossing`, :func:`crossings`): the smallest ``M``
from which a large-cache backward moves no more than the small-cache one, by bisection on the exact
model over integer ``M`` -- for the kernels with the tiles they can run (``>= 16``, powers of two;
a kernel that cannot tile ``M`` does not win there), for the algorithms as the paper writes them
(executor closed forms, any integer tile), and, for the record, for the FA2 schedule with tiles
below 16 (``min_block=1``, a model-only extension the kernels cannot run). Bisection assumes one
crossing; each result says whether a geometric grid (kernels) or every integer ``M`` (closed
forms) agrees, and the closed forms also give the ``M`` from which the large-cache algorithm wins
at every integer ``M`` up to ``4d^2`` (``always_from_M``).

Forward (Table 1, Saha & Ye): :func:`cache_rows` also carries the small-cache forward (executor
closed form and kernel model) and the large-cache forward (kernel model), and
:func:`cache_findings` their ``M^(-1/2)`` slope.

The ``sweep cache`` / ``sweep dim`` tables (:func:`cache_rows`, :func:`cache_findings`,
:func:`threshold_rows`, :func:`threshold_findings`) put all three sources side by side in words
(kernel fp32 bytes / 4, ``g`` path). The executor report (:func:`executor_table`,
:func:`executor_summary`, :func:`equal_capacity_crossover`) works on the closed forms alone.
"""
from sparse_io_attn.experiments.figure1.common import KINDS, bisect_crossing
from sparse_io_attn.experiments.figure1.kernels import (tensor_bytes, small_tiled_reads, reread_bytes, kernel_traffic,
                                                        kernel_bytes, kernel_counted_bytes, sweep, kernel_crossing,
                                                        kernel_forward_traffic, small_forward_tiled_reads,
                                                        kernel_forward_counted_bytes)
from sparse_io_attn.experiments.figure1.executor import (executor_crossing, executor_words, executor_run_words,
                                                         executor_points, executor_table, executor_summary,
                                                         equal_capacity_crossover)
from sparse_io_attn.experiments.figure1.summary import summarize, crossings, crossing_lines
from sparse_io_attn.experiments.figure1.sweeps import (m_grid, cache_grid, counted_points, cache_rows, slope_between,
                                                       crossover, cache_findings, THRESHOLD_GRID, threshold_rows,
                                                       compare_small_large, threshold_findings)

__all__ = ["KINDS", "tensor_bytes", "small_tiled_reads", "reread_bytes", "kernel_traffic", "kernel_bytes",
           "kernel_counted_bytes", "sweep", "summarize", "bisect_crossing", "kernel_crossing",
           "executor_crossing", "crossings", "crossing_lines", "kernel_forward_traffic",
           "small_forward_tiled_reads", "kernel_forward_counted_bytes", "executor_words",
           "executor_run_words", "executor_points", "executor_table", "executor_summary",
           "equal_capacity_crossover", "m_grid", "cache_grid", "counted_points", "cache_rows",
           "slope_between", "crossover", "cache_findings", "THRESHOLD_GRID", "threshold_rows",
           "compare_small_large", "threshold_findings"]
