"""Block-sparse attention as a Hugging Face Transformers ``attn_implementation``.

Needs ``transformers>=5`` (the optional extra ``hf``: ``pip install "sparse-io-attn[hf]"``). Importing
:mod:`sparse_io_attn` does not import this module or Transformers.

Recipe::

    from transformers import AutoModelForCausalLM, LlamaConfig
    from sparse_io_attn.integrations import transformers as sia_hf

    sia_hf.register()                                     # attn_implementation "sparse_io_attn"
    config = LlamaConfig(..., sparse_attention={"pattern": "sliding_window:window=256", "block_size": 64})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_io_attn")

:func:`register` adds :func:`sparse_io_attn_forward` to ``transformers.AttentionInterface`` and
:func:`sparse_io_attn_mask` to ``transformers.masking_utils.AttentionMaskInterface`` (Transformers 5
builds masks per implementation). Every model whose attention goes through the interface (Llama,
Mistral, Qwen2, Qwen3 and most decoder-only models of Transformers 5) then trains, evaluates and
generates with :func:`sparse_io_attn.nn.block_sparse_attention_op`: the ``torch.library`` custom op,
so ``torch.compile`` keeps the attention call in its graph.

Where the pattern comes from: ``config.sparse_attention`` (on the config the attention modules
hold: the text config of a multimodal model). Accepted forms:

* missing or ``None``: dense attention. With the model's causality this is exactly what ``"sdpa"``
  and ``"eager"`` compute (fp32 results agree to rounding).
* a spec string (``"sliding_window:window=256"``; grammar in :mod:`sparse_io_attn.layout.patterns`,
  ``"dense"`` means dense), with the default block size :data:`DEFAULT_BLOCK_SIZE`.
* a dict ``{"pattern": <spec or callable or per-layer list>, "block_size": 64 or (64, 32),
  "backend": "auto" | "cpu" | "torch" | "triton"}``. Strings, numbers and lists keep the config
  serialisable (``save_pretrained``); a callable does not.
* a callable ``(seqlen_q, seqlen_k, layer_idx) -> BlockSparseLayout | None`` (``None``: dense for
  that layer and length). It is called with ``seqlen_q == seqlen_k == n``, the number of positions
  covered so far, and must return a layout with ``seqlen == (n, n)``, its elements in absolute
  positions (``patterns.*`` builders with the pair ``(n, n)`` do exactly this).
* a list with one entry per layer (``len == config.num_hidden_layers``), each ``None``, a spec,
  a callable or a dict without list: models alternating dense and sparse layers.

Semantics (element-exact, see :class:`~sparse_io_attn.BlockSparseLayout`):

* The pattern is defined on absolute positions: element ``(i, j)`` is query position ``i`` and key
  position ``j`` of the sequence as the cache stores it (``0`` is the first slot of the batch row,
  left padding included: translation-invariant patterns such as ``sliding_window`` are unaffected
  by left padding, patterns with absolute positions such as global tokens are shifted by it). A
  layer attends to exactly the elements the pattern allows **and** the model's own mask allows:
  its causality (``module.is_causal``), padding, packed documents and any built-in sliding window
  of the model (``config.sliding_window`` of Mistral/Qwen; Transformers' window ``w`` is the
  pattern ``sliding_window:window=<w - 1>`` intersected with causality). The pattern never widens
  what the model's mask allows.
* Layouts are built lazily per sequence length (and per batch mask when one is needed), cached per
  device, index-checked once, and reused by every layer sharing a pattern; building is excluded from
  ``torch.compile`` (``torch.compiler.disable``) like :class:`~sparse_io_attn.nn.SparseSelfAttention`.
* No padding, no packing, plain causal model (the common training and generation case): no element
  mask is created at all. Prefill runs the pattern's layout with causal alignment; each decode step
  (``seqlen_q < seqlen_k``, KV cache) runs ``layout.rows(seqlen_k - seqlen_q, seqlen_k)`` of the
  ``(seqlen_k, seqlen_k)`` layout with ``causal="bottom_right"``.
* Padding (a 2-D ``attention_mask`` with zeros), packed sequences (``position_ids`` restarting at 0,
  no ``attention_mask``: Transformers' packing detection), static caches and models with a built-in
  sliding window: :func:`sparse_io_attn_mask` returns the model's boolean element mask
  ``[B, 1, seqlen_q, seqlen_k]`` (what ``"sdpa"`` gets) and remembers where its queries and keys
  sit, and the layer's layout is ``BlockSparseLayout.from_dense_mask(mask & pattern)``: per-batch
  element masks (``layout_batch = B``), so padded keys are never read. Query rows with no allowed
  key (left padding) output 0. This path builds the ``B x seqlen_q x seqlen_k`` mask like
  ``"sdpa"`` does, once per forward for all layers sharing a pattern.
* ``torch.compile``: without an element mask the attention of every layer is one custom-op node
  (``fullgraph=True`` works once one eager forward per sequence length has built the layouts).
  Turning an element mask into a layout is data-dependent: a graph break per layer (results stay
  exact). Note that Transformers cannot detect packing while tracing, so a compiled call without
  a cache (``use_cache=False``) always builds an element mask; keep the default ``use_cache=True``
  (or pass a cache), and express a model's sliding window as the pattern (``sliding_window=None``
  on the config) to stay graph-break free.
* Packed sequences: each document gets the pattern as if it were alone (its positions restart at
  0), intersected with the document-causal mask. Without a pattern this is
  ``patterns.document(cu_seqlens, block_size, causal=True)`` exactly.
* A 4-D mask passed by the caller is used as the element mask (boolean, or additive float with
  only ``0`` and ``-inf``/dtype-min values), its queries taken as the last ``seqlen_q`` positions.
* Not supported (raise ``NotImplementedError``): attention dropout > 0, ``softcap``, attention
  sinks (``s_aux``), additive position biases, paged caches (continuous batching);
  ``output_attentions=True`` returns no weights (as ``"sdpa"``).

Change ``config.sparse_attention`` after a forward only with :func:`reset_layouts` afterwards.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("sparse_io_attn.integrations.transformers needs Hugging Face Transformers >= 5: "
                      "pip install 'sparse-io-attn[hf]' (or pip install 'transformers>=5')") from exc

from sparse_io_attn.block_sparse.api import BACKENDS
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.nn.ops import block_sparse_attention_op

__all__ = ["register", "sparse_io_attn_forward", "sparse_io_attn_mask", "LayerPattern", "layer_pattern",
           "pattern_layout", "reset_layouts", "DEFAULT_NAME", "DEFAULT_BLOCK_SIZE", "CONFIG_ATTR"]

DEFAULT_NAME = "sparse_io_attn"
#: block size of spec strings and dense layers when the config gives none
DEFAULT_BLOCK_SIZE = 64
#: the config attribute holding the pattern
CONFIG_ATTR = "sparse_attention"

_SQUARE_CACHE_SIZE = 64     # (pattern, n) -> square layout, shared by every model and layer (LRU)
_MODULE_CACHE_SIZE = 256    # (seqlen_q, seqlen_k, device) -> layout, per attention module (cleared when full)
_MODULE_CACHE_ATTR = "_sparse_io_attn_layouts"
_DICT_KEYS = {"pattern", "block_size", "backend"}

def _check_version() -> None:
    major = int(str(_transformers.__version__).split(".")[0])
    if major < 5:
        raise ImportError(f"sparse_io_attn.integrations.transformers needs transformers >= 5, found "
                          f"{_transformers.__version__}: pip install 'sparse-io-attn[hf]'")


# ---------------------------------------------------------------------------------------- patterns
@dataclass(frozen=True)
class LayerPattern:
    """The resolved pattern of one layer: ``pattern`` is ``None`` (dense), a spec string or a
    callable ``(seqlen_q, seqlen_k, layer_idx) -> layout``."""

    pattern: Any
    block_size: tuple[int, int]
    backend: str
    layer_idx: Optional[int]

    @property
    def is_dense(self) -> bool:
        return self.pattern is None

    @property
    def key(self) -> tuple:
        """Layers with equal keys get the same layouts (a callable is also keyed by its layer)."""
        layer = self.layer_idx if callable(self.pattern) else None
        return (self.pattern, self.block_size, layer)


def _unpack(raw: dict, block_size, backend, where: str):
    """A dict entry -> ``(pattern, block_size, backend)``, its missing keys from the defaults given."""
    unknown = set(raw) - _DICT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; accepted: {sorted(_DICT_KEYS)}")
    return raw.get("pattern"), raw.get("block_size", block_size), raw.get("backend", backend)


def _entry(raw, block_size, backend, where: str):
    """One layer's entry -> ``(pattern, block_size, backend)``."""
    if isinstance(raw, dict):
        raw, block_size, backend = _unpack(raw, block_size, backend, where)
        if isinstance(raw, (list, tuple, dict)):
            raise ValueError(f"{where}: a per-layer entry cannot hold another list or dict")
    try:
        block_size = as_pair(block_size, "block_size")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    if raw is None:
        return None, block_size, backend
    if isinstance(raw, str):
        spec = raw.strip()
        if spec == "dense":
            return None, block_size, backend
        try:
            patterns.parse_spec(spec)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return spec, block_size, backend
    if callable(raw):
        return raw, block_size, backend
    raise TypeError(f"{where}: expected None, a pattern spec string (e.g. 'sliding_window:window=256'), a "
                    f"callable (seqlen_q, seqlen_k, layer_idx) -> BlockSparseLayout, a dict "
                    f"{{'pattern': ..., 'block_size': ...}} or a per-layer list; got {type(raw).__name__}")


def layer_pattern(config, layer_idx: Optional[int] = None) -> LayerPattern:
    """Resolve ``config.sparse_attention`` for layer ``layer_idx`` (see the module docstring)."""
    raw = getattr(config, CONFIG_ATTR, None)
    where = f"config.{CONFIG_ATTR}"
    block_size, backend = DEFAULT_BLOCK_SIZE, "auto"
    if isinstance(raw, dict):
        raw, block_size, backend = _unpack(raw, block_size, backend, where)
    if isinstance(raw, (list, tuple)):
        n_layers = getattr(config, "num_hidden_layers", None)
        if n_layers is not None and len(raw) != n_layers:
            raise ValueError(f"{where}: a per-layer list needs one entry per layer ({n_layers}), got {len(raw)}")
        if layer_idx is None:
            raise ValueError(f"{where} is a per-layer list but the attention module has no layer_idx")
        if not 0 <= layer_idx < len(raw):
            raise ValueError(f"{where}: layer_idx {layer_idx} is outside the per-layer list of {len(raw)}")
        where = f"{where}[{layer_idx}]"
        raw = raw[layer_idx]
    pattern, block_size, backend = _entry(raw, block_size, backend, where)
    return LayerPattern(pattern, block_size, backend, layer_idx)


_SQUARE: "OrderedDict[tuple, Optional[BlockSparseLayout]]" = OrderedDict()


def _square_layout(pat: LayerPattern, n: int) -> Optional[BlockSparseLayout]:
    """The pattern on ``n`` positions, ``seqlen (n, n)`` (``None``: dense), cached (LRU)."""
    if pat.is_dense:
        return None
    key = (pat.key, n)
    if key in _SQUARE:
        _SQUARE.move_to_end(key)
        return _SQUARE[key]
    if isinstance(pat.pattern, str):
        layout = patterns.from_spec(pat.pattern, n, pat.block_size)
    else:
        layout = pat.pattern(n, n, pat.layer_idx)
        if layout is not None:
            if not isinstance(layout, BlockSparseLayout):
                raise TypeError(f"config.{CONFIG_ATTR}: the callable must return a BlockSparseLayout or None, "
                                f"got {type(layout).__name__}")
            if layout.seqlen != (n, n):
                raise ValueError(f"config.{CONFIG_ATTR}: the callable was asked for ({n}, {n}) positions and "
                                 f"returned a layout with seqlen {layout.seqlen}")
            if layout.layout_batch != 1:
                raise ValueError(f"config.{CONFIG_ATTR}: pattern layouts must be shared by the batch "
                                 f"(layout_batch 1), got {layout.layout_batch}")
    if layout is not None:
        layout = layout.to("cpu").check()
    _SQUARE[key] = layout
    while len(_SQUARE) > _SQUARE_CACHE_SIZE:
        _SQUARE.popitem(last=False)
    return layout


def _window_layout(pat: LayerPattern, q_start: int, kv_start: int, q: int, kv: int) -> Optional[BlockSparseLayout]:
    """The pattern's elements for query positions ``[q_start, q_start + q)`` against key positions
    ``[kv_start, kv_start + kv)`` (``seqlen (q, kv)``), or ``None`` for dense."""
    n = max(q_start + q, kv_start + kv)
    square = _square_layout(pat, n)
    if square is None:
        return None
    if q_start == 0 and kv_start == 0 and q == n and kv == n:
        return square
    rows = square.rows(q_start, q_start + q)
    if kv_start == 0 and kv == n:
        return rows
    return BlockSparseLayout.from_dense_mask(rows.to_dense_mask()[0, :, :, kv_start:kv_start + kv],
                                             square.block_size, name=f"{square.name}[{q_start}:,{kv_start}:]")


def pattern_layout(config, seqlen: int, layer_idx: int = 0) -> Optional[BlockSparseLayout]:
    """The layout layer ``layer_idx`` uses for a prefill of ``seqlen`` tokens, before the model's
    causality is applied (``None``: dense). For printing and for building reference masks."""
    return _square_layout(layer_pattern(config, layer_idx), int(seqlen))


def _finish(layout: BlockSparseLayout, device: torch.device) -> BlockSparseLayout:
    layout = layout.to(device).check()  # index ranges validated once, outside any trace
    layout.ccol_indices                 # the transposed copy backward needs, built outside any trace
    return layout


def _module_pattern(module) -> LayerPattern:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError("sparse_io_attn: the attention module has no .config; Transformers attention "
                         "modules keep theirs (set config.sparse_attention on it)")
    return layer_pattern(config, getattr(module, "layer_idx", None))


# ---------------------------------------------------------------------------------- layouts per call
def _layout_no_mask(module, q: int, kv: int, device: torch.device):
    """``(layout, backend)`` for a call without an element mask (cached on the module)."""
    cache = getattr(module, _MODULE_CACHE_ATTR, None)
    if cache is not None:
        hit = cache.get((q, kv, str(device)))
        if hit is not None:
            return hit
    return _build_no_mask(module, q, kv, device)


@torch.compiler.disable(reason="sparse_io_attn: building a layout for a new sequence length is data-dependent; "
                        "run one eager forward per length before torch.compile(..., fullgraph=True)")
def _build_no_mask(module, q: int, kv: int, device: torch.device):
    if kv < q:
        raise ValueError(f"sparse_io_attn: {q} queries and only {kv} keys; self-attention with a KV cache "
                         f"has seqlen_k >= seqlen_q")
    pat = _module_pattern(module)
    layout = _window_layout(pat, kv - q, 0, q, kv)   # queries are the last q positions (bottom-right)
    if layout is None:
        layout = patterns.dense((q, kv), pat.block_size)
    entry = (_finish(layout, device), pat.backend)
    cache = getattr(module, _MODULE_CACHE_ATTR, None)
    if cache is None or len(cache) >= _MODULE_CACHE_SIZE:
        cache = {}
        setattr(module, _MODULE_CACHE_ATTR, cache)
    cache[(q, kv, str(device))] = entry
    return entry


# mask tensor -> (q_offset, kv_offset, maybe_packed) recorded by sparse_io_attn_mask when the offsets
# are not the default (queries = the last keys) or the mask may be one of packed sequences
_MASK_INFO: WeakIdKeyDictionary = WeakIdKeyDictionary()
# mask tensor -> {(pattern key, q, kv, device, position_ids id): (layout, backend)}: one build per forward
_MASK_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _element_mask(mask: torch.Tensor, q: int, kv: int) -> torch.Tensor:
    """A 4-D boolean (or 0 / -inf additive) attention mask -> ``bool [b, h, q, kv]``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"sparse_io_attn: attention_mask must be a tensor or None, got {type(mask).__name__} "
                        f"(was the model's mask built for another attn_implementation?)")
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q, kv):
        raise ValueError(f"sparse_io_attn: expected an attention mask [batch, 1 or heads, {q}, {kv}], got "
                         f"{tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise NotImplementedError("sparse_io_attn: the additive attention mask carries a bias (values other "
                                      "than 0 and -inf); block-sparse attention takes a mask, not a bias")
        return allowed
    return mask != 0


def _packed_documents(position_ids, q: int, kv: int, offsets, allowed: torch.Tensor):
    """Document ids ``[b, n]`` when ``position_ids`` packs several sequences per row (each restarting at
    0, counting up by 1) and the mask keeps documents apart; else ``None``."""
    if not isinstance(position_ids, torch.Tensor) or q != kv or tuple(offsets) != (0, 0):
        return None
    pid = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if pid.shape[-1] != q or pid.shape[0] not in (1, allowed.shape[0]) or q < 2:
        return None
    pid = pid.to(allowed.device)
    starts = pid == 0
    if not bool(starts[:, 0].all()) or not bool(starts[:, 1:].any()):
        return None
    if not bool(((pid[:, 1:] - pid[:, :-1] == 1) | starts[:, 1:]).all()):
        return None
    doc = starts.cumsum(-1)
    same = doc[:, None, :, None] == doc[:, None, None, :]        # [b, 1, n, n]
    if bool((allowed & ~same).any()):
        return None   # the mask lets documents see each other: not packed as far as the model is concerned
    return doc


def _packed_pattern(pat: LayerPattern, doc: torch.Tensor) -> torch.Tensor:
    """``bool [b, h, n, n]``: each document's own pattern on its diagonal block."""
    b, n = doc.shape
    rows = []
    for r in range(b):
        ids = doc[r].cpu()
        bounds = [0] + (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist() + [n]
        parts = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            square = _square_layout(pat, e - s)
            parts.append((s, e, None if square is None else square.to_dense_mask()[0]))
        heads = max((m.shape[0] for _, _, m in parts if m is not None), default=1)
        out = torch.zeros(heads, n, n, dtype=torch.bool)
        for s, e, m in parts:
            out[:, s:e, s:e] = True if m is None else m
        rows.append(out)
    heads = max(x.shape[0] for x in rows)
    return torch.stack([x.expand(heads, n, n) for x in rows])


@torch.compiler.disable(reason="sparse_io_attn: a padded or packed batch turns its element mask into a "
                        "per-batch layout (data-dependent)")
def _layout_with_mask(module, mask: torch.Tensor, q: int, kv: int, position_ids, device: torch.device):
    pat = _module_pattern(module)
    key = (pat.key, q, kv, str(device), None if position_ids is None else id(position_ids))
    per_mask = _MASK_LAYOUTS.get(mask)
    if per_mask is None:
        per_mask = {}
        _MASK_LAYOUTS[mask] = per_mask
    hit = per_mask.get(key)
    if hit is not None:
        return hit
    allowed = _element_mask(mask, q, kv)
    q_offset, kv_offset, maybe_packed = _MASK_INFO.get(mask, (kv - q, 0, False))
    offsets = (q_offset, kv_offset)
    block_size, name = pat.block_size, "dense"
    if not pat.is_dense:
        doc = _packed_documents(position_ids, q, kv, offsets, allowed) if maybe_packed else None
        if doc is not None:
            extra = _packed_pattern(pat, doc)
            name = f"packed[{pat.pattern if isinstance(pat.pattern, str) else 'callable'}]"
        else:
            window = _window_layout(pat, offsets[0], offsets[1], q, kv)
            extra = None if window is None else window.to_dense_mask()
            if window is not None:
                block_size, name = window.block_size, window.name
        if extra is not None:
            allowed = allowed & extra.to(allowed.device)
    layout = BlockSparseLayout.from_dense_mask(allowed.contiguous(), block_size, name=f"{name} & mask")
    entry = (_finish(layout, device), pat.backend)
    per_mask[key] = entry
    return entry


# ------------------------------------------------------------------------------ the two interfaces
@torch.compiler.disable(reason="sparse_io_attn: remembering the offsets of a materialized mask")
def _remember(mask: torch.Tensor, q_offset, kv_offset, maybe_packed: bool) -> torch.Tensor:
    _MASK_INFO[mask] = (int(q_offset), int(kv_offset), bool(maybe_packed))
    return mask


def sparse_io_attn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                        mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                        allow_is_causal_skip: bool = True, **kwargs) -> Optional[torch.Tensor]:
    """The ``AttentionMaskInterface`` entry: ``None`` when the model's mask is plain causal with the
    queries at the end of the keys (no padding, no packing, dynamic cache): the layout and
    ``causal="bottom_right"`` then express it without any element mask. Otherwise the boolean element
    mask ``[batch, 1, q_length, kv_length]`` of ``sdpa_mask``, with its offsets remembered so the
    pattern lands on the right absolute positions."""
    from transformers import masking_utils as mu
    from transformers.utils.import_utils import is_tracing

    if mask_function is None:
        mask_function = mu.causal_mask_function
    if allow_is_causal_skip and mask_function is mu.causal_mask_function \
            and not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor) \
            and kv_offset == 0 and q_offset == kv_length - q_length:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if not is_tracing(padding) and bool(padding.all()):
            return None
    for k in ("allow_is_bidirectional_skip", "allow_is_causal_skip"):
        kwargs.pop(k, None)
    mask = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    # Transformers detects packed sequences (position_ids restarts) only without a 2-D mask
    maybe_packed = attention_mask is None and q_length == kv_length
    if maybe_packed or isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) \
            or (q_offset, kv_offset) != (kv_length - q_length, 0):
        # contiguous now, so that generate()'s .contiguous() returns this very tensor (the key)
        mask = _remember(mask.contiguous(), q_offset, kv_offset, maybe_packed)
    return mask


_UNSUPPORTED = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


def sparse_io_attn_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry: ``query [B, Hq, Nq, D]``, ``key/value [B, Hkv, Nk, D]`` ->
    ``(out [B, Nq, Hq, D], None)``. The layout comes from ``module.config.sparse_attention``
    (module docstring); ``attention_mask`` is ``None`` or the element mask of
    :func:`sparse_io_attn_mask`."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"sparse_io_attn does not support {what} ({name}=...); use "
                                      f"attn_implementation='eager' for this model")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError("sparse_io_attn does not support paged caches (continuous batching); "
                                  "use model.generate() with the default dynamic cache")
    if dropout:
        raise NotImplementedError(f"sparse_io_attn has no attention dropout (got {dropout}); set "
                                  f"config.attention_dropout = 0.0")
    if kwargs.get("output_attentions", False):
        warnings.warn("sparse_io_attn does not return attention weights (output_attentions=True); "
                      "use attn_implementation='eager' to get them", stacklevel=2)
    q, kv, device = query.shape[2], key.shape[2], query.device
    if attention_mask is None:
        layout, backend = _layout_no_mask(module, q, kv, device)
        causal_model = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = "bottom_right" if causal_model else False
    else:
        layout, backend = _layout_with_mask(module, attention_mask, q, kv, kwargs.get("position_ids"), device)
        causal = False  # the element mask carries the model's causality
    out = block_sparse_attention_op(query, key, value, layout, causal=causal, sm_scale=scaling, backend=backend)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = DEFAULT_NAME) -> str:
    """Register block-sparse attention under ``name`` in ``transformers.AttentionInterface`` (and in
    ``AttentionMaskInterface`` when the installed version routes mask creation per implementation).
    Idempotent; returns ``name`` for ``attn_implementation=``."""
    _check_version()
    if not isinstance(name, str) or not name or "/" in name or name in ("eager", "sdpa") \
            or name.startswith(("flash_attention", "flex_attention", "paged")):
        raise ValueError(f"register: choose a new attention name without '/' (not a built-in one), got {name!r}")
    from transformers import AttentionInterface

    AttentionInterface.register(name, sparse_io_attn_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - Transformers without per-implementation masks
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, sparse_io_attn_mask)
    return name


def reset_layouts(model: Optional[torch.nn.Module] = None) -> None:
    """Forget cached layouts (call after changing ``config.sparse_attention`` of a model that already
    ran): the shared pattern cache, and the per-module caches of ``model``'s attention modules."""
    _SQUARE.clear()
    if model is not None:
        for m in model.modules():
            if _MODULE_CACHE_ATTR in m.__dict__:
                delattr(m, _MODULE_CACHE_ATTR)
