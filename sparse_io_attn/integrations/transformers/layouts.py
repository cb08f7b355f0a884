"""Layouts per call: the pattern on ``n`` positions (cached, shared by every model and layer), its
rows and columns for a KV-cache call (queries at absolute positions ``q_start..``, keys at
``kv_start..``), and its intersection with the model's element mask (padding, packed documents,
static caches, a model's own sliding window); a selector's choice under an element mask, made per
sequence (:func:`selection_layout_with_mask`), or, for a per-token selector whose mask is exactly its
sequences, the batch's sequences packed for one call with ``cu_seqlens`` (:func:`packed_sequences`).
Building is kept out of ``torch.compile`` graphs."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from sparse_io_attn._attention.checks import resolve_backend
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.integrations.transformers.config import CONFIG_ATTR, LayerPattern, layer_pattern, module_pattern
from sparse_io_attn.layout import patterns
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.selection import layout_from_selection
from sparse_io_attn.selection.op import FEATURES as SELECTION_FEATURES

_SQUARE_CACHE_SIZE = 64     # (pattern, n) -> square layout, shared by every model and layer (LRU)
_MODULE_CACHE_SIZE = 256    # (seqlen_q, seqlen_k, device) -> layout, per attention module (cleared when full)
_MODULE_CACHE_ATTR = "_sparse_io_attn_layouts"
_MODULE_RECENT_ATTR = "_sparse_io_attn_recent"   # the KV-cache keys (seqlen_q < seqlen_k) in the module's cache
_MODULE_RECENT_SIZE = 4     # KV-cache lengths a module keeps: a decode step's seqlen_k is new every token
#: (pattern, backend, seqlen_q, seqlen_k, device, causal) -> finished layout of a KV-cache call (seqlen_q < seqlen_k),
#: shared by every layer (LRU): each decode step has a new seqlen_k, built once for all layers of the step
_ROWS_CACHE_SIZE = 32

_SQUARE: "OrderedDict[tuple, Optional[BlockSparseLayout]]" = OrderedDict()
_ROWS: "OrderedDict[tuple, tuple]" = OrderedDict()


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


def _rows_layout(pat: LayerPattern, q_start: int, q: int, n: int) -> Optional[BlockSparseLayout]:
    """The pattern on ``n`` positions, rows ``[q_start, q_start + q)`` against all ``n`` keys (``seqlen
    (q, n)``; ``None``: dense). A spec string is built from those rows alone
    (``patterns.from_spec(..., rows=...)``: O(the blocks those rows keep), not O(n)); a callable
    pattern can only be asked for the whole ``(n, n)`` layout, whose rows are then taken."""
    if pat.is_dense:
        return None
    if isinstance(pat.pattern, str):
        return patterns.from_spec(pat.pattern, n, pat.block_size, rows=(q_start, q_start + q))
    square = _square_layout(pat, n)
    return None if square is None else square.rows(q_start, q_start + q)


def _window_layout(pat: LayerPattern, q_start: int, kv_start: int, q: int, kv: int) -> Optional[BlockSparseLayout]:
    """The pattern's elements for query positions ``[q_start, q_start + q)`` against key positions
    ``[kv_start, kv_start + kv)`` (``seqlen (q, kv)``), or ``None`` for dense. The pattern is the one on
    ``n = max(q_start + q, kv_start + kv)`` positions: a prefill (``q == kv == n``) uses the cached
    square layout, other calls (decode steps, chunked prefill, static caches) the rows of their
    queries, built from those rows alone (:func:`_rows_layout`)."""
    n = max(q_start + q, kv_start + kv)
    if q_start == 0 and kv_start == 0 and q == n and kv == n:
        return _square_layout(pat, n)
    rows = _rows_layout(pat, q_start, q, n)
    if rows is None or (kv_start == 0 and kv == n):
        return rows
    return BlockSparseLayout.from_dense_mask(rows.to_dense_mask()[0, :, :, kv_start:kv_start + kv],
                                             rows.block_size, name=f"{rows.name}[:,{kv_start}:]")


def pattern_layout(config, seqlen: int, layer_idx: int = 0) -> Optional[BlockSparseLayout]:
    """The layout layer ``layer_idx`` uses for a prefill of ``seqlen`` tokens, before the model's
    causality is applied (``None``: dense). For printing and for building reference masks."""
    return _square_layout(layer_pattern(config, layer_idx), int(seqlen))


def _finish(layout: BlockSparseLayout, device: torch.device, causal) -> BlockSparseLayout:
    """The layout on ``device``, validated and planned under ``causal`` once, outside any trace (the
    attention call finds the plan cached on the layout)."""
    layout = layout.to(device)
    plan(layout, causal=causal)
    return layout


def layout_no_mask(module, q: int, kv: int, device: torch.device, causal="bottom_right"):
    """``(layout, backend)`` for a call without an element mask, cached on the module (a KV-cache
    call's only for the module's last few such lengths, :func:`_build_no_mask`)."""
    cache = getattr(module, _MODULE_CACHE_ATTR, None)
    if cache is not None:
        hit = cache.get((q, kv, str(device), causal))
        if hit is not None:
            return hit
    return _build_no_mask(module, q, kv, device, causal)


@torch.compiler.disable(reason="sparse_io_attn: building a layout for a new sequence length is data-dependent; "
                        "run one eager forward per length before torch.compile(..., fullgraph=True)")
def _build_no_mask(module, q: int, kv: int, device: torch.device, causal):
    """The queries are the last ``q`` of ``kv`` positions (bottom-right). A KV-cache call (``q < kv``:
    a decode step) builds the rows ``[kv - q, kv)`` only, O(the blocks they keep), never the ``kv x kv``
    pattern, once for all layers of the step (the shared LRU ``_ROWS``); each module keeps only its
    last ``_MODULE_RECENT_SIZE`` such lengths (one eager call per length before ``torch.compile``
    still finds its layout there), so one-off decode lengths do not fill its cache."""
    check_lengths(q, kv)
    pat = module_pattern(module)
    key = (q, kv, str(device), causal)
    shared = (pat.key, pat.backend, *key)
    if q < kv and shared in _ROWS:
        _ROWS.move_to_end(shared)
        return _remember_recent(module, key, _ROWS[shared])
    layout = _window_layout(pat, kv - q, 0, q, kv)
    if layout is None:
        layout = patterns.dense((q, kv), pat.block_size)
    entry = (_finish(layout, device, causal), pat.backend)
    if q == kv:
        return _remember(module, key, entry)
    _ROWS[shared] = entry
    while len(_ROWS) > _ROWS_CACHE_SIZE:
        _ROWS.popitem(last=False)
    return _remember_recent(module, key, entry)


def _remember(module, key, value):
    """Store ``value`` in the module's cache (started afresh when full); returns ``value``."""
    cache = getattr(module, _MODULE_CACHE_ATTR, None)
    if cache is None or len(cache) >= _MODULE_CACHE_SIZE:
        cache = {}
        setattr(module, _MODULE_CACHE_ATTR, cache)
    cache[key] = value
    return value


def _remember_recent(module, key, value):
    """:func:`_remember` a KV-cache call's ``value``, dropping the module's oldest such entry beyond
    ``_MODULE_RECENT_SIZE``; returns ``value``."""
    _remember(module, key, value)
    recent = getattr(module, _MODULE_RECENT_ATTR, None)
    if recent is None:
        recent = deque()
        setattr(module, _MODULE_RECENT_ATTR, recent)
    recent.append(key)
    while len(recent) > _MODULE_RECENT_SIZE:
        getattr(module, _MODULE_CACHE_ATTR).pop(recent.popleft(), None)
    return value


def module_selector(module, causal):
    """``(selector, backend)``: the module's selector (``config.sparse_attention`` such as
    ``"moba:block=64,top_k=8"`` or ``"pooled_topk:block=64,top_k=8"``) with the model's causality, or
    ``None`` for a static pattern, and the backend its attention runs on (cached on the module)."""
    cache = getattr(module, _MODULE_CACHE_ATTR, None)
    key = ("selector", causal)
    if cache is not None and key in cache:
        return cache[key]
    return _build_selector(module, causal)


@torch.compiler.disable(reason="sparse_io_attn: reading config.sparse_attention; run one eager forward before "
                        "torch.compile(..., fullgraph=True)")
def _build_selector(module, causal):
    pat = module_pattern(module)
    selector = pat.selector
    if selector is not None:
        try:
            selector = selector.with_causal(causal)
        except ValueError as exc:
            raise ValueError(f"config.{CONFIG_ATTR}: {exc} (this model's attention is not causal)") from None
        if selector.per_token and getattr(module, "sliding_window", None) is not None:
            raise NotImplementedError(f"config.{CONFIG_ATTR}: {selector!r} under the model's own sliding window "
                                      f"({module.sliding_window}) has no reference semantics (its blocks and scores "
                                      f"see the whole sequence); set sliding_window=None on the config, or use "
                                      f"'pooled_topk:...'")
    return _remember(module, ("selector", causal), (selector, pat.backend))


def check_lengths(q: int, kv: int) -> None:
    """Self-attention with a KV cache has at least as many keys as queries (``ValueError`` otherwise)."""
    if kv < q:
        raise ValueError(f"sparse_io_attn: {q} queries and only {kv} keys; self-attention with a KV cache "
                         f"has seqlen_k >= seqlen_q")


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
def layout_with_mask(module, mask: torch.Tensor, q: int, kv: int, position_ids, device: torch.device):
    """``(layout, backend)`` for a call with the model's element mask: ``mask & pattern`` as a per-batch
    layout, planned once per mask for all layers sharing a pattern."""
    pat = module_pattern(module)
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
    entry = (_finish(layout, device, False), pat.backend)
    per_mask[key] = entry
    return entry


def _sequences(selector, allowed: torch.Tensor, pos: torch.Tensor, causal: bool) -> list[list[tuple]]:
    """Per batch element, its query rows' sequences ``(r0, r1, a, end)``: rows ``r0..r1 - 1`` are
    consecutive tokens of one sequence whose keys are ``a..end - 1`` (its written tokens: a padded
    row's real keys, a packed document, a static cache's filled slots), what the selector sees.

    A row belongs to a sequence iff it sees its own position (the pad rows of right padding, which
    do not, belong to none and attend nothing). Causal: a sequence starts at the first allowed key
    ``a`` of its first row and ends at its last row's position; a row whose first allowed key is its
    own position starts a new one (a packed document); a row that starts its keys later than its
    sequence (a model's own sliding window) stays in it for a layout selector and is refused for a
    per-token one (no reference semantics). Not causal: the rows allowing the same keys ``a..e``."""
    q, kv = allowed.shape[1:]
    live = allowed.any(-1)
    as_int = allowed.to(torch.int8)
    first = torch.where(live, as_int.argmax(-1), -1)
    last = torch.where(live, kv - 1 - as_int.flip(-1).argmax(-1), -1)
    inside = (pos >= 0) & (pos < kv)
    own = allowed.gather(-1, pos.clamp(0, kv - 1).expand(allowed.shape[0], q)[..., None])[..., 0] & inside
    if causal and bool((live & (last > pos)).any()):
        raise NotImplementedError(f"sparse_io_attn: {selector!r} under an attention mask that lets a query see a "
                                  f"key after its own position is not supported (this selector is causal)")
    positions = pos.tolist()
    out = []
    for b, (own_b, first_b, last_b) in enumerate(zip(own.tolist(), first.tolist(), last.tolist())):
        seqs, cur = [], None                      # cur: [r0, r1, a, end]
        for r in range(q):
            a, p, end = first_b[r], positions[r], (positions[r] if causal else last_b[r]) + 1
            if not own_b[r]:
                cur = None
            elif cur is not None and (cur[2] <= a < p if causal else (a, end) == (cur[2], cur[3])):
                if a != cur[2] and selector.per_token:
                    raise NotImplementedError(_not_one_sequence(selector, b, r, a, cur[2], p))
                cur[1], cur[3] = r + 1, end
            elif cur is not None and causal and a != p:
                raise NotImplementedError(_not_one_sequence(selector, b, r, a, cur[2], p))
            else:
                cur = [r, r + 1, a, end]
                seqs.append(cur)
        out.append([tuple(x) for x in seqs])
    return out


def _not_one_sequence(selector, b: int, r: int, a: int, start: int, p: int) -> str:
    return (f"sparse_io_attn: {selector!r} under this attention mask: query row {r} of batch element {b} starts "
            f"its keys at {a}, not at its sequence's start {start} nor at its own position {p}, so its keys are "
            f"not one sequence (a model's sliding window?); "
            + ("per-token selectors need causal masks of padded or packed sequences" if selector.per_token else
               "selectors need causal masks of padded, packed or windowed sequences"))


def _chosen_mask(selected, seqlen_q: int, seqlen_k: int, causal) -> torch.Tensor:
    """``bool [b or 1, heads, seqlen_q, seqlen_k]``: the elements a selector's result keeps."""
    if isinstance(selected, BlockSparseLayout):
        return selected.to_dense_mask()
    return layout_from_selection(selected, seqlen_k, block_size_q=seqlen_q, causal=causal).to_dense_mask()


@torch.compiler.disable(reason="sparse_io_attn: a selection under a padded, packed or static-cache mask is made "
                        "per sequence and becomes a per-batch layout (data-dependent)")
def selection_layout_with_mask(selector, mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               block_size) -> BlockSparseLayout:
    """The layout of a selector's choice (a per-token :class:`~sparse_io_attn.Selection`, e.g. exact
    MoBA, or a pooled top-k layout) under the model's element mask: the selector runs on each
    sequence alone (:func:`_sequences`: a padded row's real tokens, a packed document, a static
    cache's written slots; its query rows and its keys only, bottom-right), as the reference does
    per sequence of a varlen batch (MoBA's ``cu_seqlens``: chunks, and pooled top-k's query and key
    blocks, restart at every sequence start), and the choice is intersected with the mask element
    by element. So a sequence's output equals the same sequence run alone, without padding, packing
    or a static cache. Batch elements with the same sequences share one selector call.

    Refused (``NotImplementedError``): for a causal selector, a mask whose rows allow a key after the
    row's own position; for a per-token selector, one whose rows do not follow a sequence (a model's
    own sliding window); per-head masks. Cost: one ``bool [B, H, Nq, Nk]`` element mask per call (``H``
    the selection's heads: ``Hq`` for MoBA, ``Hkv`` for pooled top-k), and one selector call per
    distinct sequence."""
    q, kv, B = query.shape[2], key.shape[2], query.shape[0]
    allowed = _element_mask(mask, q, kv)
    if allowed.shape[1] != 1:
        raise NotImplementedError(f"sparse_io_attn: {selector!r} under a per-head attention mask "
                                  f"({allowed.shape[1]} heads) is not supported; pass a mask shared by the heads")
    allowed = allowed[:, 0].expand(B, q, kv).to(query.device)
    q_offset, kv_offset, _ = _MASK_INFO.get(mask, (kv - q, 0, False))
    pos = torch.arange(q, device=query.device) + (int(q_offset) - int(kv_offset))   # key index of each row
    causal = selector.causal is not False
    if causal and hasattr(selector, "with_causal"):
        selector = selector.with_causal("bottom_right")     # each sequence's rows are its last tokens
    groups: dict = {}
    for b, seqs in enumerate(_sequences(selector, allowed, pos, causal)):
        for seq in seqs:
            groups.setdefault(seq, []).append(b)
    chosen = None          # bool [B, H, q, kv], H the selection's heads (Hq for MoBA, Hkv for pooled top-k)
    for (r0, r1, a, end), batch in groups.items():
        idx = torch.tensor(batch, device=query.device)
        rows = _chosen_mask(selector(query[idx, :, r0:r1], key[idx, :, a:end]), r1 - r0, end - a,
                            "bottom_right" if causal else False)
        if chosen is None:
            chosen = torch.zeros(B, rows.shape[1], q, kv, dtype=torch.bool, device=query.device)
        chosen[idx, :, r0:r1, a:end] = rows
    if chosen is None:     # no row in any sequence: nothing to attend
        chosen = torch.zeros(B, 1, q, kv, dtype=torch.bool, device=query.device)
    layout = BlockSparseLayout.from_dense_mask(chosen & allowed[:, None], block_size, name=f"{selector!r} & mask")
    plan(layout, causal=False)
    return layout


class PackedRows(NamedTuple):
    """A padded, packed or static-cache batch's sequences as one packed batch (:func:`packed_sequences`):
    the flat query rows (``b * q + r``) and keys (``b * kv + s``) of every sequence in order, and their
    ``cu_seqlens`` (int32, queries and keys)."""
    q_rows: torch.Tensor
    k_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @staticmethod
    def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x [B, H, N, D]``'s flat rows ``rows`` (``b * N + t``) as ``[total, H, D]``."""
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[rows]

    def scatter(self, out: torch.Tensor, batch: int, q: int) -> torch.Tensor:
        """``out [total, H, D]`` of the packed query rows back to ``[batch, q, H, D]``; rows in no
        sequence (right padding) get 0."""
        full = out.new_zeros(batch * q, *out.shape[1:])
        return full.index_copy(0, self.q_rows, out).view(batch, q, *out.shape[1:])


@torch.compiler.disable(reason="sparse_io_attn: the sequences of a padded or packed batch are read from its mask "
                        "(data-dependent)")
def runs_packed(backend: str, device: torch.device) -> bool:
    """Whether ``selection_attention``'s backend takes ``cu_seqlens`` (``cpu``, ``torch`` and ``triton`` do;
    a backend without it would take the per-sequence path)."""
    return "cu_seqlens" in SELECTION_FEATURES.get(resolve_backend(backend, device), ())


def packed_sequences(selector, mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Optional[PackedRows]:
    """The sequences (:func:`_sequences`) of a causal per-token selector's call under the model's
    element mask as one packed batch, when the mask is exactly those sequences (each of their rows
    allows its sequence's keys up to its own position, nothing else): then one selector call and one
    ``selection_attention`` call with ``cu_seqlens`` (bottom-right per sequence) compute what
    :func:`selection_layout_with_mask` computes with one selector call per sequence and a dense
    layout. ``None`` otherwise (a model's own window inside a sequence, a per-head mask, a non-causal
    selector): the caller takes the per-sequence path."""
    if not getattr(selector, "per_token", False) or selector.causal is False:
        return None
    q, kv, B = query.shape[2], key.shape[2], query.shape[0]
    allowed = _element_mask(mask, q, kv)
    if allowed.shape[1] != 1:
        return None
    allowed = allowed[:, 0].expand(B, q, kv).to(query.device)
    q_offset, kv_offset, _ = _MASK_INFO.get(mask, (kv - q, 0, False))
    pos = torch.arange(q, device=query.device) + (int(q_offset) - int(kv_offset))
    try:
        seqs = _sequences(selector, allowed, pos, True)
    except NotImplementedError:
        return None
    expect = torch.zeros_like(allowed)
    q_rows, k_rows, cu_q, cu_k = [], [], [0], [0]
    for b, parts in enumerate(seqs):
        for r0, r1, a, end in parts:
            keys = torch.arange(kv, device=query.device)
            expect[b, r0:r1] = (keys >= a) & (keys <= pos[r0:r1, None])
            q_rows.append(torch.arange(b * q + r0, b * q + r1, device=query.device))
            k_rows.append(torch.arange(b * kv + a, b * kv + end, device=query.device))
            cu_q.append(cu_q[-1] + r1 - r0)
            cu_k.append(cu_k[-1] + end - a)
    rows = torch.zeros(B, q, dtype=torch.bool, device=query.device)
    for b, parts in enumerate(seqs):
        for r0, r1, _, _ in parts:
            rows[b, r0:r1] = True
    if not q_rows or not torch.equal(expect[rows], allowed[rows]):
        return None
    as_cu = lambda c: torch.tensor(c, dtype=torch.int32, device=query.device)  # noqa: E731
    return PackedRows(torch.cat(q_rows), torch.cat(k_rows), as_cu(cu_q), as_cu(cu_k))


@torch.compiler.disable(reason="sparse_io_attn: remembering the offsets of a materialized mask")
def remember_mask(mask: torch.Tensor, q_offset, kv_offset, maybe_packed: bool) -> torch.Tensor:
    """Record where ``mask``'s queries and keys sit (and whether it may be one of packed sequences)
    for :func:`layout_with_mask`; returns ``mask``."""
    _MASK_INFO[mask] = (int(q_offset), int(kv_offset), bool(maybe_packed))
    return mask


def reset_layouts(model: Optional[torch.nn.Module] = None) -> None:
    """Forget cached layouts (call after changing ``config.sparse_attention`` of a model that already
    ran): the shared pattern and KV-cache row caches, and the per-module caches of ``model``'s
    attention modules."""
    _SQUARE.clear()
    _ROWS.clear()
    if model is not None:
        for m in model.modules():
            for attr in (_MODULE_CACHE_ATTR, _MODULE_RECENT_ATTR):
                if attr in m.__dict__:
                    delattr(m, attr)
