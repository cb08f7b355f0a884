"""Per-token selection attention: each query token attends the union of the key blocks it selected
(:class:`~sparse_io_attn.layout.selection.Selection`).

* :mod:`.api`: :func:`~.api.selection_attention` (checks, plan, backends).
* :mod:`.plan`: :class:`~.plan.SelectionPlan` (normalised rows and the key-major lists, on the device).
* :mod:`.varlen`: packed variable-length sequences (``cu_seqlens``): the block table.
* :mod:`.torch_path`: backend ``"torch"`` (plain PyTorch, any device).
* :mod:`.reference`: the float64 reference.
"""
from sparse_io_attn.selection import reference
from sparse_io_attn.selection.api import selection_attention
from sparse_io_attn.selection.plan import SelectionPlan, plan_selection

__all__ = ["SelectionPlan", "plan_selection", "reference", "selection_attention"]
