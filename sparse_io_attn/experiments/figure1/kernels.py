"""Figure 1 from the dense kernels: their exact traffic model (bytes) and their ``COUNT_IO`` counters."""
from __future__ import annotations

import math

import torch

from sparse_io_attn.accounting import IOCounter
from sparse_io_attn.bounds import dense_backward
from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.dense import forward, backward_large_cache, backward_small_cache
from sparse_io_attn.dense.tiles import min_large_cache_M, small_cache_block
from sparse_io_attn.dense.traffic import (LARGE_G_PATH, SMALL_G_PATH, large_cache_traffic, large_forward_traffic,
                                          small_cache_traffic, small_forward_traffic)
from sparse_io_attn.experiments.figure1.common import variant_of, bisect_crossing
from sparse_io_attn.tally.report import TrafficReport


def tensor_bytes(n: int, d: int, dtype=torch.float32) -> dict:
    """Size in bytes of every tensor the dense backward kernels name (batch 1)."""
    I, F = itemsize(dtype), 4
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


def kernel_traffic(kind: str, n: int, d: int, M: int, dtype=torch.float32, *, g_only: bool = True,
                   min_block: int | None = None) -> TrafficReport | None:
    """The traffic model's report of the dense backward kernels of ``kind`` (``g_only``: the ``dX``
    path only), or ``None`` where the kernels cannot tile ``M``. ``min_block`` (large-cache only)
    lets the schedule use tiles below the 16 rows ``tl.dot`` needs (a model-only extension)."""
    variant = variant_of(kind)
    extra = {} if min_block is None else {"min_block": min_block}
    try:
        if variant is None:
            return small_cache_traffic(n, d, M, dtype=dtype, g_only=g_only)
        return large_cache_traffic(n, d, M, dtype=dtype, variant=variant, g_only=g_only, **extra)
    except ValueError:  # M too small for this kernel's tiles
        return None


def kernel_bytes(kind: str, n: int, d: int, M: int, dtype=torch.float32) -> int | None:
    """Predicted bytes of the dense backward kernels of ``kind`` on the ``dX`` path; ``None`` where
    the kernels cannot tile ``M``."""
    rep = kernel_traffic(kind, n, d, M, dtype)
    return None if rep is None else rep.total_bytes


def kernel_counted_bytes(kind: str, n: int, d: int, M: int) -> int | None:
    """Bytes the dense backward kernels of ``kind`` count (``COUNT_IO``) on the ``dX`` path, on fp32
    random inputs of size ``n x d`` (Triton's interpreter on a CPU); ``None`` where they cannot tile
    ``M``."""
    variant = variant_of(kind)
    g = torch.Generator().manual_seed(0)
    A1, A2, A3, dO = (torch.randn(n, d, generator=g) for _ in range(4))
    X, Y = (torch.randn(d, d, generator=g) / d for _ in range(2))
    try:
        if variant is None:
            with IOCounter() as io:
                backward_small_cache(A1, A2, A3, X, Y, dO, M=M)
            path = SMALL_G_PATH
        else:
            O, lse = forward(A1, A2, A3, X, Y, M=M)
            with IOCounter() as io:
                backward_large_cache(A1, A2, A3, X, Y, dO, O, lse, M=M, variant=variant)
            path = LARGE_G_PATH[variant]
    except ValueError:  # M too small for this kernel's tiles
        return None
    return sum(k.total for name, k in io.report.kernels.items() if name in path)


def sweep(n: int, d: int, Ms, dtype=torch.float32) -> list[dict]:
    """One row per ``M``: bytes of every backward (``None`` where a kernel cannot run)."""
    sizes = tensor_bytes(n, d, dtype)
    rows = []
    for M in Ms:
        r = {"M": M, "M_over_d2": M / (d * d)}
        small_g = kernel_traffic("small", n, d, M, dtype)
        small_all = kernel_traffic("small", n, d, M, dtype, g_only=False)
        r["B"] = small_cache_block(M) if small_g else None
        r["small_g"] = small_g.total_bytes if small_g else None
        r["small_all"] = small_all.total_bytes if small_all else None
        r["small_g_tiled_reads"] = small_tiled_reads(small_g) if small_g else None
        for name, kind, min_block in (("faithful", "large_faithful", None), ("fa2", "large_fa2", None),
                                      ("fa2_model", "large_fa2", 1)):
            g = kernel_traffic(kind, n, d, M, dtype, min_block=min_block)
            a = kernel_traffic(kind, n, d, M, dtype, g_only=False, min_block=min_block)
            r[f"{name}_g"] = g.total_bytes if g else None
            r[f"{name}_all"] = a.total_bytes if a else None
            r[f"{name}_g_rereads"] = reread_bytes(g, sizes) if g else None
        b = dense_backward(n, d, M, form="paper")
        r["bound_bytes"] = b.value_words * itemsize(dtype)
        r["bound_small_term_bytes"] = b.terms["small_cache"] * itemsize(dtype)
        r["bound_large_term_bytes"] = b.terms["large_cache"] * itemsize(dtype)
        rows.append(r)
    return rows


def _kernel_total(kind: str, n, d, M, dtype, g_only, min_block):
    rep = kernel_traffic(kind, n, d, M, dtype, g_only=g_only, min_block=None if kind == "small" else min_block)
    return None if rep is None else rep.total_bytes


def kernel_crossing(n: int, d: int, variant: str, dtype=torch.float32, *, g_only: bool = False,
                    min_block: int = 16, lo: int = 1024, hi: int | None = None) -> dict:
    """Where the large-cache kernels (``variant``) start moving no more bytes than the small-cache
    kernels (model, ``g_only``: the dX path, else all five gradients), by bisection over integer
    ``M`` in ``[lo, hi]`` (default ``hi = 16 d^2``). A kernel that cannot tile ``M`` does not win.
    ``min_block=16``: the tiles the kernels can run; ``1``: the model-only extension.

    Returns ``M``, ``over_d2``, ``min_feasible_M`` (smallest ``M`` the large-cache kernels run at;
    ``None`` for the extension), ``grid_agrees`` (the predicate flips once on a 2^(1/8) grid) and the
    parameters."""
    hi = 16 * d * d if hi is None else hi
    kind = f"large_{variant}"

    def pred(M):
        large = _kernel_total(kind, n, d, M, dtype, g_only, min_block)
        small = _kernel_total("small", n, d, M, dtype, g_only, min_block)
        return large is not None and small is not None and large <= small

    M = bisect_crossing(pred, lo, hi)
    grid = sorted({int(round(lo * 2 ** (k / 8))) for k in range(int(8 * math.log2(hi / lo)) + 1)})
    agrees = M is not None and all(pred(x) == (x >= M) for x in grid)
    return {"M": M, "over_d2": None if M is None else M / (d * d), "variant": variant, "g_only": g_only,
            "min_block": min_block, "min_feasible_M": min_large_cache_M(d, variant) if min_block == 16 else None,
            "grid_agrees": agrees, "n": n, "d": d}


def kernel_forward_traffic(kind: str, n: int, d: int, M: int, dtype=torch.float32) -> TrafficReport | None:
    """The forward's traffic model: ``kind`` ``"small"`` (small-cache forward) or ``"large"``
    (FlashAttention order, tiles fitted to ``M``); ``None`` where it cannot tile ``M``."""
    try:
        if kind == "small":
            return small_forward_traffic(n, d, M, dtype=dtype)
        return large_forward_traffic(n, d, M, dtype=dtype, fit=True)
    except ValueError:
        return None


def small_forward_tiled_reads(report: TrafficReport) -> int:
    """The small-cache forward's traffic less its ``M``-independent part (every write and the
    element-wise sweep over ``f`` in ``fwd.small.f``): the operand reads of the tiled products,
    which fall as ``1/B ~ M^(-1/2)``."""
    return sum(b for kt in report.kernels.values() for t, b in kt.reads.items()
               if not (kt.name == "fwd.small.f" and t == "f"))


def kernel_forward_counted_bytes(n: int, d: int, M: int, regime: str = "small") -> int | None:
    """Bytes :func:`~sparse_io_attn.dense.forward` counts (``COUNT_IO``) with ``regime`` on fp32
    random inputs (Triton's interpreter on a CPU); ``None`` where it cannot tile ``M``."""
    g = torch.Generator().manual_seed(0)
    A1, A2, A3 = (torch.randn(n, d, generator=g) for _ in range(3))
    X, Y = (torch.randn(d, d, generator=g) / d for _ in range(2))
    if kernel_forward_traffic(regime, n, d, M) is None:
        return None
    with IOCounter() as io:
        forward(A1, A2, A3, X, Y, M=M, regime=regime)
    return io.report.total_bytes
