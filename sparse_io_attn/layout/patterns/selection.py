"""Data-dependent patterns: the top-k key blocks of each query-block row by a score computed from
the activations (MoBA, Native Sparse Attention and their kind), built on the scores' device with
tensor operations only, so that a model can choose its layout at every step (and under
``torch.compile(fullgraph=True)``) without synchronising with the host."""
from __future__ import annotations

import math

import torch

from sparse_io_attn.layout._args import as_pair, positive_int
from sparse_io_attn.layout._kv_indices import check_selection
from sparse_io_attn.layout.causal import causal_blocks, causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout


def topk(block_scores: torch.Tensor, k: int, block_size, seqlen, *, causal=False, include_diagonal: bool = True,
         keep: torch.Tensor | None = None) -> BlockSparseLayout:
    r"""Keep the ``k`` highest-scoring key blocks of each query-block row.

    Args:
        block_scores: float ``[Mq, Mk]``, ``[H, Mq, Mk]`` or ``[B, H, Mq, Mk]`` with
            ``Mq = ceil(seqlen_q / BLOCK_SIZE_Q)``, ``Mk = ceil(seqlen_k / BLOCK_SIZE_KV)``: one score
            per (query block, key block), e.g. mean-pooled queries times mean-pooled keys. ``H`` may
            be the number of query heads or of KV heads (one selection per GQA group). Compared in
            float32; NaN scores rank lowest.
        k: the blocks kept per row, a positive int (at most ``Mk`` are kept).
        block_size, seqlen: an int or a ``(q, kv)`` pair each, as for every layout.
        causal: ``False``, ``True``/``"top_left"`` or ``"bottom_right"`` (as the attention call's
            ``causal=``): blocks wholly in the causal future are never selected. Pass the same
            ``causal=`` to the attention, which masks the elements past the diagonal.
        include_diagonal: always keep the key blocks the row's diagonal ``j = i + delta`` passes
            through (``delta`` the causal offset, 0 without causality): a query block's own block.
        keep: bool ``[Mk]`` or any shape broadcastable to ``block_scores`` (``[Mq, 1]``: whole
            rows, ``[H, 1, Mk]``: per head): blocks always kept (attention sinks, global blocks),
            unless wholly in the causal future.

    Forced blocks (diagonal, ``keep``) count toward ``k`` and come first; the remaining slots go to
    the highest scores, ties broken by the lower block index (deterministic on every device). A row
    with more than ``k`` forced blocks keeps ``k`` of them: the diagonal ones, then the higher
    scores. A row with fewer than ``k`` eligible blocks keeps all of them.

    Returns a fixed-capacity :class:`BlockSparseLayout` (``min(k, Mk)`` slots per row, every kept
    block full) on the scores' device, built without host synchronisation and valid by construction.
    """
    if not isinstance(block_scores, torch.Tensor) or not block_scores.is_floating_point():
        got = block_scores.dtype if isinstance(block_scores, torch.Tensor) else type(block_scores).__name__
        raise TypeError(f"block_scores must be a floating-point tensor, got {got}")
    positive_int(k, "k (blocks kept per query-block row)")
    (bq, bk), (sq, sk) = as_pair(block_size, "block_size"), as_pair(seqlen, "seqlen")
    Mq, Mk = math.ceil(sq / bq), math.ceil(sk / bk)
    if block_scores.dim() not in (2, 3, 4) or tuple(block_scores.shape[-2:]) != (Mq, Mk):
        raise ValueError(f"block_scores must have shape [..., {Mq}, {Mk}] ([Mq, Mk], [H, Mq, Mk] or "
                         f"[B, H, Mq, Mk]: seqlen {(sq, sk)} in blocks of {(bq, bk)}), got "
                         f"{tuple(block_scores.shape)}")
    check_selection(block_scores, "block_scores")
    delta = causal_offset(causal, sq, sk)
    dev = block_scores.device
    r = torch.arange(Mq, device=dev)[:, None]
    c = torch.arange(Mk, device=dev)[None, :]
    eligible = causal_blocks(r, c, (bq, bk), (sq, sk), delta).alive                     # [Mq, Mk]
    diagonal = torch.zeros(Mq, Mk, dtype=torch.bool, device=dev)
    if include_diagonal:
        shift = 0 if delta is None else delta
        first = torch.clamp(r * bq + shift, min=0) // bk                  # diagonal of the row's first query
        last = (torch.clamp((r + 1) * bq, max=sq) - 1 + shift) // bk       # ... and of its last
        diagonal = (c >= first) & (c <= last)
    forced = torch.zeros((), dtype=torch.bool, device=dev)
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise TypeError(f"keep must be a torch.bool tensor of key blocks to always keep, got {got}")
        fits = keep.dim() <= block_scores.dim() and all(
            a in (1, b) for a, b in zip(reversed(keep.shape), reversed(block_scores.shape)))
        if not fits:
            raise ValueError(f"keep must have shape [{Mk}] or broadcast to block_scores' "
                             f"{tuple(block_scores.shape)} (e.g. [{Mq}, 1]: whole rows, [{Mq}, {Mk}]), got "
                             f"{tuple(keep.shape)}")
        forced = keep.to(dev)
    # rank classes: 3 diagonal, 2 kept, 1 eligible, 0 causal future (never chosen); inside a class
    # by score, ties by the lower index: one unique int64 key per block, so topk's order is exact.
    # Class and index depend on (row, column) only, so they form one small ``rank`` added to the
    # scores' order bits; the full-size passes run in place (one float32 and one int64 buffer).
    index_bits = max(1, (Mk - 1).bit_length())
    if index_bits > 28:
        raise ValueError(f"topk ranks at most 2**28 key blocks per row, got {Mk}; use larger blocks")
    one = 1 << (32 + index_bits)
    klass = torch.where(diagonal, 3 * one, torch.where(forced, 2 * one, one)) * eligible
    rank = klass + (((1 << 31) << index_bits) + (Mk - 1 - c))
    scores = torch.nan_to_num(block_scores.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    key = _ordered_bits_(scores.add_(0.0)).to(torch.int64).mul_(1 << index_bits).add_(rank)  # -0.0 is 0.0
    top = torch.topk(key, min(k, Mk), dim=-1, sorted=True).values
    chosen = torch.where(top >> (32 + index_bits) > 0, Mk - 1 - (top & ((1 << index_bits) - 1)), -1)
    name = f"topk(k={k}{',causal' if delta is not None else ''})"
    return BlockSparseLayout.from_kv_indices(chosen, (bq, bk), (sq, sk), check=False, name=name)


def ranked_topk(scores: torch.Tensor, k: int, *, eligible: torch.Tensor | None = None,
                ties: str = "lower") -> torch.Tensor:
    """The indices of the ``k`` highest ``scores`` along the last dimension, best first, **ties broken
    by the index**: the lower one first (``ties="lower"``) or the higher one (``ties="higher"``), the
    same choice on every device and run (``torch.topk``'s own order among equal values is unspecified
    and differs between CPU and CUDA).

    Args:
        scores: floating ``[..., M]``. NaN ranks as ``-inf``; ``-0.0`` equals ``0.0``.
        k: a positive int; ``min(k, M)`` slots are returned.
        eligible: optional bool, broadcastable to ``scores``: entries that may be chosen. An
            ineligible entry is never chosen, whatever its score; a row with fewer than ``k``
            eligible entries gets ``-1`` in its trailing slots.

    Returns int64 ``[..., min(k, M)]``. float16/bfloat16/float32 scores are ranked exactly through
    one int64 key per entry (the score's order-preserving bits, then the index), so one
    ``torch.topk`` without ties does the work; float64 scores through two stable sorts. Tensor
    operations only (no host synchronisation), shapes fixed by the inputs' shapes.
    """
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TypeError(f"scores must be a floating-point tensor, got {got}")
    positive_int(k, "k (entries kept per row)")
    if ties not in ("lower", "higher"):
        raise ValueError(f"ties must be 'lower' or 'higher' (which index wins among equal scores), got {ties!r}")
    M = scores.shape[-1]
    kk = min(k, M)
    if M == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int64, device=scores.device)
    dev = scores.device
    if eligible is None:
        eligible = torch.ones((), dtype=torch.bool, device=dev)
    elif not isinstance(eligible, torch.Tensor) or eligible.dtype != torch.bool:
        raise TypeError("eligible must be a torch.bool tensor broadcastable to scores")
    column = torch.arange(M, device=dev)
    if scores.dtype == torch.float64:
        s = torch.nan_to_num(scores, nan=-math.inf) + 0.0
        ok = torch.broadcast_to(eligible, scores.shape)
        if ties == "higher":                              # stable sorts keep the first of equals: flip
            s, ok = s.flip(-1), ok.flip(-1)
        by_score = torch.sort(s, dim=-1, descending=True, stable=True).indices
        ok = ok.gather(-1, by_score)
        by_class = torch.sort(ok.to(torch.int8), dim=-1, descending=True, stable=True).indices
        chosen = by_score.gather(-1, by_class)[..., :kk]
        if ties == "higher":
            chosen = M - 1 - chosen
        return torch.where(ok.gather(-1, by_class)[..., :kk], chosen, -1)
    index_bits = max(1, (M - 1).bit_length())
    if index_bits > 30:
        raise ValueError(f"ranked_topk ranks at most 2**30 entries per row, got {M}")
    s = torch.nan_to_num(scores.float(), nan=-math.inf).add_(0.0)                   # a copy; -0.0 is 0.0
    rank = M - 1 - column if ties == "lower" else column                              # the tie-break, unique
    key = _ordered_bits_(s).to(torch.int64).mul_(1 << index_bits).add_(rank)
    floor = torch.iinfo(torch.int64).min
    key = torch.where(eligible, key, floor)
    top = torch.topk(key, kk, dim=-1, sorted=True).values
    low = top & ((1 << index_bits) - 1)
    return torch.where(top > floor, M - 1 - low if ties == "lower" else low, -1)


def _ordered_bits_(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (``-inf`` lowest, ``x`` without NaN), in place in ``x``'s
    storage: the IEEE bits, with the 31 low bits flipped for negative numbers (their magnitude grows
    as the bits do)."""
    bits = x.view(torch.int32)
    return bits.bitwise_xor_((bits >> 31).bitwise_and_(0x7FFFFFFF))
