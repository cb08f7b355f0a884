"""Kernel tile sizes of the block-sparse Triton kernels, chosen from shapes and dtype only.

The launcher (:mod:`.triton.launch`) and the traffic model (:mod:`.traffic`) both call
:func:`choose_tiles`, so the model always describes the tiles actually launched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_io_attn._attention.tiles import (DECODE_MAX_SPLITS, DECODE_SPLIT_KEYS, DECODE_TARGET_PROGRAMS,
                                             WIDE_ROW_BYTES, element_size, padded_head_dim)
from sparse_io_attn._triton.shapes import MIN_TILE, next_pow2

@dataclass(frozen=True)
class KernelTiles:
    """Kernel tile sizes (elements). Each tile divides the layout block along its axis."""
    fwd: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_fwd
    dq: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_bwd_dq
    dkdv: tuple[int, int]  # (BLOCK_M, BLOCK_N) of attn_bwd_dkdv (BLOCK_M: query tile, BLOCK_N: key tile)
    preprocess: int  # BLOCK_M of attn_bwd_preprocess (does not change the bytes)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of a kernel: tiles, warps, software-pipeline stages, and for dK/dV the
    score form (``exact_scores``, the kernel's ``EXACT_SCORES``: ``False`` forms ``S^T = K Q^T``
    directly, ``True`` transposes the forward's ``Q K^T`` tile) and the query tile over partial blocks
    (``part_m``: :func:`dkdv_part_rows`); both ``None`` for the other kernels."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    exact_scores: bool | None = None
    part_m: int | None = None

    def constexprs(self) -> dict:
        """The kernel's constexprs this configuration sets (a ``triton.Config``'s kwargs)."""
        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        if self.exact_scores is not None:
            meta.update(EXACT_SCORES=self.exact_scores, PART_M=self.part_m)
        return meta


# dK/dV's score form: DIRECT forms S^T = K Q^T (key tile as every product's M, Hopper's wgmma from 64
# keys; no fp32 transpose); EXACT transposes the forward's Q K^T tile every step (the forward's rounding
# at any logit; the only form before issue 46, kept with that configurations until a GPU run
# has shown which wins). Rounding: benchmarks/results/extreme_logits.md.
DIRECT, EXACT = False, True

# Candidate configurations per kernel and padded-row class (HEAD_DIM * element bytes), the first the
# default (interpreter, counting, SPARSE_IO_ATTN_NO_AUTOTUNE=1); on CUDA autotuning picks among all.
# Chosen from sm_90 compiles (`sparse-io-attn compile-report`): every candidate at <= 256 B per row
# (bf16/fp16 up to head dim 128, fp32 up to 64) compiles without register spills and with
# multi-buffered (cp.async) K/V or Q/dO loads. (block_m, block_n, num_warps, num_stages[, score form]).
# The backwards the field runs fast (issue 46) first: dK/dV with 128-key tiles, every product on
# Hopper's wgmma; dQ with 128-query tiles. FlexAttention's sm_90 default (torch/_inductor
# template_heuristics, head dims 64-128): dK/dV 64 queries x 128 keys, dQ 128 x 64, 8 warps, 3 stages
# (two Q/dO buffers: also FlashAttention-2's 64 x 128 with 8 warps and Q double-buffered);
# FlashAttention-3's 128 x 128 at head dim 64; Triton's fused-attention tutorial 32 x 128 (5 stages at
# head dim 64), with 8 warps: its 4 spill registers in sm_90 compiles here (dK/dV's fp32 accumulators
# alone take 128 registers a thread at head dim 64, 256 at 128). Then the configurations before issue 46.
_CONFIGS = {
    128: {"fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 8, 3)],
          "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
          "dkdv": [(64, 128, 8, 3, DIRECT), (128, 128, 8, 2, DIRECT), (32, 128, 8, 5, DIRECT),
                   (32, 64, 4, 3, EXACT), (64, 64, 8, 3, EXACT), (32, 64, 8, 2, EXACT), (64, 32, 8, 3, EXACT)]},
    256: {"fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 8, 2)],
          "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
          "dkdv": [(64, 128, 8, 3, DIRECT), (32, 128, 8, 3, DIRECT),
                   (32, 64, 8, 3, EXACT), (32, 64, 8, 2, EXACT), (16, 64, 8, 3, EXACT)]},
    512: {"fwd": [(64, 32, 8, 2), (64, 32, 4, 2)],
          "dq": [(32, 32, 4, 2), (32, 32, 8, 2)],
          "dkdv": [(16, 32, 4, 2, DIRECT), (16, 32, 4, 2, EXACT), (32, 32, 8, 2, EXACT)]},
    1024: {"fwd": [(32, 32, 4, 2)], "dq": [(32, 32, 4, 2)], "dkdv": [(16, 32, 4, 2, DIRECT), (16, 32, 4, 2, EXACT)]},
    # MLA's q/k rows (head dim 576 padded to 1024, V's 512): the smallest tiles, 8 warps for the wide accumulators
    2048: {"fwd": [(32, 16, 8, 2)], "dq": [(16, 16, 8, 2)], "dkdv": [(16, 16, 8, 2, DIRECT), (16, 16, 8, 2, EXACT)]},
}
# fp32 runs exact IEEE products on CUDA cores (no tensor cores, no tf32): more registers per element.
# Keys are padded-row bytes as above (256: head dim <= 64).
# dK/dV defaults to the EXACT score form here: CUDA cores gain nothing from the key-major products, and
# the forward's rounding keeps dV exact at any logit size (tests/block_sparse/test_bad_input.py).
_CONFIGS_FP32 = {
    256: {"fwd": [(64, 32, 8, 2), (64, 32, 8, 3)], "dq": [(32, 32, 8, 2)],
          "dkdv": [(16, 32, 8, 2, EXACT), (16, 32, 8, 2, DIRECT), (32, 32, 8, 2, DIRECT)]},
    512: {"fwd": [(64, 32, 8, 2)], "dq": [(32, 32, 8, 2)], "dkdv": [(16, 32, 8, 2, EXACT), (16, 32, 8, 2, DIRECT)]},
    1024: {"fwd": [(32, 32, 4, 2)], "dq": [(16, 32, 4, 2)], "dkdv": [(16, 16, 4, 2, EXACT), (16, 16, 4, 2, DIRECT)]},
    2048: {"fwd": [(16, 16, 8, 2)], "dq": [(16, 16, 8, 2)], "dkdv": [(16, 16, 8, 2, EXACT), (16, 16, 8, 2, DIRECT)]},
    4096: {"fwd": [(16, 16, 8, 1)], "dq": [(16, 16, 8, 1)], "dkdv": [(16, 16, 8, 1, EXACT), (16, 16, 8, 1, DIRECT)]},
}
KERNELS = ("fwd", "dq", "dkdv")
# dK/dV's query tile over partial blocks: at most this many rows (its BLOCK_M when smaller), as the
# Triton tutorial's masked diagonal steps use half its query tile: the element mask, causal test and
# row statistics of a [keys, queries] tile then fit beside the dK/dV accumulators (sm_90, no spills).
DKDV_PART_ROWS = 32


def dkdv_part_rows(block_m: int) -> int:
    """The query rows of a dK/dV iteration over a partial block, for a dK/dV ``BLOCK_M``."""
    return min(block_m, DKDV_PART_ROWS)


def _pow2_divisor(n: int, cap: int) -> int:
    return min(n & -n, cap)


def kernel_configs(kernel: str, block_size, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> list[KernelConfig]:
    """The launch configurations of ``kernel`` (``"fwd"``, ``"dq"``, ``"dkdv"``) for a layout block
    ``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)``, head dim (with a V head dim of its own, the larger of Q/K's and
    V's: :func:`~sparse_io_attn._attention.tiles.tile_head_dim`) and dtype: the default first, then the other
    autotuning candidates. Tiles are capped to the largest power of two dividing the layout block
    (tiles never straddle blocks), duplicates removed. Depends on shapes and dtype only, so the
    traffic model, the launcher and the compile report agree everywhere. Raises
    ``NotImplementedError`` when a layout block has no power-of-two divisor >= 16 (e.g. 8 or 24).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    bq, bk = block_size
    wide = padded_head_dim(head_dim) * element_size(dtype)  # bytes per (padded) row
    table = _CONFIGS_FP32 if dtype == torch.float32 else _CONFIGS
    row_class = min(c for c in table if c >= wide)
    out: list[KernelConfig] = []
    for m, n, w, st, *form in table[row_class][kernel]:
        tm, tn = _pow2_divisor(bq, m), _pow2_divisor(bk, n)
        if min(tm, tn) < MIN_TILE:
            raise NotImplementedError(
                f"backend 'triton' needs layout block sizes with a power-of-two divisor >= {MIN_TILE} "
                f"(e.g. 16, 48, 64, 128), got block_size {(bq, bk)}; rebuild the layout or use backend='torch'")
        cfg = KernelConfig(tm, tn, w, st)
        if form:   # dK/dV: its score form and its query tile over partial blocks
            cfg = KernelConfig(tm, tn, w, st, exact_scores=form[0], part_m=dkdv_part_rows(tm))
        if cfg not in out:
            out.append(cfg)
    return out


def choose_tiles(block_size, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> KernelTiles:
    """The default tiles of every kernel (the first of :func:`kernel_configs`): what the launcher
    uses under the interpreter, while counting and without autotuning, and what the traffic model
    assumes unless given the tiles autotuning picked (``launch.launched_tiles()``)."""
    t = {k: kernel_configs(k, block_size, head_dim, dtype)[0] for k in KERNELS}
    return KernelTiles(fwd=(t["fwd"].block_m, t["fwd"].block_n), dq=(t["dq"].block_m, t["dq"].block_n),
                       dkdv=(t["dkdv"].block_m, t["dkdv"].block_n), preprocess=t["dq"].block_m)


# ------------------------------------------------------------------------------------------ decode
DECODE_MAX_ROWS = 64        # rows of a decode program (heads x tokens): the fp32 accumulator's height


@dataclass(frozen=True)
class DecodeConfig:
    """The launch of the decode kernels for one call, from shapes only (the launcher, the traffic
    model and the compile report agree): ``heads`` query heads per program (a whole GQA group when
    its heads share one list, else a divisor of it, or 1), ``tokens`` rows per head (a power of two
    covering a query block's decoded tokens), ``block_m = max(16, next_pow2(heads * tokens))``,
    ``block_n`` keys per tile, ``splits`` per row program (1: the decode kernel writes the outputs,
    no merge), warps and stages."""
    heads: int
    tokens: int
    block_m: int
    block_n: int
    splits: int
    num_warps: int
    num_stages: int


def decode_config(plan, batch: int, num_heads_q: int, num_heads_kv: int, head_dim: int,
                  dtype: torch.dtype) -> DecodeConfig:
    """The :class:`DecodeConfig` of an :class:`~sparse_io_attn.block_sparse.plan.AttentionPlan`
    (read duck-typed: block size, lengths, head masks, storage slots, its source layout's head
    masks) for these inputs. The heads of a GQA group share a program when they share one list: a
    layout shared by every head, or one mask per KV head repeated for the query heads. Splits come
    from the plan's kept-block capacity per row (storage slots / rows: a shape, no host read) and the
    number of row programs, never from the data. ``head_dim``: with a V head dim of its own, the larger
    (:func:`~sparse_io_attn._attention.tiles.tile_head_dim`)."""
    bq, bk = plan.block_size
    nq, _ = plan.seqlen
    G = num_heads_q // num_heads_kv
    source = getattr(plan, "source", None)
    shared = plan.layout_heads == 1 or (source is not None and source.layout_heads == num_heads_kv)
    tokens = next_pow2(min(bq, nq))
    heads = 1
    if shared:
        heads = max(d for d in range(1, G + 1) if G % d == 0 and d * tokens <= max(DECODE_MAX_ROWS, tokens))
    fp32 = element_size(dtype) == 4   # exact IEEE products on CUDA cores: smaller key tiles, more warps
    # wide rows (MLA's 576 padded to 1024 lanes): 32-key tiles, two stages (sm_90 shared memory)
    wide = padded_head_dim(head_dim) * element_size(dtype) > WIDE_ROW_BYTES
    block_n = _pow2_divisor(bk, 32 if fp32 or wide else 64)
    if block_n < MIN_TILE:
        raise NotImplementedError(
            f"backend 'triton' needs layout block sizes with a power-of-two divisor >= {MIN_TILE} "
            f"(e.g. 16, 48, 64, 128), got block_size {(bq, bk)}; rebuild the layout or use backend='torch'")
    nqb = -(-nq // bq)
    row_capacity = -(-max(plan.slots, 1) // (plan.layout_batch * plan.layout_heads * nqb))
    programs = batch * (num_heads_q // heads) * nqb
    splits = max(1, min(DECODE_MAX_SPLITS, -(-row_capacity * bk // DECODE_SPLIT_KEYS),
                        -(-DECODE_TARGET_PROGRAMS // programs)))
    block_m = max(MIN_TILE, next_pow2(heads * tokens))
    return DecodeConfig(heads, tokens, block_m, block_n, splits, num_warps=8 if fp32 and block_m >= 64 else 4,
                        num_stages=2 if fp32 or wide else 3)
