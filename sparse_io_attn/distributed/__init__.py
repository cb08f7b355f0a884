"""Context parallelism for block-sparse attention: the sequence sharded over ranks, each rank
receiving exactly the K/V blocks its query rows read.

* :class:`ContextParallelPlan` (:mod:`.plan`): which rank owns which query-block rows (and the K/V
  blocks of the same tokens): per sequence length (:meth:`~ContextParallelPlan.for_sequence`) or
  balanced by a layout known in advance (static: ``send_blocks(src, dst)``); ``shard``/``unshard``.
* :class:`ContextParallelStep` (:mod:`.step`): ``plan.step(layout_or_selection)``, the per-step part
  of a selection chosen every step (which units this rank asks of which rank, its local and
  received parts), built on the device.
* :func:`context_parallel_attention` (:mod:`.attention`): ranks agree on plan, shapes, dtypes and
  backward first (else the same ``ValueError`` on every rank); one ``all_to_all_single`` of K/V blocks in
  forward, of their dK/dV in backward, overlapped with the local part; exact.
* :class:`ContextParallelSelfAttention` (:mod:`.module`): an ``nn.SparseSelfAttention`` layer run on
  this rank's tokens, its attention through :func:`context_parallel_attention`. Loaded on first
  access: ``nn`` imports ``torch._dynamo`` and Triton, which the traffic model (:mod:`.traffic`,
  re-exported by :mod:`sparse_io_attn.accounting.traffic`) and the plans do not need.
The bytes each rank sends and receives, against all-gather, ring and the floor, are predicted by
:mod:`.traffic` (:func:`sparse_io_attn.accounting.traffic.context_parallel`; counted under
``IOCounter().network``).
"""
from sparse_io_attn.distributed.attention import context_parallel_attention, merge_partials
from sparse_io_attn.distributed.plan import ContextParallelPlan, RankLayouts, causal_layout
from sparse_io_attn.distributed.step import ContextParallelStep


def __getattr__(name):
    if name == "ContextParallelSelfAttention":
        from sparse_io_attn.distributed.module import ContextParallelSelfAttention
        globals()[name] = ContextParallelSelfAttention
        return ContextParallelSelfAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"ContextParallelSelfAttention"})


__all__ = ["ContextParallelPlan", "ContextParallelSelfAttention", "ContextParallelStep", "RankLayouts",
           "causal_layout", "context_parallel_attention", "merge_partials"]
