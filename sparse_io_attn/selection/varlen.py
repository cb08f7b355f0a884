"""Packed variable-length batches (flash-attention's ``cu_seqlens`` convention) for selection attention.

``S`` sequences packed along the token axis of ``[1, H, total, D]`` tensors (or flash-attention's
``[total, H, D]``): sequence ``s`` holds query tokens ``[cu_q[s], cu_q[s + 1])`` and keys ``[cu_k[s],
cu_k[s + 1])`` (one ``cu_seqlens`` for both in self-attention). Blocks and chunks restart at each
sequence's start, as in MoBA's and fla's varlen code: a selection lists **local** key blocks, block
``c`` of sequence ``s`` covering keys ``[cu_k[s] + c bs, min(cu_k[s] + (c + 1) bs, cu_k[s + 1]))``;
causality is per sequence (top-left: local key ``j`` allowed for local query ``i`` iff ``j <= i``;
bottom-right: iff ``j <= i + len_k - len_q``); a query never sees another sequence's keys.

The kernels see one **block table** (:func:`block_table`): the sequences' blocks numbered globally
(``gid = offset[s] + c``, ``offset`` the running count of blocks: fla's ``prepare_chunk_offsets``),
each with its first key and end, and each query row's causal offset (key ``n`` allowed for query
``t`` iff ``n <= t + row_delta[t]``). The table has ``Nk // bs + S`` block slots, a bound fixed by
the shapes (each sequence adds at most one ragged block), unused slots empty; everything is built
with tensor operations on the device, no host synchronisation, so a plan of new ``cu_seqlens`` of the
same shapes reuses a compiled graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE
from sparse_io_attn.layout.causal import causal_offset

_INT = (torch.int32, torch.int64)


class Varlen(NamedTuple):
    """A call's packed sequences: ``cu_q``, ``cu_k`` int64 ``[S + 1]`` on the inputs' device, and the
    causal alignment (``None``, ``"top_left"`` or ``"bottom_right"``)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    causal: str | None

    @property
    def num_sequences(self) -> int:
        return self.cu_q.numel() - 1


def _cu(x, name: str, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _INT or x.dim() != 1 or x.numel() < 2:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an int32/int64 tensor [num_sequences + 1] (flash-attention's varlen "
                        f"offsets: 0, len_0, len_0 + len_1, ...), got {got}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q on {device}; move it to q's device")
    return x.to(torch.int64)


def varlen_of(cu_seqlens, seqlen_q: int, seqlen_k: int, causal, device, *, max_seqlen=None,
              check: bool = True) -> Varlen:
    """The :class:`Varlen` of ``cu_seqlens`` (one tensor for queries and keys, or a pair ``(cu_q,
    cu_k)``) for a call of ``seqlen_q`` queries and ``seqlen_k`` keys. ``check`` reads the offsets (one
    host synchronisation on CUDA): 0 first, non-decreasing, ``seqlen`` last, lengths within
    ``max_seqlen`` (an int, or a pair, when given). Unchecked offsets never make a kernel read
    outside its tensors (the table clamps to the keys)."""
    pair = isinstance(cu_seqlens, (tuple, list))
    if pair and len(cu_seqlens) != 2:
        raise ValueError(f"cu_seqlens must be a tensor or a pair (cu_seqlens_q, cu_seqlens_k), got {len(cu_seqlens)} "
                         f"items")
    cu_q = _cu(cu_seqlens[0] if pair else cu_seqlens, "cu_seqlens_q" if pair else "cu_seqlens", device)
    cu_k = _cu(cu_seqlens[1], "cu_seqlens_k", device) if pair else cu_q
    if cu_k.numel() != cu_q.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {cu_q.numel() - 1} and "
                         f"{cu_k.numel() - 1}")
    delta = causal_offset(causal, 1, 1)              # ValueError naming the accepted modes
    mode = None if delta is None else ("bottom_right" if causal == "bottom_right" else "top_left")
    maxes = max_seqlen if isinstance(max_seqlen, (tuple, list)) else (max_seqlen, max_seqlen)
    if check and not torch.compiler.is_compiling():
        for name, cu, n, most in (("q", cu_q, seqlen_q, maxes[0]), ("k", cu_k, seqlen_k, maxes[1])):
            lens = cu.diff()
            if int(cu[0]) != 0 or bool((lens < 0).any()) or int(cu[-1]) != n:
                raise ValueError(f"cu_seqlens ({name}) must start at 0, never decrease and end at the packed length "
                                 f"{n}, got first {int(cu[0])}, last {int(cu[-1])}" +
                                 (", decreasing" if bool((lens < 0).any()) else ""))
            if most is not None and int(lens.max()) > int(most):
                raise ValueError(f"a sequence holds {int(lens.max())} {'queries' if name == 'q' else 'keys'} but "
                                 f"max_seqlen is {int(most)}")
    return Varlen(cu_q, cu_k, mode)


def capacity(seqlen_k: int, block_size: int, num_sequences: int) -> int:
    """Block slots of a table: ``Nk // bs + S`` bounds ``sum_s ceil(len_s / bs)``."""
    return seqlen_k // block_size + num_sequences


def block_offsets(cu: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[S + 1]``: each sequence's first global block (fla's ``prepare_chunk_offsets``)."""
    lens = cu.diff().clamp(min=0)
    return torch.cat([lens.new_zeros(1), torch.cumsum(-(-lens // block_size), 0)])


def sequence_of(cu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64: the sequence each position belongs to (``S - 1`` past the last offset, 0 before)."""
    return torch.searchsorted(cu[1:].contiguous(), positions, right=True).clamp(max=cu.numel() - 2)


def row_offsets(vl: Varlen, seqlen_q: int) -> torch.Tensor:
    """int64 ``[Nq]``: query ``t`` of sequence ``s`` may use key ``n`` iff ``n <= t + offset[t]``:
    ``cu_k[s] - cu_q[s]``, plus ``len_k - len_q`` bottom-right."""
    t = torch.arange(seqlen_q, device=vl.cu_q.device)
    s = sequence_of(vl.cu_q, t)
    off = vl.cu_k[s] - vl.cu_q[s]
    if vl.causal == "bottom_right":
        off = off + (vl.cu_k.diff() - vl.cu_q.diff())[s]
    return off


def block_table(vl: Varlen, block_size: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """int32 ``[2 nkb + Nq]``: the blocks' first keys, their ends (``nkb = capacity(...)`` slots,
    unused ones empty at ``Nk``), then the rows' causal offsets (:func:`row_offsets`)."""
    cu, bs = vl.cu_k.clamp(0, seqlen_k), block_size
    nkb = capacity(seqlen_k, bs, vl.num_sequences)
    off = block_offsets(cu, bs)
    g = torch.arange(nkb, device=cu.device)
    s = sequence_of(off, g)
    used = g < off[-1]
    start = torch.where(used, cu[s] + (g - off[s]) * bs, seqlen_k)
    end = torch.where(used, torch.minimum(start + bs, cu[s + 1]), seqlen_k)
    return torch.cat([start, end, row_offsets(vl, seqlen_q)]).to(INDEX_DTYPE)


def global_blocks(indices: torch.Tensor, vl: Varlen, block_size: int, seqlen_k: int) -> torch.Tensor:
    """``indices [L, Nq, K]`` of local blocks -> int64 global block numbers, ``-1`` where an entry is
    no block of its token's sequence or lies wholly in the token's causal future."""
    L, Nq, K = indices.shape
    dev = indices.device
    cu = vl.cu_k.clamp(0, seqlen_k)
    t = torch.arange(Nq, device=dev)
    s = sequence_of(vl.cu_q, t)
    off = block_offsets(cu, block_size)
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < (off[1:] - off[:-1])[s][:, None])
    if vl.causal is not None:         # the block's first key allowed for the token
        ok &= cu[s][:, None] + idx * block_size <= (t + row_offsets(vl, Nq))[:, None]
    return torch.where(ok, off[s][:, None] + idx, -1)


def check_local(indices: torch.Tensor, vl: Varlen, block_size: int, seqlen_k: int) -> None:
    """``ValueError`` for a local block past its token's sequence (reads the indices: one host
    synchronisation on CUDA)."""
    idx = indices.reshape(-1, *indices.shape[-2:])
    Nq = idx.shape[1]
    s = sequence_of(vl.cu_q, torch.arange(Nq, device=idx.device))
    nb = -(-vl.cu_k.diff() // block_size)
    bad = idx >= nb[s][:, None]
    if bool(bad.any()):
        t = int(bad.any(-1).any(0).to(torch.uint8).argmax())
        raise ValueError(f"indices name a block past the sequence of query token {t} (sequence {int(s[t])} has "
                         f"{int(nb[s[t]])} blocks of {block_size} keys); with cu_seqlens the indices are local "
                         f"block numbers (0 = the sequence's first block), negative entries empty slots")


__all__ = ["Varlen", "block_offsets", "block_table", "capacity", "check_local", "global_blocks", "row_offsets",
           "sequence_of", "varlen_of"]
