"""Where a layer's pattern comes from: ``config.sparse_attention`` resolved per layer into a
:class:`LayerPattern` (``None`` dense, a spec string, a callable, a dict with ``block_size`` and
``backend``, or a per-layer list of those)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sparse_io_attn.block_sparse.api import BACKENDS
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.nn import selectors
from sparse_io_attn.nn.nsa import NSAAttention, is_nsa_spec

#: block size of spec strings and dense layers when the config gives none
DEFAULT_BLOCK_SIZE = 64
#: the config attribute holding the pattern
CONFIG_ATTR = "sparse_attention"

_DICT_KEYS = {"pattern", "block_size", "backend"}
#: objects that choose from the activations (what a selector spec or ``"nsa:..."`` resolves to)
SELECTOR_TYPES = selectors.SPEC_TYPES + (NSAAttention,)


@dataclass(frozen=True)
class LayerPattern:
    """The resolved pattern of one layer: ``pattern`` is ``None`` (dense), a spec string or a
    callable ``(seqlen_q, seqlen_k, layer_idx) -> layout``; ``selector`` (from a selector spec such as
    ``"moba:block=64,top_k=8"``, ``"pooled_topk:block=64,top_k=8"`` or
    ``"nsa_selection:block=64,num_blocks=16"``, or a :class:`~sparse_io_attn.nn.selectors.MoBASelector` /
    ``PooledTopKSelector`` / ``NSASelector``) chooses what each query attends from the activations at
    every forward, within the model's mask (the static ``pattern`` is then dense, ``block_size`` the
    selector's); an :class:`~sparse_io_attn.nn.nsa.NSAAttention` (``"nsa:block=..,num_blocks=..,window=.."``)
    replaces the attention by NSA's three gated branches."""

    pattern: Any
    block_size: tuple[int, int]
    backend: str
    layer_idx: Optional[int]
    selector: Optional[Any] = None

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
    if isinstance(raw, SELECTOR_TYPES) or selectors.is_spec(raw) or is_nsa_spec(raw):
        try:
            selector = raw if isinstance(raw, SELECTOR_TYPES) else \
                NSAAttention.from_spec(raw) if is_nsa_spec(raw) else selectors.from_spec(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return selector, (selector.block_size,) * 2, backend
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
                    f"selector spec (e.g. 'moba:block=64,top_k=8', 'pooled_topk:block=64,top_k=8' or "
                    f"'nsa_selection:block=64,num_blocks=16'), NSA ('nsa:block=64,num_blocks=16,window=512'), a "
                    f"callable (seqlen_q, seqlen_k, layer_idx) -> BlockSparseLayout, a dict "
                    f"{{'pattern': ..., 'block_size': ...}} or a per-layer list; got {type(raw).__name__}")


def layer_pattern(config, layer_idx: Optional[int] = None) -> LayerPattern:
    """Resolve ``config.sparse_attention`` for layer ``layer_idx``; ``ValueError``/``TypeError`` naming
    the entry (``config.sparse_attention[i]``) when it is not one of the accepted forms."""
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
    if isinstance(pattern, SELECTOR_TYPES):
        return LayerPattern(None, block_size, backend, layer_idx, selector=pattern)
    return LayerPattern(pattern, block_size, backend, layer_idx)


def module_pattern(module) -> LayerPattern:
    """The pattern of an attention module, from its ``config`` and ``layer_idx``."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError("sparse_io_attn: the attention module has no .config; Transformers attention "
                         "modules keep theirs (set config.sparse_attention on it)")
    return layer_pattern(config, getattr(module, "layer_idx", None))
