"""Structural nonzero counts for Theorem 4.5: ``nnz_stats(A1, X, A2, qk_layout)``.

Z_A = min(nnz A1, nnz A2), Z_X = nnz X, Z_AX = min(nnz A1·X, nnz X·A2ᵀ), Z_AXA = nnz A1·X·A2ᵀ.
Counts are *structural*: an entry of a product is nonzero when some term of its sum pairs two
stored entries (no cancellation), as in the paper's sparse semiring model.

Everything goes through ``scipy.sparse`` boolean patterns. The n x n product A1·X·A2ᵀ is never
materialized: rows of A1·X with the same pattern are counted once, and the distinct rows are
multiplied by A2ᵀ in chunks whose results are reduced to counts per key block and dropped, so
``n = 131072`` works when the product is sparse enough (or has few distinct row patterns).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp
import torch

from sparse_io_attn.bounds import calculator
from sparse_io_attn.layout import _bits

_CHUNK_ROWS = 4096  # product rows per chunk when counting inside partial blocks
_CHUNK_ENTRIES = 1 << 23   # rows per chunk = max(1, _CHUNK_ENTRIES // n_k)


@dataclass(frozen=True)
class NnzStats:
    """The four counts of Theorem 4.5 plus the raw counts behind them.

    ``level``: ``"element"`` (counts are matrix entries) or ``"block"`` (counts are stored blocks,
    e.g. of a BSR operand; not words: a bound in words needs the element level).
    ``restricted_to_qk_pattern``: Z_AXA counts only entries (or blocks) the QK layout keeps;
    ``Z_AXA_unrestricted`` is the count without the layout. Theorem 4.5 is proven for the full
    structural product; with a restricted count its formula is an estimate, not a proven lower
    bound (:meth:`bound` says so in the record's ``note``).
    """
    Z_A: int
    Z_X: int
    Z_AX: int
    Z_AXA: int
    level: str
    restricted_to_qk_pattern: bool
    n: int          # rows of A1 (query length), in elements
    n_k: int        # rows of A2 (key length), in elements
    d: int
    nnz_A1: int
    nnz_A2: int
    nnz_A1X: int
    nnz_XA2T: int
    Z_AXA_unrestricted: int

    def to_dict(self) -> dict:
        return asdict(self)

    def bound(self, M, *, dtype=None, heads: int = 1):
        """:func:`~sparse_io_attn.bounds.sparse` evaluated on these counts (element level only)."""
        if self.level != "element":
            raise ValueError("a bound in words needs element-level counts; call nnz_stats(..., "
                             "level='element')")
        note = ("Z_AXA restricted to a QK pattern: masked attention is outside Theorem 4.5's "
                "hypotheses (structural product of sparse operands); not a proven lower bound"
                if self.restricted_to_qk_pattern else "")
        return calculator.sparse(self.Z_A, self.Z_X, self.Z_AX, self.Z_AXA, M, n=max(self.n, self.n_k),
                      d=self.d, dtype=dtype, heads=heads, note=note)

    def informal_bound(self, M, *, dtype=None, heads: int = 1):
        """Theorem 1.2 (:func:`~sparse_io_attn.bounds.sparse_informal`) on these counts, with
        ``Z_input = Z_A`` and ``Z_QK = Z_AXA`` (element level only)."""
        if self.level != "element":
            raise ValueError("a bound in words needs element-level counts; call nnz_stats(..., "
                             "level='element')")
        note = ("Z_QK restricted to a QK pattern: outside the theorem's hypotheses; not a proven lower bound"
                if self.restricted_to_qk_pattern else "")
        return calculator.sparse_informal(self.Z_A, self.Z_AXA, M, n=max(self.n, self.n_k), d=self.d, dtype=dtype,
                               heads=heads, note=note)

    def __str__(self) -> str:
        unit = "entries" if self.level == "element" else "blocks"
        restr = " (restricted to the QK pattern)" if self.restricted_to_qk_pattern else ""
        return (f"NnzStats[{self.level}, {unit}] n={self.n:,} n_k={self.n_k:,} d={self.d}: "
                f"Z_A={self.Z_A:,} Z_X={self.Z_X:,} Z_AX={self.Z_AX:,} Z_AXA={self.Z_AXA:,}{restr}")


def _pattern(op, what: str, level: str, block_size):
    """``(csr bool pattern, (row_block, col_block) or None, element shape)`` of one operand.

    Element level: BSR-like operands count every element of every stored block; dense inputs count
    nonzeros; scipy matrices count stored entries. Block level: the block pattern (blocksize from a
    BSR operand, else ``block_size``)."""
    bsr = None
    if hasattr(op, "to_scipy_bsr"):
        bsr = op.to_scipy_bsr()
    elif isinstance(op, sp.bsr_matrix) or (hasattr(sp, "bsr_array") and isinstance(op, sp.bsr_array)):
        bsr = op
    if bsr is not None:
        bsr = sp.bsr_matrix(bsr)
        br, bc = bsr.blocksize
        nbr, nbc = bsr.shape[0] // br, bsr.shape[1] // bc
        blocks = sp.csr_matrix((np.ones(len(bsr.indices), dtype=bool), bsr.indices.copy(), bsr.indptr.copy()),
                               shape=(nbr, nbc))
        blocks.sum_duplicates()
        # an operand whose size is not a multiple of its block is stored padded: crop to its shape
        shape = tuple(int(s) for s in getattr(op, "shape", bsr.shape))
        if level == "block":
            return blocks.astype(bool), (br, bc), shape
        elem = sp.kron(blocks, np.ones((br, bc), dtype=bool), format="csr")[: shape[0], : shape[1]]
        return sp.csr_matrix(elem.astype(bool)), None, shape
    if isinstance(op, torch.Tensor):
        arr = op.detach().cpu()
        if arr.dim() != 2:
            raise ValueError(f"{what} must be 2-D, got shape {tuple(arr.shape)}")
        rows, cols = (arr != 0).nonzero(as_tuple=True)
        pat = sp.csr_matrix((np.ones(rows.numel(), dtype=bool), (rows.numpy(), cols.numpy())),
                            shape=tuple(arr.shape))
    elif sp.issparse(op):
        coo = sp.coo_matrix(op)
        pat = sp.csr_matrix((np.ones(coo.nnz, dtype=bool), (coo.row, coo.col)), shape=coo.shape)
    elif isinstance(op, np.ndarray):
        if op.ndim != 2:
            raise ValueError(f"{what} must be 2-D, got shape {op.shape}")
        rows, cols = np.nonzero(op)
        pat = sp.csr_matrix((np.ones(len(rows), dtype=bool), (rows, cols)), shape=op.shape)
    else:
        raise TypeError(f"{what} must be a torch.Tensor, numpy array, scipy.sparse matrix or an "
                        f"object with to_scipy_bsr(), got {type(op).__name__}")
    pat.sum_duplicates()
    if level == "element":
        return pat, None, pat.shape
    if block_size is None:
        raise ValueError(f"level='block' needs the block structure of {what}: pass a BSR operand "
                         f"(to_scipy_bsr()) or block_size=(rows, cols)")
    br, bc = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    nbr, nbc = math.ceil(pat.shape[0] / br), math.ceil(pat.shape[1] / bc)
    coo = pat.tocoo()
    blocks = sp.csr_matrix((np.ones(coo.nnz, dtype=bool), (coo.row // br, coo.col // bc)), shape=(nbr, nbc))
    blocks.sum_duplicates()
    return blocks.astype(bool), (br, bc), pat.shape


def _bool(m) -> sp.csr_matrix:
    m = sp.csr_matrix(m)
    m.eliminate_zeros()
    return sp.csr_matrix((np.ones(m.nnz, dtype=bool), m.indices, m.indptr), shape=m.shape)


def _product(a: sp.csr_matrix, b: sp.csr_matrix) -> sp.csr_matrix:
    """Structural product (int counts of contributing pairs, then their pattern)."""
    return _bool(a.astype(np.int64) @ b.astype(np.int64))


def _unique_rows(m: sp.csr_matrix):
    """``(unique-row csr, inverse index)``: rows with identical patterns collapse to one."""
    m = m.sorted_indices() if not m.has_sorted_indices else m
    seen: dict = {}
    inverse = np.empty(m.shape[0], dtype=np.int64)
    keep = []
    indptr, indices = m.indptr, m.indices
    for i in range(m.shape[0]):
        key = indices[indptr[i]:indptr[i + 1]].tobytes()
        u = seen.get(key)
        if u is None:
            u = seen[key] = len(keep)
            keep.append(i)
        inverse[i] = u
    return m[np.asarray(keep, dtype=np.int64)], inverse


def _count_product(W: sp.csr_matrix, row_of: np.ndarray, A2T: sp.csr_matrix, row_block: int,
                   col_block: int, keep: sp.csr_matrix | None):
    """``(nnz of P, nnz of P restricted to keep)`` for the product ``P = W[row_of] @ A2T`` without
    materializing it: row ``i`` of P has the pattern of ``W[row_of[i]] @ A2T``.

    ``keep`` is a boolean (num_row_blocks x num_col_blocks) pattern in units of
    ``row_block``/``col_block`` rows/columns of ``P``, or ``None``."""
    n_q, n_k = len(row_of), A2T.shape[1]
    A2T = A2T.astype(np.int64)
    chunk = max(1, _CHUNK_ENTRIES // max(1, n_k))
    if keep is None:
        counts = np.concatenate([_bool(W[s:s + chunk].astype(np.int64) @ A2T).getnnz(axis=1)
                                 for s in range(0, W.shape[0], chunk)] or [np.zeros(0, np.int64)])
        total = int(counts.astype(np.int64)[row_of].sum())
        return total, total
    ncb = math.ceil(n_k / col_block)
    to_block = sp.csr_matrix((np.ones(n_k, dtype=np.int64), (np.arange(n_k), np.arange(n_k) // col_block)),
                             shape=(n_k, ncb))
    parts = [sp.csr_matrix(_bool(W[s:s + chunk].astype(np.int64) @ A2T).astype(np.int64) @ to_block)
             for s in range(0, W.shape[0], chunk)]
    per_block = sp.vstack(parts, format="csr") if parts else sp.csr_matrix((0, ncb), dtype=np.int64)
    total = int(np.asarray(per_block.sum(axis=1)).ravel()[row_of].sum())
    # group rows of P by (pattern, row block) and sum their counts over the kept column blocks
    rb = np.arange(n_q) // row_block
    pairs, mult = np.unique(np.stack([row_of, rb], axis=1), axis=0, return_counts=True)
    kept = per_block[pairs[:, 0]].multiply(sp.csr_matrix(keep, dtype=np.int64)[pairs[:, 1]])
    restricted = int((np.asarray(kept.sum(axis=1)).ravel() * mult).sum())
    return total, restricted


def _count_inside(W: sp.csr_matrix, row_of: np.ndarray, A2T: sp.csr_matrix, inside: sp.csr_matrix) -> int:
    """Structural nonzeros of ``P = W[row_of] @ A2T`` at the entries of ``inside`` (only the rows
    ``inside`` touches are multiplied)."""
    rows = np.unique(inside.tocoo().row)
    total = 0
    for s0 in range(0, len(rows), _CHUNK_ROWS):
        r = rows[s0:s0 + _CHUNK_ROWS]
        prod = _bool(W[row_of[r]].astype(np.int64) @ A2T.astype(np.int64))
        total += int(prod.multiply(inside[r]).sum())
    return total


def _block_pattern(elements: sp.csr_matrix, bq: int, bk: int):
    """Blocks holding an element of ``elements``, boolean ``[ceil(n/bq), ceil(m/bk)]``."""
    coo = elements.tocoo()
    shape = (math.ceil(elements.shape[0] / bq), math.ceil(elements.shape[1] / bk))
    m = sp.csr_matrix((np.ones(coo.nnz, dtype=bool), (coo.row // bq, coo.col // bk)), shape=shape)
    m.sum_duplicates()
    return m.astype(bool)


def _layout_keep(layout, layout_index):
    """One mask of ``layout``: ``(full-block pattern csr [num_q_blocks, num_kv_blocks], partial
    elements csr [seqlen_q, seqlen_k])`` (the allowed elements of its partial blocks)."""
    L = layout.num_layouts
    if layout_index is None:
        if L != 1:
            raise ValueError(f"qk_layout holds {L} masks (batch x heads); pass layout_index= to pick "
                             f"the (batch * layout_heads + head) mask the operands belong to")
        layout_index = 0
    if not 0 <= layout_index < L:
        raise ValueError(f"layout_index must be in [0, {L}), got {layout_index}")
    lo = layout.to("cpu")
    crow = lo.crow_indices[layout_index].numpy().astype(np.int64)
    a, b = int(crow[0]), int(crow[-1])
    col = lo.col_indices.numpy().astype(np.int64)[a:b]
    pid = lo.partial_ids.numpy()[a:b]
    full = pid < 0
    row = np.repeat(np.arange(lo.num_q_blocks), np.diff(crow))
    keep = sp.csr_matrix((np.ones(int(full.sum()), dtype=bool), (row[full], col[full])),
                         shape=(lo.num_q_blocks, lo.num_kv_blocks))
    (bq, bk), (sq, sk) = lo.block_size, lo.seqlen
    elems = _bits.unpack(lo.partial_masks[torch.from_numpy(pid[~full]).long()], bk).numpy()  # [P, bq, bk]
    e, i, j = np.nonzero(elems)
    qi, kj = row[~full][e] * bq + i, col[~full][e] * bk + j
    partial = sp.csr_matrix((np.ones(len(qi), dtype=bool), (qi, kj)), shape=(sq, sk))
    return keep, partial


def _check_block_size(block_size):
    """``block_size`` as a positive int or a pair of positive ints (``ValueError``/``TypeError``)."""
    sizes = (block_size,) if isinstance(block_size, numbers.Integral) else block_size
    try:
        sizes = tuple(sizes)
    except TypeError:
        raise TypeError(f"block_size must be a positive int or a pair (rows, cols) of positive ints, got "
                        f"{type(block_size).__name__} {block_size!r}") from None
    if len(sizes) not in (1, 2) or any(isinstance(b, (bool, np.bool_)) or not isinstance(b, numbers.Integral)
                                       for b in sizes):
        raise TypeError(f"block_size must be a positive int or a pair (rows, cols) of positive ints, got "
                        f"{block_size!r}")
    if any(int(b) < 1 for b in sizes):
        raise ValueError(f"block_size must be positive (a block holds at least one element), got {block_size!r}")
    return int(sizes[0]) if len(sizes) == 1 else (int(sizes[0]), int(sizes[1]))


def nnz_stats(A1, X, A2, qk_layout=None, *, level: str = "element", block_size=None,
              layout_index: int | None = None) -> NnzStats:
    """Structural counts of Theorem 4.5 for ``S = A1 · X · A2ᵀ`` (A1: n x d, X: d x d, A2: n_k x d).

    Operands: dense ``torch.Tensor``/NumPy arrays (nonzeros count), ``scipy.sparse`` matrices
    (stored entries count), or objects with ``to_scipy_bsr()`` such as ``BlockSparseMatrix``
    (every element of a stored block counts at the element level).

    ``level="element"`` counts entries; ``level="block"`` counts blocks of the BSR structure
    (``block_size`` gives it for operands that are not BSR). ``qk_layout``: a
    :class:`~sparse_io_attn.BlockSparseLayout` of the n x n_k score matrix; Z_AXA then counts only
    the entries the layout allows (element level: full blocks and the mask bits of partial blocks,
    exactly) or the kept blocks (block level). A layout with several masks needs ``layout_index``.
    """
    if level not in ("element", "block"):
        raise ValueError(f"level must be 'element' or 'block', got {level!r}")
    if block_size is not None:
        block_size = _check_block_size(block_size)
    a1, b1, s1 = _pattern(A1, "A1", level, block_size)
    x, bx, sx = _pattern(X, "X", level, block_size)
    a2, b2, s2 = _pattern(A2, "A2", level, block_size)
    n, d = s1
    if sx != (d, d):
        raise ValueError(f"X must be d x d = {d} x {d} to match A1 {s1}, got {sx}")
    if s2[1] != d:
        raise ValueError(f"A2 must have d = {d} columns like A1, got shape {s2}")
    n_k = s2[0]
    if level == "block":
        if b1[1] != bx[0] or bx[1] != b2[1]:
            raise ValueError(f"block sizes do not chain: A1 blocks {b1}, X blocks {bx}, A2 blocks {b2}; "
                             f"A1's column block must equal X's row block and X's column block A2's")
    # Patterns of A1 X depend only on A1's row patterns, those of X A2^T only on A2's: multiply
    # the distinct rows only (a dense operand has one distinct row pattern).
    u1, inv1 = _unique_rows(a1)
    u1x = _product(u1, x)
    nnz_a1x = int(u1x.getnnz(axis=1).astype(np.int64)[inv1].sum())
    u2, inv2 = _unique_rows(a2)
    xu2t = _product(x, u2.T.tocsr())
    nnz_xa2t = int(xu2t.getnnz(axis=0).astype(np.int64)[inv2].sum())
    w, inv_w = _unique_rows(u1x)
    keep = None
    row_unit, col_unit = 1, 1
    if qk_layout is not None:
        if tuple(qk_layout.seqlen) != (n, n_k):
            raise ValueError(f"qk_layout covers seqlen {tuple(qk_layout.seqlen)} but A1 X A2^T is "
                             f"{n} x {n_k}; build the layout for ({n}, {n_k})")
        keep, partial = _layout_keep(qk_layout, layout_index)
        bq, bk = qk_layout.block_size
        if level == "element":
            row_unit, col_unit = bq, bk
        else:  # a partial block counts as a kept block
            keep = (keep + _block_pattern(partial, bq, bk)).astype(bool)
        if level == "block" and (b1[0], b2[0]) != (bq, bk):
            raise ValueError(f"at level='block' the layout's block size {(bq, bk)} must equal the "
                             f"row blocks of A1 and A2 {(b1[0], b2[0])}")
    total, restricted = _count_product(w, inv_w[inv1], a2.T.tocsr(), row_unit, col_unit, keep)
    if qk_layout is not None and level == "element" and partial.nnz:
        restricted += _count_inside(w, inv_w[inv1], a2.T.tocsr(), partial)
    return NnzStats(
        Z_A=min(a1.nnz, a2.nnz), Z_X=x.nnz, Z_AX=min(nnz_a1x, nnz_xa2t), Z_AXA=restricted,
        level=level, restricted_to_qk_pattern=qk_layout is not None, n=n, n_k=n_k, d=d,
        nnz_A1=a1.nnz, nnz_A2=a2.nnz, nnz_A1X=nnz_a1x, nnz_XA2T=nnz_xa2t, Z_AXA_unrestricted=total)
