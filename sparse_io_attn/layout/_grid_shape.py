"""The views every object on a block grid derives from its ``seqlen`` and ``block_size`` pairs and its
``layout_batch`` x ``layout_heads`` masks (:class:`~sparse_io_attn.layout.core.BlockSparseLayout`,
:class:`~sparse_io_attn.block_sparse.plan.AttentionPlan`), and the one check that its masks broadcast
over a call's batch and query heads."""
from __future__ import annotations



class GridShape:
    """Mixin: ``seqlen_q``/``seqlen_k``, ``BLOCK_SIZE_Q``/``BLOCK_SIZE_KV`` (the names the kernels use)
    and ``num_layouts`` from the class's ``seqlen = (q, k)``,
    ``block_size = (q, k)``, ``layout_batch`` and ``layout_heads``."""
    seqlen: tuple[int, int]
    block_size: tuple[int, int]
    layout_batch: int
    layout_heads: int

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

    @property
    def num_layouts(self) -> int:
        return self.layout_batch * self.layout_heads

    def check_broadcast(self, batch: int, num_heads_q: int) -> None:
        """``ValueError`` unless the masks broadcast over ``[batch, num_heads_q]`` (1 or ``batch`` batch
        masks, 1 or ``num_heads_q`` head masks)."""
        if self.layout_batch not in (1, batch):
            raise ValueError(f"layout has {self.layout_batch} batch masks but the input has batch "
                             f"{batch}; build it with 1 (shared) or {batch} batch masks")
        if self.layout_heads not in (1, num_heads_q):
            raise ValueError(f"layout has {self.layout_heads} head masks but q has {num_heads_q} heads; "
                             f"build it with 1 (shared) or {num_heads_q} head masks (one per query head)")
