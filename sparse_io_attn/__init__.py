"""sparse_io_attn: block-sparse attention for PyTorch with I/O-aware, I/O-accounted kernels.

One folder per capability (map in ``docs/ARCHITECTURE.md``), floor by floor:

* :mod:`._memory`, :mod:`._triton`, :mod:`._cpu`, :mod:`.tally`: the ground floor (the free-memory
  probe, the one Triton runtime layer, the one C++ build, the byte counters and traffic reports).
* :mod:`.layout`: :class:`BlockSparseLayout` (the centre object), its conversions, ``patterns``,
  :class:`Selection` (per-token key-block choices) and :class:`BlockSparseMatrix` (block-sparse operands).
* :mod:`.bounds`: the lower-bound calculator; :mod:`._attention`: the attention kit the ops share (the
  call's checks and backend choice, the ``torch.library`` op wiring, the shared Triton helpers and
  kernels, decode and traffic constants, the float64 masked-softmax reference).
* :mod:`.block_sparse`: :func:`block_sparse_attention` with its plan, its ``torch.library`` custom
  ops (``block_sparse.op``), its backends (``cpu/``: the C++ kernel, ``triton/``, ``torch_path/``),
  float64 ``reference``, kernel ``tiles`` and exact ``traffic`` model.
* :mod:`.selection`: :func:`selection_attention`, each query token attending the key blocks it
  selected (a :class:`Selection`), with its plan, custom ops (``selection.op``), backends and float64
  ``reference``.
* :mod:`.dense`: the paper's dense form with its two regime-specific backward kernels.
* :mod:`.sparse_operands`: the paper's form with block-sparse operands A1, X, A2.
* :mod:`.accounting`: the traffic facade over every model, ``compare`` with a bound, ``IOCounter``.
* :mod:`.nn`: ``SparseSelfAttention`` and the other layers, the selectors (MoBA, NSA, DSA, pooled
  top-k); :mod:`.integrations`: ``integrations.transformers`` (Hugging Face ``attn_implementation``;
  imported only when used); :mod:`.distributed`: context parallelism.
* :mod:`.experiments`: the two-level-memory executor (``experiments.pebble``), Figure 1, the sweeps;
  :mod:`.cli`: the command.

Importing the package touches neither CUDA nor Triton (Triton is imported on first kernel use); on a
CPU-only torch build it sets ``TRITON_INTERPRET=1`` unless set, the only way Triton runs there.
"""
import importlib
import os
import sys

import torch

# Triton fixes its interpreter mode when it is first imported (torch._dynamo imports it too). A CPU-only
# torch build can run Triton kernels only through the interpreter: switch it on now, before anything
# imports triton (no CUDA query: the build says it). Elsewhere sparse_io_attn._triton.runtime decides.
if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparse_io_attn import accounting, bounds  # noqa: E402
from sparse_io_attn.block_sparse import AttentionPlan, block_sparse_attention, plan, reference  # noqa: E402
from sparse_io_attn.layout import BlockSparseLayout, BlockSparseMatrix, Selection, patterns, stack_layouts  # noqa: E402
from sparse_io_attn.selection import selection_attention  # noqa: E402

__version__ = "0.1.0"

# imported on first use
_LAZY = {"dense": "dense", "sparse_operands": "sparse_operands", "nn": "nn", "distributed": "distributed"}


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{_LAZY[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionPlan", "BlockSparseLayout", "BlockSparseMatrix", "Selection", "stack_layouts",
           "block_sparse_attention", "plan", "selection_attention",
           "accounting", "bounds", "patterns", "reference", "dense", "sparse_operands", "nn",
           "__version__"]
