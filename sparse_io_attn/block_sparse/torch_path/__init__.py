"""Backend ``"torch"``: block-sparse attention forward/backward in plain PyTorch (any device).

Never builds the dense ``Nq x Nk`` score matrix. The work is cut into *chunks*; a chunk is one or
a few batched matmuls ``S = Q_sel @ K_sel^T`` over whole query-block rows, so each row's softmax is
exact in one step (no online rescaling):

* A **unit** shares one layout mask and one K/V head: ``(b, kv head)`` with the query heads of its
  GQA group stacked as extra rows when the layout is shared across heads, ``(b, query head)``
  otherwise. Rows are ordered ``(position, head)`` inside a unit.
* A **task** is a set of units x a set of query-block rows that have the **same kept blocks and
  element masks** (all rows of a dense layout, the global rows of BigBird; identical rows of
  different layout masks are merged). Its rows are stacked into one matmul and its keys are read
  once per unit. A task reads only blocks its rows keep.
* The kept key blocks of a row are merged into one run. Contiguous runs are read as views (no
  copy): one task batched over units, or a **strided** series of tasks whose row and key starts
  advance by fixed steps (a sliding window: one matmul per unit over overlapping key windows).
  Other tasks gather whole blocks with one ``index_select`` into a reused buffer.
* Elements to drop (causal ``j > i + delta`` inside blocks that straddle the diagonal, key padding
  past ``seqlen_k``, the elements a partial block's mask removes) are set to ``-inf`` only in the
  block columns that need it; blocks entirely past the causal diagonal are removed from the plan.
* On CPU with several torch threads the chunks are shared by single-threaded worker threads
  (:func:`for_each_chunk`): one parallel region per chunk rather than one per small op.

The host plan depends only on the attention plan, ``(B, Hq, Hkv)`` and the device; it is built once
and kept in the attention plan (``plan.get_plan``). Compute is float32 (fp16/bf16
inputs are upcast; outputs are cast back). Scores are kept in base 2 (``Q`` is pre-scaled by
``sm_scale * log2(e)``; ``exp2`` is about twice as fast as ``exp`` on CPU). The returned ``lse``
is float32, natural log, ``-inf`` on rows with no kept key; such rows get output 0 and zero
gradients.

Backward recomputes ``P = exp2(S - lse2)`` per chunk (probabilities are never stored):
``dV += P^T dO``, ``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``, ``dQ = sm_scale
dS K``, ``dK += sm_scale dS^T Q``.

Modules: :mod:`.plan` (tasks and chunks), :mod:`.workers` (threads), :mod:`.execute` (forward,
backward).
"""
from sparse_io_attn.block_sparse.torch_path.execute import backward, forward

__all__ = ["forward", "backward"]
