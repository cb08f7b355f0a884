"""sparse_io_attn: block-sparse attention for PyTorch with I/O-aware, I/O-accounted kernels.

Public API (see README): :class:`BlockSparseLayout`, :mod:`patterns`, :func:`block_sparse_attention`,
:mod:`reference`, :mod:`accounting`, :mod:`bounds`, :class:`BlockSparseMatrix`, and the lazily
imported :mod:`dense`, :mod:`paper` and :mod:`nn`.
Importing the package touches neither CUDA nor Triton; Triton is imported on first kernel use.
"""
import importlib

from . import accounting, bounds, patterns, reference
from .attention import block_sparse_attention
from .layout import BlockSparseLayout, stack_layouts
from .sparse_matrix import BlockSparseMatrix

__version__ = "0.1.0"

_LAZY = ("dense", "paper", "nn")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlockSparseLayout", "BlockSparseMatrix", "stack_layouts", "block_sparse_attention",
           "accounting", "bounds", "patterns", "reference", "dense", "paper", "nn", "__version__"]
