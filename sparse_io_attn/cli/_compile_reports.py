"""The compile report of every op's Triton kernels, by ``compile-report --op`` name.

Each report module imports Triton at its top, so this module is imported only by
``compile-report``'s run, after it set ``TRITON_INTERPRET=0`` (one lazy import for every op)."""
from __future__ import annotations

from sparse_io_attn.block_sparse.triton import report as block_sparse
from sparse_io_attn.block_sparse.triton import report_decode as block_sparse_decode
from sparse_io_attn.selection.triton import report as selection
from sparse_io_attn.selection.triton import report_decode as selection_decode
from sparse_io_attn.sparse_operands.triton import report as sparse_operands

#: ``--op`` -> the op's report module (``compile_report``, ``COLUMNS``)
REPORTS = {"block-sparse": block_sparse, "block-sparse-decode": block_sparse_decode, "sparse-operands": sparse_operands,
           "selection": selection, "selection-decode": selection_decode}
