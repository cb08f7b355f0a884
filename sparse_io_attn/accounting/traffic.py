"""One facade over the library's exact traffic models (each lives beside its kernels).

* Block-sparse attention (:mod:`sparse_io_attn.block_sparse.traffic`): :func:`block_sparse`,
  :func:`block_sparse_forward`, :func:`block_sparse_backward`, :func:`kept_elements`,
  :func:`block_sparse_flops`, re-exported here.
* Per-token selection attention (:mod:`sparse_io_attn.selection.traffic`): :func:`selection`,
  :func:`selection_forward` (:func:`selection_decode_forward` for ``Nq <= 16``),
  :func:`selection_backward`, :func:`selection_pairs` (allowed
  ``(query, key)`` pairs: ``Z_QK`` of Theorem 1.2), :func:`selection_flops`, re-exported here.
* ``traffic.dense``: the paper's dense form (:mod:`sparse_io_attn.dense.traffic`: Algorithms 6, 9
  and the forward).
* ``traffic.sparse_operands``: block-sparse operands
  (:mod:`sparse_io_attn.sparse_operands.traffic`).
* :func:`context_parallel`: the network bytes of context-parallel attention per rank
  (:mod:`sparse_io_attn.distributed.traffic`; counted under ``IOCounter().network``), and
  :func:`context_parallel_steps` for a selection chosen every step.

Every model returns a ``TrafficReport(source="predicted")`` equal, in bytes, to what
:class:`~sparse_io_attn.accounting.IOCounter` records for the same launch.
"""
from __future__ import annotations

from sparse_io_attn.block_sparse.traffic import (block_sparse, block_sparse_backward, block_sparse_flops,
                                                 block_sparse_forward, kept_elements)
from sparse_io_attn.dense import traffic as dense
from sparse_io_attn.distributed.traffic import context_parallel, context_parallel_steps
from sparse_io_attn.selection.traffic import (selection, selection_backward, selection_decode_forward, selection_flops,
                                              selection_forward, selection_pairs)
from sparse_io_attn.sparse_operands import traffic as sparse_operands



__all__ = ["context_parallel", "context_parallel_steps", "block_sparse", "block_sparse_forward",
           "block_sparse_backward", "block_sparse_flops", "kept_elements", "dense", "sparse_operands", "selection",
           "selection_forward", "selection_decode_forward", "selection_backward", "selection_flops",
           "selection_pairs"]
