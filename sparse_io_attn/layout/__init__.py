"""Block-sparse layouts: :class:`BlockSparseLayout` (which attention tiles are computed, the centre
of the API), its conversions (``convert``: SciPy / torch BSR / FlexAttention), the pattern builders
(``patterns``) and :class:`BlockSparseMatrix` (block-sparse operands), all on one CSR convention
(``_csr``); :class:`Selection` (per-query-token key blocks) and its exact conversions from and to
layouts (:func:`selection_from_layout`, :func:`layout_from_selection`) and from FlashMLA's sparse
indices (:func:`selection_from_flashmla`)."""
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout.core import BlockSparseLayout, stack_layouts
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.layout.selection import (Selection, layout_from_selection, selection_from_flashmla,
                                             selection_from_layout)

__all__ = ["BlockSparseLayout", "BlockSparseMatrix", "Selection", "layout_from_selection", "selection_from_flashmla",
           "selection_from_layout", "stack_layouts", "patterns"]
