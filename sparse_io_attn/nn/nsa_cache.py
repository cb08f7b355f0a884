"""Decode-time state of Native Sparse Attention (:mod:`sparse_io_attn.nn.nsa`): what NSA keeps beyond
the keys and values so that a decode step reads only the compressed blocks, the selected blocks and
the window, never the whole cache.

* :class:`NSAState`: per complete key block its compressed key and compressed value (fla's
  ``mean_pooling``: a float32 mean stored in the keys' dtype), computed once, when the block's last
  token arrives, by the very operation the prefill applies to the whole sequence; the raw keys and
  values of the incomplete last block (at most ``block_size - 1`` tokens). The keys' half is the NSA
  selector's own :class:`~sparse_io_attn.nn.selector_state.BlockKeyState` (the compressed keys are
  both the selection's scores' keys and the compression branch's keys), the values' half a second
  one. Size ``2 * B * Hkv * (nf + block_size) * D`` elements.
* :class:`NSACache`: the KV cache of one :class:`~sparse_io_attn.nn.NativeSparseAttention` layer:
  the post-RoPE keys and the values of every token so far, in buffers grown by doubling (an append
  copies the new tokens, amortised ``O(new tokens)``), and its :class:`NSAState`.

A Hugging Face model keeps its keys and values in its own ``Cache`` and an :class:`NSAState` per layer
on that ``Cache`` object (``integrations/transformers/decode_state.py``).
"""
from __future__ import annotations

from typing import Callable

import torch

from sparse_io_attn.nn.selector_state import BlockKeyState
from sparse_io_attn.nn.selectors import NSASelector, whole_block_means


class NSAState:
    """Compressed keys and values of the complete blocks and the raw tail of one layer's KV cache
    (see the module docstring). Made by ``NSAAttention.init_state()`` and advanced by each call of
    that attention with ``state=``: ``keys`` is the NSA selector's state (its ``step`` appends the
    new keys), ``values`` the same for the values."""

    def __init__(self, selector: NSASelector):
        bs = selector.block_size
        self.keys: BlockKeyState = selector.init_state()
        self.values = BlockKeyState("nsa_values", bs, lambda x: whole_block_means(x, bs), self.keys.params)

    @property
    def length(self) -> int:
        """Tokens consumed so far."""
        return self.keys.length

    @property
    def tail(self) -> torch.Tensor | None:
        """The raw keys of the incomplete last block (``[B, Hkv, r, D]``; ``None`` before any key)."""
        return self.keys.tail

    def compressed(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_cmp, v_cmp)`` ``[B, Hkv, nf, D]`` of the complete blocks (``None`` before the first)."""
        return self.keys.summaries, self.values.summaries

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch dimension of every held tensor (beam search's reorder)."""
        self.keys.map_batch(fn)
        self.values.map_batch(fn)

    def numel(self) -> int:
        """Elements held (compressed keys and values, raw tails)."""
        return self.keys.numel() + self.values.numel()

    def reset(self) -> None:
        """Forget every token (a new sequence)."""
        self.keys.reset()
        self.values.reset()

    def __repr__(self) -> str:
        return (f"NSAState({self.keys.owner}, length={self.length}, complete_blocks={self.keys.num_blocks}, "
                f"tail={0 if self.tail is None else self.tail.shape[2]})")


class NSACache:
    """The KV cache of one :class:`~sparse_io_attn.nn.NativeSparseAttention` layer
    (``layer.init_cache()``; pass it as ``layer(x, cache=cache)``): ``k`` (post-RoPE) and ``v``
    ``[B, Hkv, length, D]`` of every token so far, held detached in buffers grown by doubling (or
    allocated for ``capacity`` tokens at once), and the layer's :class:`NSAState` (``state``)."""

    def __init__(self, state: NSAState, capacity: int | None = None):
        self.state = state
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor | None:
        """The cached keys ``[B, Hkv, length, D]`` (a view of the buffer)."""
        return None if self._k is None else self._k[:, :, :self.length]

    @property
    def v(self) -> torch.Tensor | None:
        """The cached values ``[B, Hkv, length, D]`` (a view of the buffer)."""
        return None if self._v is None else self._v[:, :, :self.length]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_new``, ``v_new`` ``[B, Hkv, n, D]`` (the next ``n`` tokens); returns the views
        ``(k, v)`` of all ``length`` tokens. The :class:`NSAState` is advanced by the attention call,
        not here."""
        if not isinstance(k_new, torch.Tensor) or not isinstance(v_new, torch.Tensor) or k_new.dim() != 4 \
                or k_new.shape != v_new.shape or k_new.dtype != v_new.dtype or k_new.device != v_new.device:
            raise ValueError(f"NSACache.append takes keys and values [B, Hkv, n, D] of one shape, dtype and device, "
                             f"got {_describe(k_new)} and {_describe(v_new)}")
        n, end = k_new.shape[2], self.length + k_new.shape[2]
        if self._k is not None:
            B, Hkv, _, D = self._k.shape
            if (k_new.shape[0], k_new.shape[1], k_new.shape[3]) != (B, Hkv, D) or k_new.dtype != self._k.dtype \
                    or k_new.device != self._k.device:
                raise ValueError(f"NSACache.append: new keys {_describe(k_new)} do not continue the cache: expected "
                                 f"[B={B}, Hkv={Hkv}, n, D={D}] {self._k.dtype} on {self._k.device}; a new sequence, "
                                 f"batch, head count, dtype or device needs a new layer.init_cache()")
        if self._k is None or end > self._k.shape[2]:
            self._grow(k_new, end)
        self._k[:, :, self.length:end] = k_new.detach()
        self._v[:, :, self.length:end] = v_new.detach()
        self.length = end
        return self.k, self.v

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        """Buffers for at least ``needed`` tokens: ``capacity``, else double the current size."""
        old = 0 if self._k is None else self._k.shape[2]
        size = max(needed, 2 * old, self.capacity or 0)
        B, Hkv, _, D = like.shape
        k = like.new_empty(B, Hkv, size, D)
        v = like.new_empty(B, Hkv, size, D)
        if self.length:
            k[:, :, :self.length] = self.k
            v[:, :, :self.length] = self.v
        self._k, self._v = k, v

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch dimension of the keys, values and state (``lambda t:
        t.index_select(0, beam_idx)`` for beam search)."""
        if self._k is not None:
            self._k, self._v = fn(self.k), fn(self.v)
        self.state.map_batch(fn)

    def numel(self) -> int:
        """Elements held: the cached keys and values (not the buffers' spare room) and the state."""
        kv = 0 if self._k is None else 2 * self.k.numel()
        return kv + self.state.numel()

    def reset(self) -> None:
        """Forget every token (a new sequence); the buffers are released."""
        self._k = self._v = None
        self.length = 0
        self.state.reset()

    def __repr__(self) -> str:
        return f"NSACache(length={self.length}, state={self.state!r})"


def _describe(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


__all__ = ["NSACache", "NSAState"]
