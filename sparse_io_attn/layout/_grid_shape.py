"""The views every object on a block grid derives from its ``seqlen`` and ``block_size`` pairs
(:class:`~sparse_io_attn.layout.core.BlockSparseLayout`, :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan`)."""
from __future__ import annotations


class GridShape:
    """Mixin: ``seqlen_q``/``seqlen_k`` and ``BLOCK_SIZE_Q``/``BLOCK_SIZE_KV`` (the names the kernels use)
    from the class's ``seqlen = (q, k)`` and ``block_size = (q, k)``."""
    seqlen: tuple[int, int]
    block_size: tuple[int, int]

    @property
    def seqlen_q(self) -> int:
        return self.seqlen[0]

    @property
    def seqlen_k(self) -> int:
        return self.seqlen[1]

    @property
    def BLOCK_SIZE_Q(self) -> int:  # noqa: N802 (the name the kernels use)
        return self.block_size[0]

    @property
    def BLOCK_SIZE_KV(self) -> int:  # noqa: N802
        return self.block_size[1]
