"""The sparsity stress test: traffic of :func:`sparse_io_attn.sparse_operands.attention` (forward + backward)
against Theorem 4.5 while the density of A1/A2, of X and of the QK pattern is swept independently.

:func:`sparsity_sweep` returns one dict per point (the CLI ``sparse-io-attn sweep sparsity`` and
``benchmarks/sparsity_stress.py`` call it). Each point:

* builds random block patterns (``torch.Generator`` seeded per point) with the swept operand at the
  given block density and the others full (dense tensors, no QK layout);
* gets the traffic of the Triton kernels, ``source = "predicted"`` (the exact traffic model, any n)
  or ``"counted"`` (the kernels run, through Triton's interpreter on a CPU; small n only), split
  into forward and backward, and without index bytes (``data_words``: matrix elements moved);
* computes Z_A, Z_X, Z_AX, Z_AXA at the element level (:func:`sparse_io_attn.bounds.nnz_stats`,
  Z_AXA restricted to the QK pattern) and Theorem 4.5 with unit constants at ``M`` = the kernels'
  per-program fast memory (:func:`~sparse_io_attn.sparse_operands.traffic.kernel_fast_memory_words`), and
  the ratios measured / bound and measured / max(compulsory, bound).

Forward and backward are each an algorithm that computes ``A1 X A2^T``, so Theorem F.3 and F.4
bound each of them alone: ``fwd_ratio`` and ``bwd_ratio`` are the per-pass ratios.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.bounds import nnz_stats, sparse
from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands import attention, kernel_fast_memory_words, predict_traffic
from sparse_io_attn.tally.counter import IOCounter

AXES = ("A", "X", "QK")
INDEX_TENSORS = ("plan", "layout", "q_map", "a2_map")
COLUMNS = ("axis", "density", "n", "d", "block_n", "block_d", "source", "M_words", "Z_A", "Z_X", "Z_AX",
           "Z_AXA", "bound_words", "binding", "regime", "compulsory_words", "fwd_words", "bwd_words",
           "total_words", "index_bytes", "fwd_ratio", "bwd_ratio", "total_ratio_floor")


def _keep(rows: int, cols: int, density: float, g: torch.Generator) -> torch.Tensor:
    keep = torch.rand(rows, cols, generator=g) < density
    keep.view(-1)[torch.randint(rows * cols, (1,), generator=g)] = True  # never empty
    return keep


def make_operands(n: int, d: int, block_n: int, block_d: int, axis: str, density: float, *, seed: int = 0,
                  dtype=torch.float32):
    """``(A1, A2, A3, X, Y, qk_layout)`` with ``axis`` ("A": A1 and A2, "X", "QK") at block
    ``density`` and the rest full. A1, X, A2 are always BlockSparseMatrix (fully stored when not
    swept: the same traffic as dense tensors, and the same tiles in every sweep). Random normal
    values, so element-level counts equal stored elements."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    g = torch.Generator().manual_seed(seed)
    nb, nd = math.ceil(n / block_n), math.ceil(d / block_d)

    def bsm(rows, cols, rho, block, shape):
        keep = _keep(rows, cols, rho, g) if rho < 1 else torch.ones(rows, cols, dtype=torch.bool)
        return BlockSparseMatrix.random(keep, block, shape=shape, dtype=dtype, generator=g)

    rho_a, rho_x = (density if axis == "A" else 1.0), (density if axis == "X" else 1.0)
    A1 = bsm(nb, nd, rho_a, (block_n, block_d), (n, d))
    A2 = bsm(nb, nd, rho_a, (block_n, block_d), (n, d))
    X = bsm(nd, nd, rho_x, (block_d, block_d), (d, d))
    X.values = X.values / math.sqrt(d)
    qk = None
    if axis == "QK":
        qk = BlockSparseLayout.from_block_mask(_keep(nb, nb, density, g), (block_n, block_n), (n, n),
                                               name=f"random{density:g}")
    A3 = torch.randn(n, d, generator=g, dtype=dtype)
    Y = torch.randn(d, d, generator=g, dtype=dtype) / math.sqrt(d)
    return A1, A2, A3, X, Y, qk


def _split(report) -> tuple[int, int, int]:
    """``(forward data bytes, backward data bytes, index bytes)``."""
    fwd = bwd = index = 0
    for kt in report.kernels.values():
        idx = sum(kt.reads.get(t, 0) + kt.writes.get(t, 0) for t in INDEX_TENSORS)
        data = kt.total - idx
        index += idx
        if kt.name in ("paper_q", "paper_h", "paper_attn_fwd"):
            fwd += data
        else:
            bwd += data
    return fwd, bwd, index


def _counted(A1, A2, A3, X, Y, qk):
    leaves = [t.values if isinstance(t, BlockSparseMatrix) else t for t in (A1, X, A2, A3, Y)]
    for t in leaves:
        t.requires_grad_(True)
    with IOCounter() as io:
        o = attention(A1, A2, A3, X, Y, qk_layout=qk, backend="triton")
        torch.autograd.grad(o, leaves, torch.randn_like(o))
    return io.report


def stress_point(n: int, d: int, axis: str, density: float, *, block_n: int = 64, block_d: int = 16,
                 count: bool = False, seed: int = 0, dtype=torch.float32) -> dict:
    """One row of the stress table (see the module docstring for the columns)."""
    A1, A2, A3, X, Y, qk = make_operands(n, d, block_n, block_d, axis, density, seed=seed, dtype=dtype)
    report = _counted(A1, A2, A3, X, Y, qk) if count else predict_traffic(A1, A2, A3, X, Y, qk_layout=qk)
    es = itemsize(dtype)
    fwd, bwd, index = _split(report)
    M = kernel_fast_memory_words(A1, A2, A3, X, Y, qk_layout=qk)
    st = nnz_stats(A1, X, A2, qk, level="element")
    b = sparse(st.Z_A, st.Z_X, st.Z_AX, st.Z_AXA, M, n=n, d=d)
    row = dict(axis=axis, density=density, n=n, d=d, block_n=block_n, block_d=block_d, source=report.source,
               M_words=M, Z_A=st.Z_A, Z_X=st.Z_X, Z_AX=st.Z_AX, Z_AXA=st.Z_AXA, bound_words=b.value_words,
               binding=b.binding, regime=b.regime, compulsory_words=b.compulsory_words,
               fwd_words=fwd // es, bwd_words=bwd // es, total_words=(fwd + bwd) // es, index_bytes=index)
    row["fwd_ratio"] = row["fwd_words"] / b.value_words if b.value_words else math.inf
    row["bwd_ratio"] = row["bwd_words"] / b.value_words if b.value_words else math.inf
    row["total_ratio_floor"] = row["total_words"] / b.floor_words
    return row


def sparsity_sweep(n: int = 4096, d: int = 128, *, densities=(0.05, 0.1, 0.25, 0.5, 1.0), axes=AXES,
                   block_n: int = 64, block_d: int = 16, count: bool = False, seed: int = 0,
                   dtype=torch.float32, progress=None) -> list[dict]:
    """Rows of the stress test: for each axis in ``axes`` and each density, one :func:`stress_point`
    (the other operands full). ``count=True`` runs the kernels (interpreter on CPU: keep n small);
    otherwise the exact traffic model gives the bytes. ``progress``: optional callable(row)."""
    rows = []
    for axis in axes:
        for i, rho in enumerate(densities):
            row = stress_point(n, d, axis, rho, block_n=block_n, block_d=block_d, count=count,
                               seed=seed + 1000 * AXES.index(axis) + i, dtype=dtype)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of ``rows``."""
    cols = ("axis", "density", "n", "source", "Z_A", "Z_X", "Z_AX", "Z_AXA", "M_words", "bound_words", "binding",
            "compulsory_words", "fwd_words", "bwd_words", "fwd_ratio", "bwd_ratio", "total_ratio_floor")

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
