"""Backend ``"cpu"`` of :func:`~sparse_io_attn.selection_attention`: per-token selection attention in
C++ (forward and deterministic backward), and the plan's normalisations.

Implements the selection backend interface (:mod:`sparse_io_attn.selection.api`):

* ``forward(q, k, v, plan, *, sm_scale) -> (out, lse, stats)``
* ``backward(do, q, k, v, out, stats, plan, *, sm_scale) -> (dq, dk, dv)``

both with an optional ``family_name=`` (``"key"``, ``"query"``; default: ``$SPARSE_IO_ATTN_SELECTION_FAMILY``,
else by block size) that forces a kernel family (tests run both on every case).

How it works (``kernel.cpp``: overview and op registration; ``plan_ops.h``, ``problem.h``, ``dots.h``,
``query_major.h``, ``key_major.h``, ``decode.h``; the shared ``_cpu/simd.h``, ``tiles.h``, ``softmax.h``,
``entry.h`` and ``split_k.h``):

* **Key-major** (blocks of 16 keys and more): a task per (batch, kv head, key block, fixed-size chunk
  of the query rows that chose it: the plan's key lists, every query head of the selection in this
  kv head). Dense brgemm tiles of up to 64 gathered rows against the block; per-element masks only
  where the block is ragged or straddles the causal diagonal. Forward writes each (row, block) pair's
  partial result (row max, row sum, unnormalised output) at the pair's slot and merges a row's slots
  in slot order (ascending block); backward accumulates the block's dK, dV in its task (chunks of a
  block summed in chunk order) and reduces per-pair dQ partials per row in slot order.
* **Query-major** (small blocks: single tokens, micro-blocks): forward and dQ per (unit, tile of 64
  query tokens), a unit being the query heads of one kv head that share a selection (the rows);
  each token's selected keys are addressed by their numbers (for single tokens the plan's rows
  themselves) and scored 16 at a time, the tile walking its tokens' lists one range of keys at a
  time so the range's K/V rows are reused from cache. dK/dV per (batch, query head, run of keys)
  over the key lists, swept in tiles of tokens: each key's gradient is summed by one task, in list
  order, with no scatter and no accumulator shared between tasks (several query heads per kv head:
  per-head sums added in head order).
* Same math as the block-sparse kernel (base-2 scores rounded and saturated before the row maximum is
  subtracted, stats = (m, log2 l), backward recomputes P from them exactly); fp16/bf16 converted to
  fp32 once, fp32 strided views read in place. Deterministic: bitwise identical across runs and
  thread counts (decompositions depend on the plan and shapes only; no atomics on data).
* The raw ops (``torch.ops.sparse_io_attn_cpu.selection_fwd`` / ``selection_bwd``) check their inputs,
  the plan's rows and key lists included, before any work and raise ``RuntimeError``.

:func:`sparse_io_attn.selection.plan.normalize_rows` and :func:`~sparse_io_attn.selection.plan.key_lists`
run the extension's ``selection_rows`` / ``selection_keys`` on CPU tensors once it is loaded (identical
results). The extension is built on first use (:mod:`sparse_io_attn._cpu.build`).
"""
from sparse_io_attn._cpu.build import available_for_auto, is_available, load, unavailable_reason
from sparse_io_attn._attention.cpu import decode_work_bytes
from sparse_io_attn.selection.cpu._launch import FAMILY_ENV, backward, family, forward

__all__ = ["forward", "backward", "family", "FAMILY_ENV", "available_for_auto", "decode_work_bytes", "is_available",
           "load", "unavailable_reason"]
