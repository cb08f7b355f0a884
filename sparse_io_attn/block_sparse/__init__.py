"""Block-sparse attention, the library's main operation.

* :mod:`.api`: :func:`block_sparse_attention` (the public function), its autograd Function, the one
  prologue both entry points run (:func:`.api.prologue`: input checks, causal offset, backend,
  layout strides) and the backend registry (:func:`.api.resolve_backend`).
* :mod:`.causal`: the causal alignments (``causal=`` -> the offset of ``j <= i + delta``).
* :mod:`.triton`: Triton kernels (``fwd.py``, ``bwd.py``) and their launcher (``launch.py``).
* :mod:`.torch_path`: the pure-PyTorch backend (``plan.py``, ``execute.py``, ``workers.py``).
* :mod:`.reference`: float64 references; :mod:`.tiles`: kernel tile sizes;
  :mod:`.traffic`: the exact traffic model of the Triton kernels.
"""
from sparse_io_attn.block_sparse import reference
from sparse_io_attn.block_sparse.api import BACKENDS, block_sparse_attention

__all__ = ["block_sparse_attention", "reference", "BACKENDS"]
