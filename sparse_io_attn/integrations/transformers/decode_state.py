"""Selector state kept with a Hugging Face KV cache, so that a decode step of a data-dependent selector
(``config.sparse_attention = "moba:..."``, ``"pooled_topk:..."`` or ``"nsa_selection:..."``) reads the
per-block key summaries of :class:`~sparse_io_attn.nn.selector_state.BlockKeyState` instead of
re-pooling the whole key cache: ``O(key blocks x D)`` per new token and layer instead of ``O(Nk x D)``.
``"nsa:..."`` keeps NSA's :class:`~sparse_io_attn.nn.nsa_cache.NSAState` (compressed keys and values)
the same way (:func:`state_on_cache`).

Where the state lives: a dict ``{(layer_idx, repr(owner)): state}`` set as an attribute of the
model's ``Cache`` object (a ``DynamicCache`` that ``generate()`` makes per call), so it starts empty
for every new ``generate()`` and dies with its cache. Transformers does not pass the cache to the
attention function (``LlamaAttention.forward`` keeps it), so the first selector call on an attention
module registers a forward pre-hook on it that notes (weakly) the ``cache=`` / ``past_key_values=``
keyword of each forward; a model that passes the cache in the attention kwargs needs no hook.
A call that finds no cache (the first forward after the hook is installed, ``use_cache=False``,
``torch.compile``) selects over the whole key cache as before, and the next call with a cache rebuilds
the state from its keys once (``O(Nk x D)``).

When it is used: no element mask (no padding, no packing, no static cache: with those the
per-sequence selection over each sequence's written tokens runs, see
``layouts.selection_layout_with_mask``) and a layer with a ``layer_idx``. A state continues only the cache it was built for: its length must be the
cache's minus this call's queries, its batch, heads, dtype and device the keys'; otherwise it is
rebuilt from ``key[:, :, :Nk - Nq]``. ``crop`` and ``reset`` on the cache (assisted decoding, a reused
cache) drop the states of that cache, which then rebuild on the next call; ``reorder_cache``,
``batch_select_indices`` and ``batch_repeat_interleave`` (beam search, contrastive search) move the
states' batch rows as the cache's. Any ``Nq`` continues the state
(a decode step, 1..16 speculative tokens, or a chunk of a chunked prefill).
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

STATES_ATTR = "_sparse_io_attn_selector_states"
_CACHE_ATTR = "_sparse_io_attn_cache"
_HOOKED_ATTR = "_sparse_io_attn_cache_hook"
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
#: Cache methods that remove or replace cached keys: they drop the cache's selector states
INVALIDATING = ("crop", "reset")
#: Cache methods that move whole batch rows (beam search, contrastive search): applied to the states too
BATCH_MAPS = {
    "reorder_cache": lambda beam_idx: lambda t: t.index_select(0, beam_idx.to(t.device)),
    "batch_select_indices": lambda indices: lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor)
                                                        else indices],
    "batch_repeat_interleave": lambda repeats: lambda t: t.repeat_interleave(repeats, 0),
}


def _cache_of(kwargs) -> Optional[object]:
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def _note_cache(module, args, kwargs):
    """Forward pre-hook: remember (weakly) the cache this forward of ``module`` writes to."""
    if torch.compiler.is_compiling():
        return None
    cache = _cache_of(kwargs)
    try:
        ref = None if cache is None else weakref.ref(cache)
    except TypeError:                # a cache class without weak references: no state
        ref = None
    setattr(module, _CACHE_ATTR, ref)
    return None


def find_cache(module, kwargs) -> Optional[object]:
    """The KV cache of this attention call: the attention kwargs' ``cache`` if the model passes it,
    else the one the module's forward received (a pre-hook installed here on first use)."""
    cache = _cache_of(kwargs)
    if cache is not None:
        return cache
    if watch_cache(module):
        return None        # this forward started before the hook: its cache is unknown
    ref = getattr(module, _CACHE_ATTR, None)
    return None if ref is None else ref()


def watch_cache(module) -> bool:
    """Install the pre-hook that notes each forward's cache on ``module`` (once); ``True`` if it was
    installed now."""
    if getattr(module, _HOOKED_ATTR, False):
        return False
    module.register_forward_pre_hook(_note_cache, with_kwargs=True)
    setattr(module, _HOOKED_ATTR, True)
    return True


def _dropping(method, states: dict):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not (method.__name__ == "crop" and args and isinstance(args[0], int) and args[0] == 0):
            states.clear()           # crop(0), which generate()'s asynchronous loop calls, changes nothing
        return method(*args, **kwargs)
    return wrapper


def _mapping(method, states: dict, batch_map):
    @functools.wraps(method)
    def wrapper(arg, *args, **kwargs):
        fn = batch_map(arg)
        for state in states.values():
            state.map_batch(fn)
        return method(arg, *args, **kwargs)
    return wrapper


def cache_states(cache) -> Optional[dict]:
    """The cache's ``{(layer_idx, selector repr): state}``, made on first use (``None`` for a cache
    object that takes no attribute); the cache's methods of :data:`INVALIDATING` then clear it and
    those of :data:`BATCH_MAPS` move its batch rows too."""
    states = getattr(cache, STATES_ATTR, None)
    if states is None:
        states = {}
        try:
            setattr(cache, STATES_ATTR, states)
        except (AttributeError, TypeError):      # a cache that takes no attributes: no state
            return None
        for name in INVALIDATING:
            method = getattr(cache, name, None)
            if callable(method):
                setattr(cache, name, _dropping(method, states))
        for name, batch_map in BATCH_MAPS.items():
            method = getattr(cache, name, None)
            if callable(method):
                setattr(cache, name, _mapping(method, states, batch_map))
    return states


def _continues(state, key: torch.Tensor, past: int) -> bool:
    if state is None or state.length != past:
        return False
    t = state.tail
    return t is None or (t.shape[:2] == key.shape[:2] and t.shape[3] == key.shape[3] and t.dtype == key.dtype
                         and t.device == key.device)


def state_on_cache(module, owner, new_tokens: int, tensors: tuple, kwargs):
    """The decode state of ``owner`` (a selector, or an ``NSAAttention``) for this module's layer,
    kept on the call's KV cache: one that holds the first ``Nk - new_tokens`` tokens of
    ``tensors`` (``(key,)`` or ``(key, value)``, ``[B, Hkv, Nk, D]``, the cache after this call's
    append), rebuilt from them (``owner.init_state(*cached parts)``) when the kept one does not
    continue the cache; ``None`` when this call has no usable cache (no ``layer_idx``, no cache found,
    a cache object that takes no attribute)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        return None
    cache = find_cache(module, kwargs)
    if cache is None:
        return None
    states = cache_states(cache)
    if states is None:
        return None
    slot = (layer, repr(owner))
    past = tensors[0].shape[2] - new_tokens
    state = states.get(slot)
    if not _continues(state, tensors[0], past):
        state = owner.init_state(*(t[:, :, :past] for t in tensors)) if past else owner.init_state()
        states[slot] = state
    return state


@torch.compiler.disable(reason="sparse_io_attn: the selector's decode state lives in Python objects on the KV cache")
def select_with_state(module, selector, query: torch.Tensor, key: torch.Tensor, kwargs):
    """The selection (a :class:`Selection` or :class:`BlockSparseLayout`) of ``query [B, Hq, Nq, D]``
    against ``key [B, Hkv, Nk, D]`` (the cache after this call's append; the queries are its last
    ``Nq`` positions) through the selector's state on the model's cache, or ``None`` when this call
    has no usable cache (then the caller selects over the whole key cache)."""
    if not hasattr(selector, "step"):
        return None
    Nq, Nk = query.shape[2], key.shape[2]
    state = state_on_cache(module, selector, Nq, (key,), kwargs)
    return None if state is None else selector.step(query, key[:, :, Nk - Nq:], state)


__all__ = ["BATCH_MAPS", "INVALIDATING", "STATES_ATTR", "cache_states", "find_cache", "select_with_state",
           "state_on_cache", "watch_cache"]
