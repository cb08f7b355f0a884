"""Fixed-capacity CSR built from per-row key-block lists, and the repetition of stored masks: tensor
operations sized by the inputs' shapes only (no ``nonzero``, ``.item()`` or host copy), so that
layouts chosen on the device every step never synchronise with the host.

A list ``kv_indices [L * R, K]`` gives up to ``K`` key blocks per query-block row; the CSR keeps
``L * R * K`` slots: every row's distinct valid blocks, sorted, packed at the front in CSR order
(absolute offsets as in :mod:`._csr`), unused slots after ``crow[-1, -1]`` (column 0).
"""
from __future__ import annotations

import torch

from sparse_io_attn.layout._csr import (INDEX_DTYPE, _absolute_crow, check_index_capacity, front_slots,
                                        pack_front, slot_rows)


def check_selection(t: torch.Tensor, what: str) -> None:
    """What a layout built from a per-row selection ``t [..., Mq, K or Mk]`` needs beyond its shape:
    real storage (a layout holds index data, so not the ``meta`` device, as ``layout.to("meta")``
    refuses) and at least one mask (no batch or head dimension of size 0). ``ValueError`` otherwise."""
    if t.device.type == "meta":
        raise ValueError(f"{what} is on the 'meta' device, but a layout holds index data the kernels read; it "
                         f"cannot live on the 'meta' device. Build it from CPU or CUDA tensors "
                         f"(torch.compile traces through the real layout)")
    if 0 in t.shape[:-2]:
        raise ValueError(f"{what} has shape {tuple(t.shape)}: its batch and head dimensions must be at least 1 "
                         f"(a layout holds one mask or more; block_sparse_attention needs a batch of at least "
                         f"1); skip the selection for an empty batch")


def csr_from_kv_lists(kv_indices: torch.Tensor, num_kv_blocks: int, L: int,
                      kv_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indices`` (int ``[L * R, K]``; entries outside ``[0, num_kv_blocks)`` are empty slots;
    with ``kv_counts [L * R]`` only the first ``kv_counts`` entries of a row count) ->
    ``(crow int32 [L, R + 1], col int32 [L * R * K])``: the distinct blocks of each row, sorted, in
    a fixed-capacity CSR."""
    rows, K = kv_indices.shape
    check_index_capacity(rows * K)
    dev = kv_indices.device
    idx = kv_indices.to(torch.int64)
    valid = (idx >= 0) & (idx < num_kv_blocks)
    if kv_counts is not None:
        valid &= torch.arange(K, device=dev) < kv_counts.to(torch.int64)[:, None]
    ordered = torch.sort(torch.where(valid, idx, num_kv_blocks), dim=1).values    # empty slots last
    repeated = torch.zeros_like(valid)
    repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    keep = (ordered < num_kv_blocks) & ~repeated                                   # [rows, K]
    flat = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    torch.cumsum(keep.sum(1), 0, out=flat[1:])
    crow = _absolute_crow(flat, L, rows // L)
    keep = keep.reshape(-1)
    return crow.to(INDEX_DTYPE), pack_front(front_slots(keep), ordered.reshape(-1), 0)


def repeat_matrices(crow: torch.Tensor, slots: list[torch.Tensor], times: int, fill: list[int]):
    """Each of the ``L`` matrices of an absolute-offset CSR repeated ``times`` times in a row (matrix
    ``l`` becomes ``l * times .. l * times + times - 1``): ``(crow [L * times, R + 1], slots)`` where
    each per-entry tensor of ``slots`` (``[n]``: the used entries first, unused capacity after
    ``crow[-1, -1]``) becomes ``[n * times]`` with unused slots set to its ``fill`` value."""
    L, R1 = crow.shape
    n = slots[0].numel()
    check_index_capacity(n * times)
    c64 = crow.to(torch.int64)
    nnz = torch.repeat_interleave(c64[:, -1] - c64[:, 0], times)                  # [L * times]
    base = torch.cumsum(nnz, 0) - nnz
    new = (c64 - c64[:, :1]).repeat_interleave(times, dim=0) + base[:, None]
    owner = slot_rows(new[:, [0, -1]], n * times)     # the repeated matrix holding each slot
    used = owner < L * times
    owner = torch.where(used, owner, 0)
    source = torch.where(used, c64[owner // times, 0] + torch.arange(n * times, device=crow.device) - base[owner], 0)
    out = [torch.where(used, t[source.clamp(max=max(n - 1, 0))] if n else t.new_zeros(0), f).to(t.dtype)
           for t, f in zip(slots, fill)]
    return new.to(INDEX_DTYPE), out
