"""Block-sparse layouts: :class:`BlockSparseLayout` (which attention tiles are computed, the centre
of the API), its conversions (``convert``: SciPy / torch BSR / FlexAttention), the pattern builders
(``patterns``) and :class:`BlockSparseMatrix` (block-sparse operands), all on one CSR convention
(``_csr``)."""
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout.core import BlockSparseLayout, stack_layouts
from sparse_io_attn.layout.matrix import BlockSparseMatrix

__all__ = ["BlockSparseLayout", "BlockSparseMatrix", "stack_layouts", "patterns"]
