"""Kernel tiles of the selection Triton kernels, chosen from shapes and dtype only.

The launcher (:mod:`.triton.launch`), the traffic model (:mod:`.traffic`) and the compile report
all call :func:`kernel_configs` / :func:`choose_tiles`, so the model always describes the tiles
actually launched.

Vocabulary (``R``, ``BLOCK_H``, key steps):

* ``R`` = :func:`sel_heads`: the query heads that share one selection *and* one KV head
  (``min(Hq // Hkv, Hq // G)``); the forward and dQ kernels make them one tile's rows, padded to
  ``BLOCK_H`` = :func:`head_rows` (a power of two, 16 to 64; more heads take several programs).
* Forward / dQ walk a query row's selected blocks in *key steps* of ``BLOCK_N`` keys
  (:func:`key_step`): ``SLOTS = BLOCK_N // block_size`` blocks gathered at once when blocks are
  smaller than ``BLOCK_N``, else ``TILES = ceil(block_size / BLOCK_N)`` steps per block.
* dK/dV: one program per key tile of ``BLOCK_N`` keys inside a block (:func:`key_tile`: the block
  padded to at least 16 keys, at most the configuration's ``BLOCK_N``), gathered query rows in
  tiles of ``BLOCK_M`` (token, head) rows, each token's ``R`` heads padded to ``next_pow2(R)`` rows.
* Decode (``Nq <=`` :data:`DECODE_MAX_QUERIES`): the forward's rows and key steps, each row's steps
  cut into ``splits`` contiguous ranges (:func:`decode_config`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sparse_io_attn._triton.shapes import MIN_TILE, next_pow2
from sparse_io_attn._attention.tiles import (DECODE_MAX_QUERIES, DECODE_MAX_SPLITS, DECODE_SPLIT_KEYS,
                                             DECODE_TARGET_PROGRAMS, WIDE_ROW_BYTES, element_size, padded_head_dim)

KERNELS = ("fwd", "dq", "dkdv")


@dataclass(frozen=True)
class SelectionConfig:
    """One launch configuration: ``block_m`` (dK/dV: gathered query rows per tile; unused by the
    forward and dQ, whose rows are the ``BLOCK_H`` heads), ``block_n`` (the configuration's key
    width before :func:`key_step` / :func:`key_tile` fit it to the block size), warps, stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class SelectionTiles:
    """The tiles a launch uses (elements): what the traffic model needs."""
    fwd: tuple[int, int]   # (BLOCK_H, BLOCK_N) of selection_fwd
    dq: tuple[int, int]    # (BLOCK_H, BLOCK_N) of selection_bwd_dq
    dkdv: tuple[int, int]  # (BLOCK_M, BLOCK_N) of selection_bwd_dkdv


# Candidates per kernel and padded-row class (HEAD_DIM * element bytes), the first the default
# (interpreter, counting, SPARSE_IO_ATTN_NO_AUTOTUNE=1); on CUDA autotuning picks among all.
# Chosen from sm_90 compiles (`sparse-io-attn compile-report --op selection`, blocks 1, 4, 20, 32,
# 64, 100, both head layouts of the report, causal and not): no spills, the gathered K/V (forward,
# dQ) and Q/dO (dK/dV) tiles multi-buffered (cp.async). "heads": the BLOCK_H cap. Forward / dQ:
# (block_n, num_warps, num_stages); dK/dV, per key-tile width (the block padded to 16, 32 or 64
# keys): (block_m, num_warps, num_stages).
_CONFIGS = {
    128: {"heads": 64, "fwd": [(64, 4, 3), (64, 8, 3), (64, 4, 2), (32, 4, 3)],
          "dq": [(64, 4, 3), (128, 4, 3), (64, 8, 3), (32, 4, 3)],
          "dkdv": {64: [(32, 8, 3), (64, 8, 3), (32, 4, 3), (16, 4, 3)],
                   32: [(64, 8, 3), (16, 4, 3)],
                   16: [(64, 8, 3), (64, 4, 3), (16, 4, 3)]}},
    256: {"heads": 64, "fwd": [(64, 4, 3), (64, 8, 3), (32, 4, 3)],
          "dq": [(64, 4, 3), (64, 8, 3), (32, 4, 3), (128, 4, 3)],
          "dkdv": {64: [(32, 8, 3), (16, 8, 3), (32, 8, 2), (16, 4, 3)],
                   32: [(32, 8, 3), (16, 8, 3), (32, 8, 2)],
                   16: [(16, 4, 3), (16, 4, 2)]}},
    512: {"heads": 32, "fwd": [(32, 4, 2), (32, 8, 2)], "dq": [(32, 4, 2)],
          "dkdv": {32: [(16, 8, 2), (32, 8, 2)], 16: [(16, 4, 2)]}},
    1024: {"heads": 16, "fwd": [(32, 4, 2)], "dq": [(32, 4, 2)], "dkdv": {32: [(16, 4, 2)], 16: [(16, 4, 2)]}},
    # MLA's q/k rows (head dim 576 padded to 1024, V's 512): the smallest tiles, 8 warps for the wide
    # accumulators; one stage for dK/dV and by default for the forward (the decode kernel's too): unspilled
    2048: {"heads": 16, "fwd": [(16, 8, 1), (16, 8, 2)], "dq": [(16, 8, 2)], "dkdv": {16: [(16, 8, 1)]}},
}
# fp32 runs exact IEEE products on CUDA cores (no tensor cores): operands in registers, smaller tiles.
_CONFIGS_FP32 = {
    256: {"heads": 32, "fwd": [(32, 8, 2), (32, 4, 2)], "dq": [(32, 8, 2)],
          "dkdv": {32: [(16, 4, 3), (32, 8, 3)], 16: [(16, 4, 2)]}},
    512: {"heads": 16, "fwd": [(32, 4, 2)], "dq": [(32, 4, 2)], "dkdv": {32: [(16, 4, 2)], 16: [(16, 4, 2)]}},
    1024: {"heads": 16, "fwd": [(16, 4, 2)], "dq": [(16, 4, 2)], "dkdv": {16: [(16, 4, 2)]}},
    2048: {"heads": 16, "fwd": [(16, 8, 2)], "dq": [(16, 8, 2)], "dkdv": {16: [(16, 8, 2)]}},
    4096: {"heads": 16, "fwd": [(16, 8, 1)], "dq": [(16, 8, 1)], "dkdv": {16: [(16, 8, 1)]}},
}


def _table(head_dim: int, dtype: torch.dtype) -> dict:
    wide = padded_head_dim(head_dim) * element_size(dtype)
    table = _CONFIGS_FP32 if dtype == torch.float32 else _CONFIGS
    return table[min(c for c in table if c >= wide)]


def sel_heads(num_heads_q: int, num_heads_kv: int, num_selections: int) -> int:
    """``R``: query heads sharing one selection and one KV head (``G`` divides ``Hkv`` or ``Hkv``
    divides ``G``, so the heads of a selection span whole GQA groups or lie inside one)."""
    return min(num_heads_q // num_heads_kv, num_heads_q // num_selections)


def head_rows(r: int, head_dim: int, dtype: torch.dtype) -> int:
    """``BLOCK_H``: the forward/dQ tile rows for ``r`` heads (a power of two, at least 16, at most
    64: 32 or 16 for wide rows and fp32); more heads take several programs."""
    return min(_table(head_dim, dtype)["heads"], max(MIN_TILE, next_pow2(r)))


def _pow2_divisor(n: int) -> int:
    return n & -n


def key_step(block_size: int, block_n: int) -> tuple[int, int, int]:
    """``(BLOCK_N, SLOTS, TILES)`` of a forward/dQ key step: a configuration's ``block_n`` fitted to
    the block size (a power-of-two divisor of a block of at least 16 keys, so no step straddles a
    block end; otherwise whole blocks per step, the lanes past them masked), ``SLOTS`` blocks per
    step (``block_size < BLOCK_N``) or ``TILES`` steps per block."""
    n = block_n
    if block_size >= MIN_TILE and block_size % n and n % block_size and _pow2_divisor(block_size) >= MIN_TILE:
        n = min(n, _pow2_divisor(block_size))
    if block_size < n:
        return n, n // block_size, 1
    return n, 1, -(-block_size // n)


def key_tile(block_size: int, block_n: int) -> tuple[int, int]:
    """``(BLOCK_N, KEY_TILES)`` of the dK/dV kernel: one block padded to a power of two of at least
    16 keys, capped at the configuration's ``block_n`` (``KEY_TILES`` programs per block)."""
    n = min(block_n, max(MIN_TILE, next_pow2(block_size)))
    return n, -(-block_size // n)


def kernel_configs(kernel: str, block_size: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
                   ) -> list[SelectionConfig]:
    """The launch configurations of ``kernel`` (``"fwd"``, ``"dq"``, ``"dkdv"``) for a block size, head
    dim (with a V head dim of its own, the larger of Q/K's and V's:
    :func:`~sparse_io_attn._attention.tiles.tile_head_dim`; every tile-choosing function here takes that)
    and dtype: the default first, then the other autotuning candidates (forward/dQ: key widths
    fitted to ``block_size`` by :func:`key_step`, duplicates removed; dK/dV: the candidates of the
    key-tile width :func:`key_tile` gives). Depends on shapes and dtype only."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    configs = _table(head_dim, dtype)[kernel]
    if kernel == "dkdv":
        n = key_tile(block_size, max(configs))[0]
        return [SelectionConfig(m, n, w, st) for m, w, st in configs[n]]
    out: list[SelectionConfig] = []
    for n, w, st in configs:
        cfg = SelectionConfig(0, key_step(block_size, n)[0], w, st)
        if cfg not in out:
            out.append(cfg)
    return out


def choose_tiles(block_size: int, head_dim: int, dtype: torch.dtype, r: int) -> SelectionTiles:
    """The default tiles of every kernel for ``r`` = :func:`sel_heads` heads per tile: what the
    launcher uses under the interpreter, while counting and without autotuning."""
    c = {k: kernel_configs(k, block_size, head_dim, dtype)[0] for k in KERNELS}
    h = head_rows(r, head_dim, dtype)
    return SelectionTiles(fwd=(h, c["fwd"].block_n), dq=(h, c["dq"].block_n),
                          dkdv=(c["dkdv"].block_m, c["dkdv"].block_n))


# ------------------------------------------------------------------------------------- families
#: the Triton kernel families (:func:`kernel_family`)
FAMILIES = ("query", "key", "masked")
#: environment override of :func:`kernel_family` (``"auto"``, or one of :data:`FAMILIES`): what the GPU
#: benchmark uses to time the families against each other
FAMILY_ENV = "SPARSE_IO_ATTN_TRITON_SELECTION_FAMILY"
#: a selection shared by this many heads (of one KV head) fills the rows of a query-major tile
QUERY_MAJOR_MIN_HEADS = 16
#: blocks of this many keys and more run key-major (one block is a tile's key extent); smaller ones
#: run as element-masked tiles of consecutive keys
KEY_MAJOR_MIN_BLOCK = 16
#: ``"auto"`` leaves the key-major and masked families when their work buffers would exceed this
#: (the key-major per-pair partials ``[B, Hq, Nq, K] x (HEAD_DIM + 2)`` fp32, forward, and ``x KEY_TILES
#: x HEAD_DIM`` for dQ; the masked family's key bits ``[L, Nq, ceil(Nk / 64)]`` int64): query-major then
MAX_WORK_BYTES = 8 << 30
#: keys of one element-masked tile (the bits of one int64 word per query token)
MASKED_BLOCK_N = 64


@dataclass(frozen=True)
class FamilyTiles:
    """Tiles of the key-major (``"key"``) or element-masked (``"masked"``) family for one call:
    ``block_m`` gathered rows = ``block_t`` query tokens x ``sel_rows`` heads (``next_pow2(R)``, the
    rows past ``R`` padding), ``block_n`` keys per key tile (``key_tiles`` tiles per key block of the
    key-major family; 64 for the masked family), and the warps/stages candidates of the forward and dQ
    (``launches``) and of dK/dV (``dkdv_launches``), the first the default; autotuning picks among them on
    CUDA (the tiles themselves are fixed: the plan's work lists are built for them). dK/dV forms its
    products over ``dkdv_m`` rows at a time with the keys as every product's M (``S^T = K Q^T``): the
    key-major backward's row tiles, the masked dK/dV kernel's sub-tiles of a query tile."""
    block_m: int
    block_t: int
    sel_rows: int
    block_n: int
    key_tiles: int
    launches: tuple        # ((num_warps, num_stages), ...)
    dkdv_m: int
    dkdv_launches: tuple


# Per padded-row class (HEAD_DIM * element bytes): rows per tile, rows per dK/dV product, the (warps,
# stages) candidates of the forward/dQ and of dK/dV. From the sm_90 compile report (`compile-report --op
# selection`): every product on wgmma (64 keys as dK/dV's M; a dK/dV product over 16 rows at head dim 128
# keeps the dK, dV accumulators and the dQ partial of the key-major backward in registers), no spills,
# the gathered tiles multi-buffered. fp32 runs exact IEEE products on CUDA cores.
_FAMILY_CONFIGS = {128: (64, 32, ((4, 2), (4, 3), (8, 2)), ((4, 3), (8, 3))),
                   256: (64, 16, ((4, 2), (8, 2), (4, 3)), ((8, 3),)),
                   512: (32, 16, ((4, 2), (8, 2)), ((8, 2),)),
                   1024: (16, 16, ((4, 1), (4, 2)), ((4, 1),)),
                   2048: (16, 16, ((8, 1),), ((8, 1),))}
_FAMILY_CONFIGS_FP32 = {256: (32, 16, ((4, 2), (8, 2)), ((4, 2),)), 512: (16, 16, ((4, 2),), ((4, 2),)),
                        1024: (16, 16, ((4, 1),), ((4, 1),)), 2048: (16, 16, ((8, 1),), ((8, 1),)),
                        4096: (16, 16, ((8, 1),), ((8, 1),))}
_FAMILY_KEY_N = 64   # key tile of the key-major family (a block of up to 64 keys is one tile)


def family_tiles(family: str, block_size: int, head_dim: int, dtype: torch.dtype, r: int) -> FamilyTiles:
    """The :class:`FamilyTiles` of ``family`` (``"key"`` or ``"masked"``) for ``r`` =
    :func:`sel_heads` heads per selection and KV head: from shapes and dtype only (the launcher, the
    plan's work lists, the traffic model and the compile report agree)."""
    if family not in ("key", "masked"):
        raise ValueError(f"family_tiles is for the 'key' and 'masked' families, got {family!r}")
    wide = padded_head_dim(head_dim) * element_size(dtype)
    table = _FAMILY_CONFIGS_FP32 if dtype == torch.float32 else _FAMILY_CONFIGS
    rows, sub, launches, dkdv_launches = table[min(c for c in table if c >= wide)]
    sel_rows = next_pow2(r)
    block_m = max(rows, sel_rows)
    if family == "masked":
        dkdv_m = min(block_m, max(sub, sel_rows))   # whole tokens per sub-tile
        return FamilyTiles(block_m, block_m // sel_rows, sel_rows, MASKED_BLOCK_N, 1, launches, dkdv_m, dkdv_launches)
    n, key_tiles = key_tile(block_size, _FAMILY_KEY_N)
    return FamilyTiles(block_m, block_m // sel_rows, sel_rows, n, key_tiles, launches, sub, dkdv_launches)


def dq_partials(block_size: int) -> int:
    """dQ partials per (row, slot) of the key-major backward: its key tiles per block (each key tile's
    program writes one)."""
    return key_tile(block_size, _FAMILY_KEY_N)[1]


def family_work_bytes(family: str, block_size: int, max_blocks: int, layouts: int, batch: int, num_heads_q: int,
                      seqlen_q: int, seqlen_k: int, head_dim: int, dtype: torch.dtype, r: int) -> int:
    """Bytes of the work buffers ``family`` allocates for one call (see :data:`MAX_WORK_BYTES`); 0 for
    ``"query"``. ``layouts``: the plan's stored selections ``L``."""
    hd = padded_head_dim(head_dim)
    if family == "key":
        pairs = batch * num_heads_q * seqlen_q * max_blocks
        return pairs * max(hd + 2, dq_partials(block_size) * hd) * 4
    if family == "masked":
        return layouts * seqlen_q * -(-seqlen_k // MASKED_BLOCK_N) * 8
    return 0


def kernel_family(block_size: int, max_blocks: int, layouts: int, batch: int, num_heads_q: int, num_heads_kv: int,
                  num_selections: int, seqlen_q: int, seqlen_k: int, head_dim: int, dtype: torch.dtype,
                  name: str | None = None) -> str:
    """Which Triton family runs a call (prefill forward and backward): ``name`` (``"auto"`` or one of
    :data:`FAMILIES`), else ``$SPARSE_IO_ATTN_TRITON_SELECTION_FAMILY``, else by the plan's shape:

    * ``"query"``: ``R`` = :func:`sel_heads` >= :data:`QUERY_MAJOR_MIN_HEADS` (a selection's heads fill a
      query-major tile's rows: DSA with 64-128 heads per index list);
    * ``"key"``: blocks of :data:`KEY_MAJOR_MIN_BLOCK` keys and more (MoBA, NSA): key-major gathered tiles;
    * ``"masked"``: smaller blocks (single tokens: DSA with few heads per list): tiles of consecutive
      query tokens against tiles of 64 consecutive keys with an element mask;

    ``"query"`` where the family's work buffers would exceed :data:`MAX_WORK_BYTES`, and for wide rows
    (:data:`~sparse_io_attn._attention.tiles.WIDE_ROW_BYTES`: MLA's 576 in bf16), where the key-major and
    masked families' 64-key tiles exceed sm_90's shared memory."""
    name = name if name is not None else os.environ.get(FAMILY_ENV, "auto") or "auto"
    if name != "auto" and name not in FAMILIES:
        raise ValueError(f"the Triton selection kernel family must be 'auto' or one of {FAMILIES}, got {name!r} "
                         f"(argument family_name= or ${FAMILY_ENV})")
    if name != "auto":
        return name
    r = sel_heads(num_heads_q, num_heads_kv, num_selections)
    if r >= QUERY_MAJOR_MIN_HEADS or padded_head_dim(head_dim) * element_size(dtype) > WIDE_ROW_BYTES:
        return "query"
    fam = "key" if block_size >= KEY_MAJOR_MIN_BLOCK else "masked"
    work = family_work_bytes(fam, block_size, max_blocks, layouts, batch, num_heads_q, seqlen_q, seqlen_k, head_dim,
                             dtype, r)
    return fam if work <= MAX_WORK_BYTES else "query"


@dataclass(frozen=True)
class SelectionDecodeConfig:
    """The launch of the selection decode kernels for one call, from shapes and dtype only (the
    launcher, the traffic model and the compile report agree): the forward's ``BLOCK_H`` rows and its
    default key step (``BLOCK_N``, ``SLOTS``, ``TILES``, ``MASK_LANES``: :func:`key_step`), ``splits``
    per row program (1: the decode kernel writes the outputs, no merge), warps and stages."""
    block_h: int
    block_n: int
    slots: int
    tiles: int
    mask_lanes: bool
    splits: int
    num_warps: int
    num_stages: int


def decode_config(block_size: int, max_blocks: int, batch: int, num_heads_q: int, num_heads_kv: int,
                  num_selections: int, num_queries: int, head_dim: int, dtype: torch.dtype, *,
                  split_keys: int = DECODE_SPLIT_KEYS) -> SelectionDecodeConfig:
    """The :class:`SelectionDecodeConfig` of a call: ``K = max_blocks`` slots per row of blocks of
    ``block_size`` keys, ``num_queries`` decoded tokens. The row programs are the forward's (per
    token, batch x unit of ``R`` heads, chunk of ``BLOCK_H``); splits as the block-sparse decode
    (:func:`sparse_io_attn.block_sparse.tiles.decode_config`): enough to bring all programs to
    ``DECODE_TARGET_PROGRAMS``, at most one per ``split_keys`` keys of a row's capacity ``K *
    block_size`` (a shape: no host read of the rows), per key step of the capacity and
    ``DECODE_MAX_SPLITS``. ``split_keys`` (tests: small values force several splits)."""
    if split_keys < 1:
        raise ValueError(f"split_keys must be positive, got {split_keys}")
    c = kernel_configs("fwd", block_size, head_dim, dtype)[0]
    n, slots, tiles = key_step(block_size, c.block_n)
    r = sel_heads(num_heads_q, num_heads_kv, num_selections)
    block_h = head_rows(r, head_dim, dtype)
    programs = max(1, batch * (num_heads_q // r) * -(-r // block_h) * num_queries)
    steps = -(-max_blocks // slots) * tiles                  # key steps of a full row
    splits = max(1, min(DECODE_MAX_SPLITS, -(-max_blocks * block_size // split_keys),
                        -(-DECODE_TARGET_PROGRAMS // programs), steps))
    mask_lanes = slots * block_size != n if slots > 1 else tiles * n != block_size
    return SelectionDecodeConfig(block_h, n, slots, tiles, mask_lanes, splits, c.num_warps, c.num_stages)


__all__ = ["DECODE_MAX_QUERIES", "FAMILIES", "FAMILY_ENV", "FamilyTiles", "SelectionConfig", "SelectionDecodeConfig",
           "SelectionTiles", "choose_tiles", "decode_config", "dq_partials", "family_tiles", "family_work_bytes", "head_rows",
           "kernel_configs", "kernel_family", "key_step", "key_tile", "sel_heads"]
