"""The kernel-level version of the paper's Figure 1, from the exact traffic model (:mod:`.traffic`).

For fixed ``n, d`` and a sweep of the fast memory ``M`` (words), the bytes each backward moves:

* ``small``: the small-cache kernels (Algorithm 6), ``B = sqrt(M/4)``.
* ``faithful``: the large-cache kernels as the paper writes them (Algorithm 9), where they fit.
* ``fa2``: the FlashAttention-2-style large-cache variant (dQ then ``g = A1^T dQ``) with tiles sized
  for ``M``; ``fa2_model`` extends its schedule below the 16-row tiles ``tl.dot`` needs (model only)
  so it can be set against the small-cache kernel over the whole small-cache range.

``g path`` columns count only the kernels that compute ``dX = g`` (the paper's quantity); ``all``
columns the full backward (all five gradients). Two derived quantities isolate the ``M``-dependent
traffic the bounds are about:

* :func:`small_tiled_reads`: the small-cache traffic less its ``M``-independent part (every write,
  and the element-wise sweeps over ``f, q`` in phases 1 and 3): the operand reads of the tiled
  products, which fall as ``1/B ~ M^(-1/2)``.
* :func:`reread_bytes`: bytes read beyond one pass over each tensor per kernel (the re-reads a larger
  ``M`` saves), used for the large-cache kernels.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn.accounting.report import TrafficReport
from sparse_io_attn.dense.tiling import small_cache_block
from sparse_io_attn.dense.traffic import _itemsize, large_cache_traffic, small_cache_traffic


def tensor_bytes(n: int, d: int, dtype=torch.float32) -> dict:
    """Size in bytes of every tensor the dense backward kernels name (batch 1)."""
    I, F = _itemsize(dtype), 4
    sizes = {t: n * d * I for t in ("A1", "A2", "A3", "dO", "O", "dA1", "dA2", "dA3")}
    sizes.update({t: n * d * F for t in ("S", "h", "dS", "dh", "T")})
    sizes.update({t: n * n * F for t in ("f", "q", "p")})
    sizes.update({t: d * d * I for t in ("X", "Y")})
    sizes.update({t: d * d * F for t in ("dX", "dY")})
    sizes.update({t: n * F for t in ("lse", "v")})
    return sizes


def small_tiled_reads(report: TrafficReport) -> int:
    """Small-cache traffic less its ``M``-independent part (see the module docstring)."""
    total = 0
    for kt in report.kernels.values():
        if kt.name == "small.phase3.p":
            continue
        total += sum(b for t, b in kt.reads.items() if not (kt.name == "small.phase1.f" and t == "f"))
    return total


def reread_bytes(report: TrafficReport, sizes: dict) -> int:
    """Bytes read beyond one pass over each tensor, per kernel (launches of one kernel name that
    read different tensors are fine: each tensor is charged once per kernel name and launch)."""
    out = 0
    for kt in report.kernels.values():
        for t, b in kt.reads.items():
            out += max(0, b - sizes[t])
    return out


def _try(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return None


def sweep(n: int, d: int, Ms, dtype=torch.float32) -> list[dict]:
    """One row per ``M``: bytes of every backward (``None`` where a kernel cannot run)."""
    sizes = tensor_bytes(n, d, dtype)
    rows = []
    for M in Ms:
        r = {"M": M, "M_over_d2": M / (d * d)}
        small_g = _try(small_cache_traffic, n, d, M, dtype=dtype, g_only=True)
        small_all = _try(small_cache_traffic, n, d, M, dtype=dtype)
        r["B"] = small_cache_block(M) if small_g else None
        r["small_g"] = small_g.total_bytes if small_g else None
        r["small_all"] = small_all.total_bytes if small_all else None
        r["small_g_tiled_reads"] = small_tiled_reads(small_g) if small_g else None
        for name, kw in (("faithful", dict(variant="faithful")), ("fa2", dict(variant="fa2")),
                         ("fa2_model", dict(variant="fa2", min_block=1))):
            g = _try(large_cache_traffic, n, d, M, dtype=dtype, g_only=True, **kw)
            a = _try(large_cache_traffic, n, d, M, dtype=dtype, **kw)
            r[f"{name}_g"] = g.total_bytes if g else None
            r[f"{name}_all"] = a.total_bytes if a else None
            r[f"{name}_g_rereads"] = reread_bytes(g, sizes) if g else None
        from sparse_io_attn.bounds import dense_backward
        b = dense_backward(n, d, M, form="paper")
        r["bound_bytes"] = b.value_words * _itemsize(dtype)
        r["bound_small_term_bytes"] = b.terms["small_cache"] * _itemsize(dtype)
        r["bound_large_term_bytes"] = b.terms["large_cache"] * _itemsize(dtype)
        rows.append(r)
    return rows


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def summarize(n: int, d: int, dtype=torch.float32) -> dict:
    """The Figure-1 numbers: slopes, the faithful kernel's plateau, and the small/fa2 crossing.

    * small: ``M = 4 B^2`` for ``B = 16, 32, ...`` below ``d^2`` (one point per tile size).
    * large (faithful, fa2): powers of two from the smallest ``M`` that runs up to ``n d``.
    * crossing: the smallest ``M`` (grid ``2^(k/4)``) at which ``fa2_model`` (g path) moves no more
      bytes than ``small`` (g path).
    """
    d2 = d * d
    small_Ms = [4 * b * b for b in (16, 32, 64, 128, 256, 512, 1024) if 4 * b * b < d2]
    top = n * d
    pow2 = [1 << k for k in range(10, int(math.log2(top)) + 1)]
    rows = {r["M"]: r for r in sweep(n, d, sorted(set(small_Ms + pow2)), dtype)}
    out = {"n": n, "d": d, "dtype": str(dtype).replace("torch.", ""), "d2": d2}
    out["small_Ms"] = small_Ms
    if len(small_Ms) < 2:
        raise ValueError(f"d = {d} leaves fewer than two small-cache tile sizes below d^2 = {d2} "
                         f"(B >= 16 needs M >= 1024); use d >= 128")
    out["small_tiled_slope"] = loglog_slope(small_Ms, [rows[M]["small_g_tiled_reads"] for M in small_Ms])
    out["small_total_slope"] = loglog_slope(small_Ms, [rows[M]["small_g"] for M in small_Ms])
    for name in ("faithful", "fa2"):
        Ms = [M for M in pow2 if rows[M][f"{name}_g"] is not None and M >= d2]
        out[f"{name}_Ms"] = Ms
        out[f"{name}_min_M"] = Ms[0] if Ms else None
        # where the paper's analysis applies: d^2 <= M, until the traffic stops falling
        falling = [Ms[0]] if Ms else []
        for M in Ms[1:]:
            if rows[M][f"{name}_g"] < rows[falling[-1]][f"{name}_g"] * 0.99:
                falling.append(M)
            else:
                break
        out[f"{name}_falling_Ms"] = falling
        if len(falling) >= 2:
            out[f"{name}_slope"] = loglog_slope(falling, [rows[M][f"{name}_g"] for M in falling])
            out[f"{name}_reread_slope"] = loglog_slope(falling, [rows[M][f"{name}_g_rereads"] for M in falling])
        plateau = [M for M in Ms if M > falling[-1]] if falling else []
        out[f"{name}_plateau_from_M"] = falling[-1] if plateau else None
        out[f"{name}_plateau_bytes"] = rows[falling[-1]][f"{name}_g"] if plateau else None
    fine = sorted({int(round(2 ** (k / 4))) for k in range(40, int(4 * math.log2(top)) + 1)})
    fine_rows = sweep(n, d, fine, dtype)
    cross = next((r["M"] for r in fine_rows if r["fa2_model_g"] is not None and r["small_g"] is not None
                  and r["fa2_model_g"] <= r["small_g"]), None)
    out["crossing_M"] = cross
    out["crossing_over_d2"] = cross / d2 if cross else None
    out["small_wins_below"] = all(r["small_g"] < r["fa2_model_g"] for r in fine_rows
                                  if r["fa2_model_g"] is not None and r["small_g"] is not None
                                  and cross is not None and r["M"] < cross)
    out["rows"] = [rows[M] for M in sorted(rows)]
    return out
