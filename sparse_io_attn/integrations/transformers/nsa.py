"""Native Sparse Attention in a Transformers model: ``config.sparse_attention =
"nsa:block=64,num_blocks=16,window=512"`` runs fla's NSA attention (``parallel_nsa``: compressed,
selected and sliding-window branches, gated) on the model's own post-RoPE queries, keys and values
(:class:`~sparse_io_attn.nn.nsa.NSAAttention`).

What NSA adds to an attention layer is one weight: the gate projection ``g_proj`` (fla's layer:
``Linear(hidden_size, 3 * num_heads, bias=False)``, row ``3h + j`` head ``h``'s gate ``j``: cmp, slc,
swa; the compression is fla's mean pooling, which has no weights). A checkpoint of plain attention
has none, and a fixed gate would be a model nobody trained, so ``"nsa:"`` needs them:
:func:`add_nsa_gates` gives every attention module whose layer runs ``"nsa:"`` a ``g_proj`` (new,
trainable, zero-initialised: every gate starts at ``sigmoid(0) = 1/2``; or load trained ones with
``load_state_dict``), and the hooks that hand the module's ``hidden_states`` to the attention
function. A module without gates raises ``ValueError`` naming both ways out: :func:`add_nsa_gates`,
or ``"nsa_selection:block=..,num_blocks=.."``, NSA's selection branch alone as the attention
function (no weights; a selector spec like ``"moba:..."``).

Decoding: the model's ``Cache`` keeps the keys and values; NSA's state (compressed keys and values
of the complete blocks, the raw tail: :class:`~sparse_io_attn.nn.nsa_cache.NSAState`) is kept on the
same ``Cache`` object as the selectors' (``decode_state.py``), so a step reads the compressed blocks,
its selected blocks and its window. Calls that need gradients, or find no cache, compute from the
whole ``key``/``value`` instead (same result).

Element masks: a padded or packed batch's prefill (or training forward) whose mask is exactly its
sequences, each causal from its first token (left or right padding, packed documents), runs as one
packed call (:meth:`NSAAttention.packed`, ``cu_seqlens``: compression blocks, selection and window
restart at each sequence's start, as each sequence alone); rows in no sequence get 0. Not supported
(``NotImplementedError``): any other element mask (decoding a padded batch from the cache, a static
cache, a model's own window).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sparse_io_attn.integrations.transformers.config import module_pattern
from sparse_io_attn.integrations.transformers import decode_state
from sparse_io_attn.integrations.transformers.layouts import PackedRows, check_lengths, packed_sequences, runs_packed
from sparse_io_attn.nn.nsa import NSAAttention

#: the gate projection's attribute on an attention module (fla's name)
GATES = "g_proj"
_HIDDEN_ATTR = "_sparse_io_attn_hidden_states"
_HOOKED_ATTR = "_sparse_io_attn_gate_hooks"


def _note_hidden(module, args, kwargs):
    """Forward pre-hook: the hidden states this forward of the attention module projects."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    setattr(module, _HIDDEN_ATTR, hidden)
    return None


def _forget_hidden(module, args, output):
    setattr(module, _HIDDEN_ATTR, None)
    return None


def _runs_nsa(module) -> bool:
    if getattr(module, "config", None) is None or not hasattr(module, "layer_idx") \
            or not isinstance(getattr(module, "q_proj", None), nn.Linear):
        return False
    return isinstance(module_pattern(module).selector, NSAAttention)


def add_nsa_gates(model: nn.Module) -> list[str]:
    """Give every attention module of ``model`` whose layer runs ``"nsa:..."`` NSA's gate projection
    ``g_proj = Linear(hidden_size, 3 * num_attention_heads, bias=False)`` (zero-initialised, on the
    module's device and dtype; an existing ``g_proj`` of that shape is kept) and the hooks that pass
    its hidden states to the attention function. Call it after building the model and before loading
    a state dict that holds trained gates. Returns the modules' names; ``ValueError`` when no module
    runs ``"nsa:"`` or a ``g_proj`` of another shape is in the way."""
    names = []
    for name, module in model.named_modules():
        if not _runs_nsa(module):
            continue
        q_proj = module.q_proj
        hidden, heads = q_proj.in_features, module.config.num_attention_heads
        gate = getattr(module, GATES, None)
        if gate is None:
            gate = nn.Linear(hidden, 3 * heads, bias=False, device=q_proj.weight.device, dtype=q_proj.weight.dtype)
            nn.init.zeros_(gate.weight)
            setattr(module, GATES, gate)
        elif not isinstance(gate, nn.Linear) or (gate.in_features, gate.out_features) != (hidden, 3 * heads):
            raise ValueError(f"add_nsa_gates: {name}.{GATES} exists and is not a Linear({hidden}, {3 * heads}) "
                             f"(got {gate!r}); NSA's gates need that attribute")
        if not getattr(module, _HOOKED_ATTR, False):
            module.register_forward_pre_hook(_note_hidden, with_kwargs=True)
            module.register_forward_hook(_forget_hidden, always_call=True)
            setattr(module, _HOOKED_ATTR, True)
        decode_state.watch_cache(module)            # the first forward finds its cache
        names.append(name)
    if not names:
        raise ValueError("add_nsa_gates: no attention module of this model runs 'nsa:...' (set "
                         "config.sparse_attention = 'nsa:block=..,num_blocks=..,window=..' before building the model, "
                         "or on its config before calling this)")
    return names


def _gates(module, query: torch.Tensor) -> torch.Tensor:
    """``sigmoid(g_proj(hidden_states))`` ``[B, Nq, Hq, 3]`` of this forward."""
    gate, hidden = getattr(module, GATES, None), getattr(module, _HIDDEN_ATTR, None)
    if not isinstance(gate, nn.Linear) or hidden is None:
        raise ValueError("sparse_io_attn: 'nsa:...' runs NSA's three gated branches and this attention module has "
                         "no gates: call sparse_io_attn.integrations.transformers.add_nsa_gates(model) (a new "
                         "trainable g_proj per layer, every gate 1/2 until trained or loaded), or use "
                         "'nsa_selection:block=..,num_blocks=..' for NSA's selection branch alone, which needs no "
                         "weights")
    B, Hq, Nq, _ = query.shape
    if tuple(hidden.shape[:2]) != (B, Nq):
        raise ValueError(f"sparse_io_attn: the attention module's hidden states {tuple(hidden.shape)} do not match "
                         f"its {Nq} queries of batch {B}")
    return gate(hidden).view(B, Nq, Hq, 3).sigmoid()


def nsa_forward(module, nsa: NSAAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], scaling: Optional[float], backend: str, kwargs):
    """The attention function's ``"nsa:"`` branch: ``(out [B, Nq, Hq, D], None)``."""
    check_lengths(query.shape[2], key.shape[2])
    if attention_mask is not None:
        packed = _packed_prefill(nsa, attention_mask, query, key, backend)
        return _packed_call(nsa, packed, query, key, value, _gates(module, query), scaling, backend), None
    gates = _gates(module, query)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, gates))
    state = None if grad or torch.compiler.is_compiling() else _state(module, nsa, query, key, value, kwargs)
    out = nsa(query, key, value, gates, state=state, sm_scale=scaling, backend=backend)
    return out.contiguous(), None


def _packed_prefill(nsa: NSAAttention, mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    backend: str) -> PackedRows:
    """The sequences of a masked prefill as one packed batch, or ``NotImplementedError`` saying why not."""
    if not runs_packed(backend, query.device):
        raise NotImplementedError(f"sparse_io_attn: 'nsa:...' under an element mask (padding, packed sequences) runs "
                                  f"the sequences packed with cu_seqlens, which backend {backend!r} does not take yet "
                                  f"on {query.device.type}; use backend 'cpu' or 'torch', or run unpadded batches")
    packed = packed_sequences(nsa.selector, mask, query, key) if query.shape[2] == key.shape[2] else None
    if packed is None or not torch.equal(packed.cu_q, packed.cu_k) or not torch.equal(packed.q_rows, packed.k_rows):
        raise NotImplementedError("sparse_io_attn: 'nsa:...' under this element mask is not supported: only a "
                                  "prefill whose mask is exactly its sequences (padding, packed documents), each causal "
                                  "from its first token, runs (packed, with cu_seqlens); not decoding a padded batch "
                                  "from the cache, a static cache or a model's own window. Run unpadded batches with "
                                  "the default dynamic cache, or use 'nsa_selection:...' (NSA's selection branch, "
                                  "which supports them)")
    return packed


def _packed_call(nsa: NSAAttention, packed: PackedRows, query, key, value, gates, scaling, backend) -> torch.Tensor:
    """NSA on the packed sequences (:meth:`NSAAttention.packed`); rows in no sequence get 0. ``[B, Nq, Hq, D]``."""
    B, Hq, q, _ = query.shape
    rows = packed.q_rows
    flat = lambda x: packed.gather(x, rows).transpose(0, 1)[None]  # noqa: E731   [1, H, total, D]
    o = nsa(flat(query), flat(key), flat(value), gates.reshape(B * q, Hq, 3)[rows][None], cu_seqlens=packed.cu_q,
            sm_scale=scaling, backend=backend)                                                  # [1, total, Hq, D]
    return packed.scatter(o[0], B, q)


@torch.compiler.disable(reason="sparse_io_attn: NSA's decode state lives in Python objects on the KV cache")
def _state(module, nsa, query, key, value, kwargs):
    return decode_state.state_on_cache(module, nsa, query.shape[2], (key, value), kwargs)


__all__ = ["GATES", "add_nsa_gates", "nsa_forward"]
