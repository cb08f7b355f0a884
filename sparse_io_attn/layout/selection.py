"""`Selection`: per-query-token choices of key blocks, the input of
:func:`sparse_io_attn.selection_attention` and what the per-token selectors return.

A selection lists, for every query token, up to ``K`` key blocks of ``block_size`` keys (block ``c``
holds keys ``c * block_size .. min((c + 1) * block_size, seqlen_k) - 1``; ``block_size = 1`` picks
single tokens). ``indices`` is ``[B, G, Nq, K]`` (one selection per batch element) or ``[G, Nq, K]``
(shared by the batch); query head ``h`` of ``Hq`` uses selection ``h // (Hq // G)``, so ``G = 1``
shares one selection among all heads (DeepSeek Sparse Attention), ``G = Hkv`` one per GQA group
(NSA, MiniMax MSA) and ``G = Hq`` one per query head (MoBA).

Row semantics (what every backend, the reference and the converters implement): the allowed keys
of query ``t`` are the union of its listed blocks, intersected with causality when the attention
call asks for it. Negative entries are empty slots; a block listed twice counts once; with
``counts [B, G, Nq]`` (or ``[G, Nq]``) only the first ``counts`` entries of a row count. Entries
``>= ceil(seqlen_k / block_size)`` are refused by a checked call and count as empty slots
otherwise (no kernel reads outside its tensors either way).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_INT_DTYPES = (torch.int32, torch.int64)


def _int_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _INT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {got}")
    return x


@dataclass(frozen=True, eq=False)
class Selection:
    """Per-token key-block choices (see the module docstring for the meaning).

    Attributes:
        indices: int32/int64 ``[B, G, Nq, K]`` or ``[G, Nq, K]``: key-block indices, ``< 0`` = empty.
        block_size: keys per block (a positive int; 1 = single tokens; the last block may be ragged).
        counts: optional int32/int64 ``[B, G, Nq]`` / ``[G, Nq]``: entries of each row that count.

    Construction checks types and shapes only (no read of the data, so building one on a device
    never synchronises); :meth:`check` reads the values.
    """
    indices: torch.Tensor
    block_size: int
    counts: torch.Tensor | None = None

    def __post_init__(self):
        idx = _int_tensor(self.indices, "indices")
        if idx.dim() not in (3, 4):
            raise ValueError(f"indices must have shape [B, G, Nq, K] or [G, Nq, K] (G selections: 1, Hkv or "
                             f"Hq), got {tuple(idx.shape)}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"block_size must be a positive int (keys per selected block; 1 = single "
                             f"tokens), got {bs!r}")
        if idx.shape[-3] == 0:
            raise ValueError(f"indices has G = 0 selections (shape {tuple(idx.shape)}); pass at least one")
        if self.counts is not None:
            counts = _int_tensor(self.counts, "counts")
            if tuple(counts.shape) != tuple(idx.shape[:-1]):
                raise ValueError(f"counts must have shape {tuple(idx.shape[:-1])} (indices' shape without "
                                 f"its last dim), got {tuple(counts.shape)}")
            if counts.device != idx.device:
                raise ValueError(f"counts is on {counts.device} but indices on {idx.device}; put them on "
                                 f"one device")

    # ------------------------------------------------------------------ views
    @property
    def batch(self) -> int | None:
        """The batch size the selection was made for, or ``None`` when shared by the batch."""
        return self.indices.shape[0] if self.indices.dim() == 4 else None

    @property
    def num_selections(self) -> int:
        """``G``: query head ``h`` of ``Hq`` uses selection ``h // (Hq // G)``."""
        return self.indices.shape[-3]

    @property
    def seqlen_q(self) -> int:
        return self.indices.shape[-2]

    @property
    def max_blocks(self) -> int:
        """``K``: the slots per query row."""
        return self.indices.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def num_kv_blocks(self, seqlen_k: int) -> int:
        """Key blocks of a sequence of ``seqlen_k`` keys: ``ceil(seqlen_k / block_size)``."""
        return math.ceil(seqlen_k / self.block_size)

    def to(self, device) -> "Selection":
        device = torch.device(device)
        if device == self.device:
            return self
        return Selection(self.indices.to(device), self.block_size,
                         None if self.counts is None else self.counts.to(device))

    def check(self, seqlen_k: int) -> "Selection":
        """Read the values: raise ``ValueError`` for an entry ``>= ceil(seqlen_k / block_size)`` or a
        count outside ``[0, K]`` (one host synchronisation on CUDA)."""
        nkb = self.num_kv_blocks(seqlen_k)
        if self.indices.numel():
            top = int(self.indices.max())
            if top >= nkb:
                raise ValueError(f"indices holds key block {top} but seqlen_k {seqlen_k} with block_size "
                                 f"{self.block_size} has {nkb} key blocks (0..{nkb - 1}; negative entries are "
                                 f"empty slots)")
        if self.counts is not None and self.counts.numel():
            lo, hi = int(self.counts.min()), int(self.counts.max())
            if lo < 0 or hi > self.max_blocks:
                raise ValueError(f"counts must lie in [0, {self.max_blocks}] (K, the slots per row), got "
                                 f"values in [{lo}, {hi}]")
        return self

    def __repr__(self) -> str:
        lead = "shared by the batch" if self.batch is None else f"batch {self.batch}"
        return (f"Selection(G={self.num_selections}, seqlen_q={self.seqlen_q}, K={self.max_blocks}, "
                f"block_size={self.block_size}, {lead}, counts={'yes' if self.counts is not None else 'no'})")


__all__ = ["Selection"]
