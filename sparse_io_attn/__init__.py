"""sparse_io_attn: block-sparse attention for PyTorch with I/O-aware, I/O-accounted kernels.

Public API (see README): :class:`BlockSparseLayout`, :mod:`patterns`, :func:`block_sparse_attention`,
:mod:`reference`, :mod:`accounting`, :mod:`bounds`, :mod:`dense`, :mod:`paper`, :mod:`nn`.
Importing the package touches neither CUDA nor Triton.
"""
from . import accounting, reference
from .attention import block_sparse_attention
from .layout import BlockSparseLayout, stack_layouts

__version__ = "0.1.0"

__all__ = ["BlockSparseLayout", "stack_layouts", "block_sparse_attention", "accounting", "reference",
           "__version__"]
