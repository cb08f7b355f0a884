"""Block-sparse attention, the library's main operation. One shape, as every op folder:

* :mod:`.api`: :func:`block_sparse_attention` (the public function) and :func:`.api.prepare`, the
  call's prologue (input checks, the plan for the inputs' heads and device, scale, backend);
  :func:`.api.resolve_backend` decides ``"auto"``.
* :mod:`.plan`: :func:`.plan.plan` -> :class:`.plan.AttentionPlan` (full/partial block lists in
  both orders, masks, built once on the layout's device and cached on it).
* :mod:`.op`: the ``torch.library`` custom ops every call goes through, and the backends as plain
  functions of ``(q, k, v, plan, sm_scale)`` (:func:`.op.forward`, :func:`.op.backward`).
* Backends: :mod:`.cpu` (the fused C++ kernel), :mod:`.triton` (kernels ``fwd.py``, ``bwd.py`` and
  their launcher ``launch.py``), :mod:`.torch_path` (plain PyTorch, any device).
* :mod:`.reference`: float64 references; :mod:`.tiles`: kernel tile sizes; :mod:`.traffic`: the
  exact traffic model of the Triton kernels.
"""
from sparse_io_attn.block_sparse import reference
from sparse_io_attn.block_sparse.api import BACKENDS, block_sparse_attention
from sparse_io_attn.block_sparse.plan import AttentionPlan, plan

__all__ = ["AttentionPlan", "BACKENDS", "block_sparse_attention", "plan", "reference"]
