"""Decode-time state of the block selectors (:mod:`sparse_io_attn.nn.selectors`): what a selector keeps
per cached key block so that a decode step chooses from the new tokens and the state alone, never
re-reading the key cache.

A :class:`BlockKeyState` holds, for one attention layer and one KV cache,

* ``summaries [B, Hkv, nf, D]``: one summary per **complete** key block (MoBA: the chunk mean, taken in
  k's dtype as MoBA does and stored in float32; NSA: fla's compressed key, a float32 mean stored in
  k's dtype; pooled top-k: the float32 block mean), computed once, when the block completes, by the
  very operation the selector's prefill applies to the whole sequence;
* ``tail [B, Hkv, r, D]``: the ``r < block_size`` keys of the incomplete last block, kept raw so that
  its summary, once the block completes, is the prefill's to the bit (a running float32 sum would
  not reproduce a bfloat16 mean);
* ``length``: the keys consumed so far (every batch row alike: no padding).

Size ``B * Hkv * (nf + block_size) * D`` elements: ``O(key blocks x D)``. A step of ``n`` new tokens
appends their keys (completing at most ``ceil(n / block_size) + 1`` blocks) and scores the ``n`` new
queries against the ``nf`` summaries: ``O(n * nf * D)`` work, none of it on the cached keys.
"""
from __future__ import annotations

from typing import Callable

import torch


class BlockKeyState:
    """Per-block key summaries of one layer's KV cache (see the module docstring). Made by a
    selector's ``init_state()`` and advanced by that selector's ``step``; ``kind`` and ``params``
    (``(name, value)`` pairs: block size, top-k, ...) name the selector it belongs to, and a step of
    another kind or parameters raises ``ValueError`` (:meth:`check`); the keys' batch, heads, head
    dim, dtype and device are fixed by the first keys appended (:meth:`append` refuses others).
    ``summarise(keys [B, Hkv, m * block_size, D]) -> [B, Hkv, m, D]`` is the selector's summary of
    ``m`` complete blocks."""

    def __init__(self, kind: str, block_size: int, summarise: Callable[[torch.Tensor], torch.Tensor],
                 params: tuple = ()):
        self.kind, self.block_size, self.summarise = kind, block_size, summarise
        self.params = tuple(params)
        self.summaries: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None
        self.length = 0

    @property
    def owner(self) -> str:
        """The selector this state belongs to, as its parameters name it (``moba(chunk_size=16, top_k=2)``)."""
        return _owner(self.kind, self.params)

    def check(self, kind: str, params: tuple, who: str) -> None:
        """``ValueError`` unless this is a :class:`BlockKeyState` made by the selector ``kind(params)``
        (called unbound, ``BlockKeyState.check(state, ...)``, so any object can be checked)."""
        want = _owner(kind, params)
        if not isinstance(self, BlockKeyState) or (self.kind, self.params) != (kind, tuple(params)):
            got = self.owner if isinstance(self, BlockKeyState) else type(self).__name__
            raise ValueError(f"{who}: expected a state made by {want} (this selector), got one that belongs to "
                             f"{got}; make the state with this selector's init_state()")

    def append(self, k_new: torch.Tensor, who: str = "BlockKeyState.append") -> "BlockKeyState":
        """Append ``k_new [B, Hkv, n, D]`` (the next ``n`` keys; the blocks they complete get their
        summary). Returns the state."""
        if not isinstance(k_new, torch.Tensor) or k_new.dim() != 4:
            raise ValueError(f"{who}: keys must be a tensor [B, Hkv, n, D], got "
                             f"{tuple(k_new.shape) if isinstance(k_new, torch.Tensor) else type(k_new).__name__}")
        t = self.tail
        if t is not None and (k_new.shape[:2] != t.shape[:2] or k_new.shape[3] != t.shape[3]
                              or k_new.dtype != t.dtype or k_new.device != t.device):
            B, Hkv, _, D = t.shape
            raise ValueError(f"{who}: new keys {tuple(k_new.shape)} {k_new.dtype} on {k_new.device} do not continue "
                             f"the state's cache: expected [B={B}, Hkv={Hkv}, n, D={D}] {t.dtype} on {t.device}; "
                             f"a new sequence, batch, head count, dtype or device needs a new init_state()")
        keys = k_new.detach() if self.tail is None else torch.cat([self.tail, k_new.detach()], 2)
        bs = self.block_size
        whole = keys.shape[2] // bs * bs
        if whole:
            done = self.summarise(keys[:, :, :whole])
            self.summaries = done if self.summaries is None else torch.cat([self.summaries, done], 2)
        self.tail = keys[:, :, whole:].clone()      # not a view that would keep the step's keys alive
        self.length += k_new.shape[2]
        return self

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch dimension of every held tensor (a cache's beam reorder or batch
        selection: ``lambda t: t.index_select(0, beam_idx)``)."""
        self.summaries = None if self.summaries is None else fn(self.summaries)
        self.tail = None if self.tail is None else fn(self.tail)

    @property
    def num_blocks(self) -> int:
        """Complete key blocks summarised."""
        return 0 if self.summaries is None else self.summaries.shape[2]

    def numel(self) -> int:
        """Elements held (summaries and tail)."""
        return sum(t.numel() for t in (self.summaries, self.tail) if t is not None)

    def reset(self) -> None:
        """Forget every key (a new sequence)."""
        self.summaries = self.tail = None
        self.length = 0

    def __repr__(self) -> str:
        return (f"BlockKeyState({self.owner}, block_size={self.block_size}, length={self.length}, "
                f"complete_blocks={self.num_blocks}, tail={0 if self.tail is None else self.tail.shape[2]})")


def _owner(kind: str, params) -> str:
    return f"{kind}({', '.join(f'{name}={value!r}' for name, value in params)})"


class IndexKeyState:
    """DeepSeek Sparse Attention's index-key cache (:class:`~sparse_io_attn.nn.LightningIndexer`):
    ``keys [B, P, head_dim]``, the post-RoPE index keys of the ``P`` tokens seen so far (V3.2's
    ``k_cache`` of its ``Indexer``). DSA selects single tokens, so the indexer scores every cached
    index key at each step: ``O(P * head_dim)`` per step by design (the lightning indexer's one
    light pass over the sequence), with ``head_dim`` the index head size, not the attention's."""

    def __init__(self):
        self.keys: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, k_new: torch.Tensor) -> torch.Tensor:
        k_new = k_new.detach()
        self.keys = k_new if self.keys is None else torch.cat([self.keys, k_new.to(self.keys.dtype)], 1)
        return self.keys

    def numel(self) -> int:
        return 0 if self.keys is None else self.keys.numel()

    def reset(self) -> None:
        self.keys = None

    def __repr__(self) -> str:
        return f"IndexKeyState(length={self.length})"


__all__ = ["BlockKeyState", "IndexKeyState"]
