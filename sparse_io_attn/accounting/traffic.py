"""One facade over the library's three exact traffic models (each lives beside its kernels).

* Block-sparse attention (:mod:`sparse_io_attn.block_sparse.traffic`): :func:`block_sparse`,
  :func:`block_sparse_forward`, :func:`block_sparse_backward`, :func:`kept_elements`,
  :func:`block_sparse_flops`, re-exported here.
* ``traffic.dense``: the paper's dense form (:mod:`sparse_io_attn.dense.traffic`: Algorithms 6, 9
  and the forward).
* ``traffic.sparse_operands`` (also ``traffic.paper``): block-sparse operands
  (:mod:`sparse_io_attn.sparse_operands.traffic`).

Every model returns a ``TrafficReport(source="predicted")`` equal, in bytes, to what
:class:`~sparse_io_attn.accounting.IOCounter` records for the same launch.
"""
from __future__ import annotations

import importlib

from sparse_io_attn.block_sparse.traffic import (block_sparse, block_sparse_backward, block_sparse_flops,
                                                 block_sparse_forward, kept_elements)

_FAMILIES = {"dense": "sparse_io_attn.dense.traffic",
             "sparse_operands": "sparse_io_attn.sparse_operands.traffic",
             "paper": "sparse_io_attn.sparse_operands.traffic"}


def __getattr__(name):
    # the other families' models are imported on first use (their packages import the accounting layer)
    if name in _FAMILIES:
        return importlib.import_module(_FAMILIES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["block_sparse", "block_sparse_forward", "block_sparse_backward", "block_sparse_flops",
           "kept_elements", "dense", "sparse_operands"]
