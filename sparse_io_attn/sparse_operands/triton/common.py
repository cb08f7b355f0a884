"""``@triton.jit`` helpers shared by the sparse-operand kernels (:mod:`.product`, :mod:`.fwd`,
:mod:`.bwd`; the launcher is :mod:`sparse_io_attn.sparse_operands.triton.launch`), which compute
``softmax(A1 X A2^T * scale) A3 Y`` with block-sparse operands.

Tiles are addressed as described in :mod:`sparse_io_attn.sparse_operands.operands`: tile id ``t`` from a block
map, element ``(r, c)`` at ``base + (t // nb) * stride_ta + (t % nb) * stride_tb + r * stride_r +
c * stride_c``.

Batch and heads: every kernel runs all ``(batch element, head)`` groups of a call in one launch,
grid axis 1 being ``g = b * H + h`` (:func:`_group`, :func:`_attention_program`). A group's operand starts at
``base + b * stride_*_gb + h * stride_*_gh`` and its block map likewise (``stride_*map_gb/_gh``;
strides are 0 along an axis the operand or pattern is shared on); buffers allocated per group
(``h``, ``o``, ``lse``, ``delta``, ``w``, ``hsum``) are offset by ``g`` times their group stride.
The plans of all distinct patterns are concatenated; a group reads ``plan_ids[g]`` and starts its
row (column) pointers at ``plan_ids[g] * (blocks + 1)``.

Head dimension (attention kernels): the head dimension is cut into ``NUM_D_TILES`` d-tiles of
``BLOCK_D`` columns (a compile-time count). A program holds its own operand as a tuple of per-d-tile
register tensors (built in ``tl.static_range``, indexed by the static tile index) and, for each
kept score block, reads only the other operand's d-tiles stored in both block rows (a fully masked
load elsewhere: no traffic; :func:`_own_rows`, :func:`_kept_rows`). Every product over the
head dimension — ``S = Q A2^T`` in the forward and dQ kernels (``S^T = A2 Q^T`` in dK/dV),
``dA2 += dS^T Q`` and ``dQ += dS A2`` — is a sum of per-tile ``tl.dot`` calls each behind a runtime
branch on the tile-presence flags, so d-tiles absent from either operand cost neither loads nor
FLOPs (:mod:`sparse_io_attn.sparse_operands.flops` models the issued multiply-adds exactly). The
row-panel product kernel (:mod:`.product`) treats its output columns the same way: one accumulator
per column tile of C, and per pair only the column tiles stored in both ``B[k, :]`` and ``C[i, :]``
are loaded and multiplied.

Pipelining: every main loop is ``tl.range(..., num_stages=LOOP_STAGES)`` (the launch's stage count,
:mod:`.configs`). Triton's pipeliner otherwise multi-buffers only loads that reach a dot at the top
level of the loop; with the loop's own stage count it also takes the operand tiles whose only
products sit behind the presence branches.

Products go through :func:`sparse_io_attn._triton.jit.dot` with fp32 accumulation; its ``DOT_DTYPE``
constexpr (chosen by :func:`sparse_io_attn._triton.runtime.dot_dtype`) is ``tl.float32`` (exact IEEE
products) for fp32 inputs and under the interpreter, the inputs' 16-bit type otherwise. Softmax runs
in base 2: scores are multiplied once by ``qk_scale = sm_scale * LOG2E`` and exponentiated with
``exp2``; ``lse`` is stored (and read back) in natural-log units, fp32.

I/O counting (``COUNT_IO``, see :mod:`sparse_io_attn.tally.counter`): each program tallies the
bytes of the in-bounds, unmasked lanes it loads and stores (:func:`~sparse_io_attn._triton.jit.nbytes`)
per tensor, plus the index bytes it reads (block-map rows, pair and plan lists), and adds them once
at its end with :func:`~sparse_io_attn._triton.jit.io_add` into the named slots of
:mod:`sparse_io_attn.sparse_operands.triton.slots` (slot order: the tensor tuples of
:mod:`sparse_io_attn.sparse_operands.traffic`, whose model reproduces every tally).
"""
from __future__ import annotations

from sparse_io_attn._triton.jit import LOG2E, dot, io_add, nbytes  # (sets TRITON_INTERPRET first)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tile_ptrs(base, t, offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c):
    """Pointers ``[len(offs_r), len(offs_c)]`` of tile ``t`` (scalar)."""
    t = t.to(tl.int64)
    return base + (t // nb) * stride_ta + (t % nb) * stride_tb + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c


@triton.jit
def _group(num_heads):
    """``(b, h, g)`` of this program's ``(batch element, head)`` group (grid axis 1, ``g = b * H + h``),
    ``b`` and ``h`` as int64 for the offsets."""
    g = tl.program_id(1)
    return (g // num_heads).to(tl.int64), (g % num_heads).to(tl.int64), g


@triton.jit
def _group_operand(ptr, map_ptr, zb, zh, stride_gb, stride_gh, stride_map_gb, stride_map_gh):
    """An operand's data and block map at group ``(zb, zh)`` (strides 0 along an axis it is shared on)."""
    return ptr + (zb * stride_gb + zh * stride_gh), map_ptr + (zb * stride_map_gb + zh * stride_map_gh)


@triton.jit
def _entries(ptrs, i):
    """``ptrs[i], ptrs[i + 1]``: where entry list ``i`` of a CSR (CSC) pointer array starts and ends."""
    return tl.load(ptrs + i), tl.load(ptrs + i + 1)


@triton.jit
def _d_ids(map_ptr, row, NUM_D_TILES: tl.constexpr):
    """Tile ids (int32 scalars, -1 where absent) of the ``NUM_D_TILES`` d-tiles of one block row, as a
    tuple; reads ``4 * NUM_D_TILES`` bytes of the block map."""
    ids = ()
    for t in tl.static_range(NUM_D_TILES):
        ids = ids + (tl.load(map_ptr + row * NUM_D_TILES + t),)
    return ids


@triton.jit
def _shared(ids_a, ids_b, NUM_D_TILES: tl.constexpr):
    """Tuple of scalar flags: d-tile ``t`` is stored in both block rows."""
    keep = ()
    for t in tl.static_range(NUM_D_TILES):
        keep = keep + ((ids_a[t] >= 0) & (ids_b[t] >= 0),)
    return keep


@triton.jit
def _load_d_tiles(base, ids, keep, offs_r, mask_r, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                  BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Tuple of ``[len(offs_r), BLOCK_D]`` tiles of one block row, tile ``t`` read only where
    ``keep[t]`` (elsewhere the whole load is masked off: zeros, no traffic); and the bytes read
    (int64). ``mask_r``: in-range rows; ``n_cols``: the operand's width (head dimension, or the
    columns of a product's row panel)."""
    offs_c = tl.arange(0, BLOCK_D)
    tiles = ()
    read = tl.zeros([], dtype=tl.int64)
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(keep[t], tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        mask = mask_r[:, None] & (offs_c < width)[None, :]  # [len(offs_r), BLOCK_D]
        x = tl.load(_tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r,
                               stride_c), mask=mask, other=0.0)
        tiles = tiles + (x,)
        read += nbytes(mask, base)
    return tiles, read


@triton.jit
def _store_d_tiles(base, ids, tiles, offs_r, mask_r, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                   BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Store a tuple of ``[len(offs_r), BLOCK_D]`` tiles on the stored d-tiles of one block row;
    returns the bytes written (int64)."""
    offs_c = tl.arange(0, BLOCK_D)
    written = tl.zeros([], dtype=tl.int64)
    for t in tl.static_range(NUM_D_TILES):
        width = tl.where(ids[t] >= 0, tl.minimum(BLOCK_D, n_cols - t * BLOCK_D), 0)
        mask = mask_r[:, None] & (offs_c < width)[None, :]  # [len(offs_r), BLOCK_D]
        ptrs = _tile_ptrs(base, tl.maximum(ids[t], 0), offs_r, offs_c, nb, stride_ta, stride_tb, stride_r, stride_c)
        tl.store(ptrs, tiles[t].to(base.dtype.element_ty), mask=mask)
        written += nbytes(mask, base)
    return written


@triton.jit
def _scores(q_tiles, k_tiles, keep, s, DOT_DTYPE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``s + sum_t q_t k_t^T`` over the d-tiles with ``keep[t]`` only: absent tiles issue no ``tl.dot``."""
    for t in tl.static_range(NUM_D_TILES):
        if keep[t]:
            s = dot(q_tiles[t], tl.trans(k_tiles[t]), s, DOT_DTYPE)
    return s


@triton.jit
def _acc_d_tiles(accs, a, b_tiles, keep, DOT_DTYPE: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """``accs[t] + a @ b_t`` for the d-tiles with ``keep[t]``; other accumulators unchanged (no FLOPs)."""
    out = ()
    for t in tl.static_range(NUM_D_TILES):
        c = accs[t]
        if keep[t]:
            c = dot(a, b_tiles[t], c, DOT_DTYPE)
        out = out + (c,)
    return out


@triton.jit
def _zero_d_tiles(ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Tuple of ``NUM_D_TILES`` fp32 zero accumulators ``[ROWS, BLOCK_D]``."""
    out = ()
    for t in tl.static_range(NUM_D_TILES):
        out = out + (tl.zeros([ROWS, BLOCK_D], dtype=tl.float32),)
    return out


@triton.jit
def _attention_program(q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_ids_ptr, head_dim_v, num_heads, num_blocks,
                       stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh, stride_a2_gb, stride_a2_gh,
                       stride_a2map_gb, stride_a2map_gh, stride_hg, DV_PAD: tl.constexpr):
    """What every attention kernel's program starts from: its block (grid axis 0, one of
    ``num_blocks``); its group ``(b, h)`` (:func:`_group`) with that group's Q, A2 and their block
    maps and its ``h = A3 Y`` rows; where its part of the concatenated score plan starts
    (``plan_ids[g]``, 4 bytes of the "layout" tally, times ``num_blocks + 1`` row or column
    pointers); ``b``, ``h``, ``g`` (int64) for the kernel's own offsets; and the value columns
    ``offs_dv`` with their in-range mask."""
    blk = tl.program_id(0)
    zb, zh, g = _group(num_heads)
    q_ptr, qmap_ptr = _group_operand(q_ptr, qmap_ptr, zb, zh, stride_q_gb, stride_q_gh, stride_qmap_gb, stride_qmap_gh)
    a2_ptr, a2map_ptr = _group_operand(a2_ptr, a2map_ptr, zb, zh, stride_a2_gb, stride_a2_gh, stride_a2map_gb,
                                       stride_a2map_gh)
    h_ptr += g.to(tl.int64) * stride_hg
    plan_start = tl.load(plan_ids_ptr + g) * (num_blocks + 1)
    offs_dv = tl.arange(0, DV_PAD)
    return (blk, q_ptr, qmap_ptr, a2_ptr, a2map_ptr, h_ptr, plan_start, zb, zh, g.to(tl.int64), offs_dv,
            offs_dv < head_dim_v)


@triton.jit
def _rows(blk, start, seqlen, mask_dv, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``[start, start + ROWS)`` of block ``blk`` (of ``BLOCK`` rows) of a ``[seqlen, ...]``
    tensor: their offsets within the block, their indices, the in-range mask and that mask across
    the value columns (``[ROWS, DV_PAD]``)."""
    offs_r = start + tl.arange(0, ROWS)
    rows = blk * BLOCK + offs_r
    mask = rows < seqlen
    return offs_r, rows, mask, mask[:, None] & mask_dv[None, :]


@triton.jit
def _own_rows(base, map_ptr, blk, seqlen, mask_dv, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
              BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """The program's own block ``blk`` of an operand (Q in the query-block kernels, A2 in dK/dV):
    its rows (:func:`_rows`), tile ids and every stored d-tile (:func:`_load_d_tiles`, a tuple of
    ``[BLOCK, BLOCK_D]``) with the bytes read."""
    offs_r, rows, mask, mask_2 = _rows(blk, 0, seqlen, mask_dv, BLOCK, BLOCK)
    ids = _d_ids(map_ptr, blk, NUM_D_TILES)
    tiles, read = _load_d_tiles(base, ids, _shared(ids, ids, NUM_D_TILES), offs_r, mask, nb, stride_ta, stride_tb,
                                stride_r, stride_c, n_cols, BLOCK_D, NUM_D_TILES)
    return offs_r, rows, mask, mask_2, ids, tiles, read


@triton.jit
def _kept_rows(base, map_ptr, blk, start, own_ids, seqlen, mask_dv, nb, stride_ta, stride_tb, stride_r, stride_c,
               n_cols, BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr):
    """Rows ``[start, start + ROWS)`` of block ``blk`` of the other operand, met in the main loop:
    the rows (:func:`_rows`), the flags of the d-tiles stored in both its block row and the
    program's own (``own_ids``), those d-tiles (:func:`_load_d_tiles`, a tuple of
    ``[ROWS, BLOCK_D]``) and the bytes read."""
    offs_r, rows, mask, mask_2 = _rows(blk, start, seqlen, mask_dv, BLOCK, ROWS)
    ids = _d_ids(map_ptr, blk, NUM_D_TILES)
    both = _shared(own_ids, ids, NUM_D_TILES)
    tiles, read = _load_d_tiles(base, ids, both, offs_r, mask, nb, stride_ta, stride_tb, stride_r, stride_c, n_cols,
                                BLOCK_D, NUM_D_TILES)
    return rows, mask, mask_2, both, tiles, read


@triton.jit
def _grad_group(do_ptr, lse_ptr, delta_ptr, gl, stride_dog, stride_lse_g):
    """``dO``, ``lse`` and ``delta`` of group ``gl`` (``lse`` and ``delta`` share their group stride)."""
    return do_ptr + gl * stride_dog, lse_ptr + gl * stride_lse_g, delta_ptr + gl * stride_lse_g


@triton.jit
def _grad_rows(do_ptr, lse_ptr, delta_ptr, rows, mask_m, mask_mdv, offs_dv, stride_dom, stride_dod):
    """What the backward reads per query row: ``dO`` (``[len(rows), DV_PAD]``), ``lse`` in base 2
    (``+inf`` outside the rows) and ``delta``."""
    do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=mask_mdv, other=0.0)  # [len(rows), DV_PAD]
    lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=float("inf")) * LOG2E  # [len(rows)], base 2
    delta = tl.load(delta_ptr + rows, mask=mask_m, other=0.0)  # [len(rows)]
    return do, lse2, delta


@triton.jit
def _io_operands(io_ptr, Q: tl.constexpr, A2: tl.constexpr, H: tl.constexpr, Q_MAP: tl.constexpr,
                 A2_MAP: tl.constexpr, LAYOUT: tl.constexpr, q_bytes, a2_bytes, h_bytes, q_rows, a2_rows,
                 layout_bytes, NUM_D_TILES: tl.constexpr):
    """The tallies of every attention kernel: Q, A2 and h read, ``q_rows`` and ``a2_rows`` block-map
    rows (``4 * NUM_D_TILES`` bytes each) and ``layout_bytes`` of the score plan."""
    io_add(io_ptr, Q, q_bytes, 0)
    io_add(io_ptr, A2, a2_bytes, 0)
    io_add(io_ptr, H, h_bytes, 0)
    io_add(io_ptr, Q_MAP, q_rows * 4 * NUM_D_TILES, 0)
    io_add(io_ptr, A2_MAP, a2_rows * 4 * NUM_D_TILES, 0)
    io_add(io_ptr, LAYOUT, layout_bytes, 0)
