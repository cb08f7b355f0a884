"""The pieces of a layout before it is one: canonical element masks, CSR order, argument checks.

:func:`sparse_io_attn.layout.core.assemble` (the one constructor of element-exact layouts) is
:func:`canonical` then :func:`csr`; pattern builders and conversions hand it candidate blocks and
masks. Everything here works on tensors only (no layout object), so it sits below ``core``.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.layout import _bits
from sparse_io_attn.layout._csr import INDEX_DTYPE, coo_to_csr


def lead_dims(shape) -> tuple[int, int]:
    """``(layout_batch, layout_heads)`` of a mask's leading dims ``()``, ``(H,)`` or ``(B, H)``."""
    return (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0] if len(shape) == 1 else 1)


def inrange_words(r: torch.Tensor, c: torch.Tensor, block_size, seqlen) -> torch.Tensor:
    """Bit-packed masks with every in-range element of blocks ``(r, c)`` set, ``int32 [E, bq, W]``."""
    (bq, bk), (sq, sk) = block_size, seqlen
    W = _bits.num_words(bk)
    rows_ok = torch.arange(bq, device=r.device)[None, :] < (sq - r * bq)[:, None]          # [E, bq]
    cols = (sk - c * bk).clamp(max=bk)[:, None] - 32 * torch.arange(W, device=r.device)   # [E, W]
    word = (torch.ones((), dtype=torch.int64, device=r.device) << cols.clamp(0, 32)) - 1
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return torch.where(rows_ok[:, :, None], word[:, None, :], torch.zeros((), dtype=torch.int32, device=r.device))


def words_at(table_vals: torch.Tensor, masks: torch.Tensor, r, c, block_size, seqlen) -> torch.Tensor:
    """Element-mask words of blocks whose table entries are ``table_vals`` (-2 empty, -1 full, id)."""
    words = inrange_words(r, c, block_size, seqlen)
    words[table_vals == -2] = 0
    part = table_vals >= 0
    words[part] = masks[table_vals[part].to(torch.int64)]
    return words


def canonical(lid: torch.Tensor, r: torch.Tensor, c: torch.Tensor, words: torch.Tensor | None, *,
              partial: torch.Tensor | None, block_size, seqlen):
    """Candidate blocks with masks -> ``(lid, r, c, ids, masks)`` of the blocks kept, canonical.

    ``words`` (``int32 [P, bq, W]``, :mod:`._bits` format) are the masks of the entries where
    ``partial`` is True (all entries when ``partial`` is None); entries without words are full.
    Bits past the sequence ends are cleared, masks left empty are dropped, masks with every
    in-range bit set become full blocks (``ids = -1``), and the remaining masks are deduplicated.
    """
    bq, bk = block_size
    dev = lid.device
    ids = torch.full((lid.numel(),), -1, dtype=torch.int64, device=dev)
    masks = torch.zeros(0, bq, _bits.num_words(bk), dtype=torch.int32, device=dev)
    keep = torch.ones(lid.numel(), dtype=torch.bool, device=dev)
    if words is not None:
        sel = torch.ones_like(keep) if partial is None else partial
        pr, pc = r[sel], c[sel]
        full_words = inrange_words(pr, pc, block_size, seqlen)
        words = words & full_words
        empty = (words == 0).flatten(1).all(1)
        is_full = (words == full_words).flatten(1).all(1)
        where = sel.nonzero().squeeze(1)
        keep[where[empty]] = False
        still = ~empty & ~is_full
        masks, inverse = _bits.dedup(words[still])
        ids[where[still]] = inverse
    return lid[keep], r[keep], c[keep], ids[keep], masks


def csr(lid, r, c, ids, *, block_size, seqlen, num_layouts: int):
    """Unique kept blocks ``(lid, r, c)`` with their partial ids -> ``(crow, col, partial_ids)`` in
    CSR order (int32)."""
    R = math.ceil(seqlen[0] / block_size[0])
    crow, col, order = coo_to_csr(lid, r, c, num_layouts, R)
    return crow, col, ids[order].to(INDEX_DTYPE)


def validate_partial(ids: torch.Tensor, masks: torch.Tensor, nnz: int, block_size) -> None:
    """``ValueError``/``TypeError`` naming expected vs got unless ``ids`` (``[nnz]``, -1 or a mask id)
    and ``masks`` (``int32 [num_masks, bq, ceil(bk / 32)]``) are consistent."""
    bq, bk = block_size
    for name, t in (("partial_ids", ids), ("partial_masks", masks)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int32 tensor, got {got}")
    W = _bits.num_words(bk)
    if masks.dim() != 3 or tuple(masks.shape[1:]) != (bq, W):
        raise ValueError(f"partial_masks must have shape [num_masks, {bq}, {W}] (BLOCK_SIZE_Q, "
                         f"ceil(BLOCK_SIZE_KV / 32) words), got {tuple(masks.shape)}")
    if ids.shape != (nnz,):
        raise ValueError(f"partial_ids must have one entry per kept block ({nnz}), got shape {tuple(ids.shape)}")
    if nnz and (int(ids.min()) < -1 or int(ids.max()) >= masks.shape[0]):
        raise ValueError(f"partial_ids must lie in [-1, {masks.shape[0]}) (-1: full block), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


__all__ = ["canonical", "csr", "inrange_words", "lead_dims", "validate_partial", "words_at"]
