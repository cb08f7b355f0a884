"""Structural nonzero counts for Theorem 4.5: ``nnz_stats(A1, X, A2, qk_layout)``.

Z_A = min(nnz A1, nnz A2), Z_X = nnz X, Z_AX = min(nnz A1·X, nnz X·A2ᵀ), Z_AXA = nnz A1·X·A2ᵀ.
Counts are *structural*: an entry of a product is nonzero when some term of its sum pairs two
stored entries (no cancellation), as in the paper's sparse semiring model.

Everything goes through ``scipy.sparse`` boolean patterns (SciPy is imported on the first call, not
with the package). The n x n_k product A1·X·A2ᵀ is never materialized: entry ``(i, j)`` is nonzero
iff row pattern ``u(i)`` of A1·X meets row pattern ``v(j)`` of A2, so only the table of distinct
patterns ``T[u, v]`` is multiplied (rows grouped by a verified hash of their columns). Unrestricted,
Z_AXA is ``Σ T[u, v]`` weighted by how many rows carry each pattern; restricted to a QK layout, the
kept blocks are grouped by (patterns of their rows, patterns of their columns, element mask) and
each group is evaluated once. Dense operands (one pattern) thus cost O(kept blocks + stored masks)
beyond reading the operands, at any ``n``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparse_io_attn.bounds import calculator
from sparse_io_attn.layout import _bits

_CHUNK_ENTRIES = 1 << 23   # entries per chunk of the pattern table and of the block evaluation
_DENSE_TABLE = 1 << 26     # pattern tables up to this many entries are looked up densely


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
    import scipy.sparse as sp

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
        pat = _dense_pattern((arr != 0).numpy())
    elif sp.issparse(op):
        coo = sp.coo_matrix(op)
        pat = sp.csr_matrix((np.ones(coo.nnz, dtype=bool), (coo.row, coo.col)), shape=coo.shape)
    elif isinstance(op, np.ndarray):
        if op.ndim != 2:
            raise ValueError(f"{what} must be 2-D, got shape {op.shape}")
        pat = _dense_pattern(op != 0)
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


def _dense_pattern(nonzero: np.ndarray) -> sp.csr_matrix:
    """The csr pattern of a dense boolean matrix, its column indices found ``_CHUNK_ENTRIES``
    elements at a time (int32 where they fit: no pair of int64 coordinates per nonzero)."""
    import scipy.sparse as sp

    n, m = nonzero.shape
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nonzero.sum(1), out=indptr[1:])
    small = max(indptr[-1], m) < 2 ** 31
    indices = np.empty(int(indptr[-1]), dtype=np.int32 if small else np.int64)
    step = max(1, _CHUNK_ENTRIES // max(1, m))
    for s in range(0, n, step):
        indices[indptr[s]:indptr[min(s + step, n)]] = np.nonzero(nonzero[s:s + step])[1]
    if small:
        indptr = indptr.astype(np.int32)
    return sp.csr_matrix((np.ones(len(indices), dtype=bool), indices, indptr), shape=(n, m))


def _bool(m) -> sp.csr_matrix:
    import scipy.sparse as sp

    m = sp.csr_matrix(m)
    m.eliminate_zeros()
    return sp.csr_matrix((np.ones(m.nnz, dtype=bool), m.indices, m.indptr), shape=m.shape)


def _product(a: sp.csr_matrix, b: sp.csr_matrix) -> sp.csr_matrix:
    """Structural product (int counts of contributing pairs, then their pattern)."""
    return _bool(a.astype(np.int64) @ b.astype(np.int64))


def _row_hashes(m: sp.csr_matrix) -> np.ndarray:
    """A 64-bit hash of each row's (sorted) column indices, ``int64 [rows]``, in O(nnz)."""
    lengths = np.diff(m.indptr).astype(np.int64)
    salt = np.random.default_rng(0x5EED).integers(0, 2 ** 63 - 1, size=m.shape[1] + 1, dtype=np.int64)
    h = np.zeros(m.shape[0], dtype=np.int64)
    if m.nnz:
        with np.errstate(over="ignore"):
            position = np.arange(m.nnz, dtype=np.int64) - np.repeat(m.indptr[:-1].astype(np.int64), lengths)
            terms = salt[m.indices] * (position + 1)
            nonempty = lengths > 0
            h[nonempty] = np.add.reduceat(terms, m.indptr[:-1][nonempty].astype(np.int64))
    return h


def _unique_rows(m: sp.csr_matrix):
    """``(unique-row csr, inverse index)``: rows with identical patterns collapse to one, numbered
    by first appearance.

    Rows are grouped by :func:`_row_hashes` and their lengths (vectorised); every row is then
    compared with its group's first row, so a hash collision cannot merge different rows (the
    exact per-row comparison runs instead)."""
    m = m.sorted_indices() if not m.has_sorted_indices else m
    if m.shape[0] == 0:
        return m, np.zeros(0, dtype=np.int64)
    lengths = np.diff(m.indptr).astype(np.int64)
    with np.errstate(over="ignore"):
        key = _row_hashes(m) * np.int64(0x9E3779B97F4A7C15 - 2 ** 64) + lengths
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    rep = first[inverse]
    same = bool((lengths == lengths[rep]).all())
    if same and m.nnz:
        position = np.arange(m.nnz, dtype=np.int64) - np.repeat(m.indptr[:-1].astype(np.int64), lengths)
        rep_position = np.repeat(m.indptr[rep].astype(np.int64), lengths) + position
        same = bool((m.indices == m.indices[rep_position]).all())
    if not same:
        return _unique_rows_exact(m)
    order = np.argsort(first, kind="stable")     # number the groups by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return m[first[order]], rank[inverse].astype(np.int64)


def _unique_rows_exact(m: sp.csr_matrix):
    """:func:`_unique_rows` by comparing each row's column bytes (the fallback on a hash collision)."""
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


def _table(W: sp.csr_matrix, U2: sp.csr_matrix) -> sp.csr_matrix:
    """Structural ``W @ U2^T`` (boolean csr ``[rows of W, rows of U2]``), ``_CHUNK_ENTRIES`` at a time:
    entry ``(u, v)`` says whether row pattern ``u`` of A1·X meets row pattern ``v`` of A2."""
    import scipy.sparse as sp

    U2T = U2.T.tocsr().astype(np.int64)
    chunk = max(1, _CHUNK_ENTRIES // max(1, U2.shape[0]))
    parts = [_bool(W[s:s + chunk].astype(np.int64) @ U2T) for s in range(0, W.shape[0], chunk)]
    return sp.vstack(parts, format="csr") if parts else sp.csr_matrix((0, U2.shape[0]), dtype=bool)


def _block_hashes(blocks: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of the int64 matrix ``blocks``, ``int64 [rows]``."""
    salt = np.random.default_rng(0x5EED).integers(0, 2 ** 63 - 1, size=blocks.shape[1], dtype=np.int64)
    with np.errstate(over="ignore"):
        return (blocks + 1) @ salt


def _signatures(ids: np.ndarray, unit: int):
    """Blocks of ``unit`` consecutive ``ids`` (the last padded with ``-1``): ``(distinct blocks
    int64 [S, unit], block -> distinct index [ceil(len / unit)])``."""
    nb = -(-len(ids) // unit)
    blocks = np.full(nb * unit, -1, dtype=np.int64)
    blocks[:len(ids)] = ids
    blocks = blocks.reshape(nb, unit)
    # grouped by hash, then verified element by element
    _, first, inverse = np.unique(_block_hashes(blocks), return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if not (blocks == blocks[first[inverse]]).all():
        uniq, inverse = np.unique(blocks, axis=0, return_inverse=True)
        return uniq, inverse.reshape(-1)
    return blocks[first], inverse


def _count_kept(T: sp.csr_matrix, row_of: np.ndarray, col_of: np.ndarray, r: np.ndarray, c: np.ndarray,
                ids: np.ndarray, masks: torch.Tensor, unit) -> int:
    """Nonzeros of ``P[i, j] = T[row_of[i], col_of[j]]`` at the allowed elements of the kept blocks
    ``(r, c)`` of ``unit = (rows, cols)`` (``ids``: ``-1`` full, else the element mask ``masks[id]``).

    P is never formed: blocks are grouped by (pattern of their rows, pattern of their columns,
    mask) and each group is evaluated once, so a dense operand (one row pattern) costs
    O(kept blocks + distinct masks) whatever ``n``."""
    import scipy.sparse as sp

    uq, uk = unit
    if len(r) == 0 or T.nnz == 0:
        return 0
    rsig, sig_r = _signatures(row_of, uq)
    csig, sig_c = _signatures(col_of, uk)
    cols = [sig_r[r], sig_c[c], ids.astype(np.int64) + 1]
    spans = [len(rsig), len(csig), masks.shape[0] + 1]
    if math.prod(spans) < 2 ** 62:
        packed = (cols[0] * spans[1] + cols[1]) * spans[2] + cols[2]
        uniq, counts = np.unique(packed, return_counts=True)
        keys = np.stack([uniq // (spans[1] * spans[2]), uniq // spans[2] % spans[1], uniq % spans[2] - 1], 1)
    else:
        keys, counts = np.unique(np.stack(cols, 1), axis=0, return_counts=True)
        keys[:, 2] -= 1
    nu, nv = T.shape
    dense = (nu + 1) * (nv + 1) <= _DENSE_TABLE
    if dense:  # a zero last row and column: padding ids (-1) read 0
        table = np.zeros((nu + 1, nv + 1), dtype=bool)
        table[:nu, :nv] = T.toarray()
    else:
        table = sp.csr_matrix((T.data, T.indices, np.append(T.indptr, T.indptr[-1])), shape=(nu + 1, nv + 1))
    total = 0
    step = max(1, _CHUNK_ENTRIES // (uq * uk))
    for s in range(0, len(keys), step):
        k = keys[s:s + step]
        ri = np.where(rsig[k[:, 0]] < 0, nu, rsig[k[:, 0]])[:, :, None]          # [K, uq, 1]
        ci = np.where(csig[k[:, 1]] < 0, nv, csig[k[:, 1]])[:, None, :]          # [K, 1, uk]
        if dense:
            vals = table[ri, ci]                                                # [K, uq, uk]
        else:
            ri, ci = np.broadcast_arrays(ri, ci)
            vals = np.asarray(table[ri.ravel(), ci.ravel()]).reshape(len(k), uq, uk) != 0
        part = k[:, 2] >= 0
        if part.any():
            vals[part] &= _bits.unpack(masks[torch.from_numpy(k[part, 2])], uk).numpy()[:, :uq, :uk]
        total += int((vals.sum((1, 2)).astype(np.int64) * counts[s:s + step]).sum())
    return total


def _layout_entries(layout, layout_index):
    """One mask of ``layout``: ``(r, c, partial_ids)`` (int64 numpy) of its kept blocks."""
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
    r = np.repeat(np.arange(lo.num_q_blocks, dtype=np.int64), np.diff(crow))
    return r, lo.col_indices[a:b].numpy().astype(np.int64), lo.partial_ids[a:b].numpy().astype(np.int64)


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
    row_of = inv_w[inv1]                     # query row -> its pattern of A1 X
    T = _table(w, u2)                        # pattern of A1 X meets pattern of A2
    m1 = np.bincount(row_of, minlength=T.shape[0]).astype(np.int64)
    m2 = np.bincount(inv2, minlength=T.shape[1]).astype(np.int64)
    total = int(m1 @ (T.astype(np.int64) @ m2)) if T.nnz else 0
    restricted = total
    if qk_layout is not None:
        if tuple(qk_layout.seqlen) != (n, n_k):
            raise ValueError(f"qk_layout covers seqlen {tuple(qk_layout.seqlen)} but A1 X A2^T is "
                             f"{n} x {n_k}; build the layout for ({n}, {n_k})")
        bq, bk = qk_layout.block_size
        if level == "block" and (b1[0], b2[0]) != (bq, bk):
            raise ValueError(f"at level='block' the layout's block size {(bq, bk)} must equal the "
                             f"row blocks of A1 and A2 {(b1[0], b2[0])}")
        r, c, ids = _layout_entries(qk_layout, layout_index)
        masks = qk_layout.partial_masks.cpu()
        if level == "block":  # a kept block, partial or not, is one entry of the block product
            ok = (r < len(row_of)) & (c < len(inv2))
            r, c, ids, unit = r[ok], c[ok], np.full(int(ok.sum()), -1, dtype=np.int64), (1, 1)
        else:
            unit = (bq, bk)
        restricted = _count_kept(T, row_of, inv2, r, c, ids, masks, unit)
    return NnzStats(
        Z_A=min(a1.nnz, a2.nnz), Z_X=x.nnz, Z_AX=min(nnz_a1x, nnz_xa2t), Z_AXA=restricted,
        level=level, restricted_to_qk_pattern=qk_layout is not None, n=n, n_k=n_k, d=d,
        nnz_A1=a1.nnz, nnz_A2=a2.nnz, nnz_A1X=nnz_a1x, nnz_XA2T=nnz_xa2t, Z_AXA_unrestricted=total)
