"""The Figure-1 numbers of one ``(n, d)``: slopes, the faithful kernel's plateau, and the crossings."""
from __future__ import annotations

import math

import torch

from sparse_io_attn.dense.traffic import small_forward_traffic
from sparse_io_attn.experiments.figure1.executor import executor_crossing
from sparse_io_attn.experiments.figure1.kernels import kernel_crossing, small_forward_tiled_reads, sweep
from sparse_io_attn.experiments.slopes import loglog_slope


def summarize(n: int, d: int, dtype=torch.float32) -> dict:
    """The Figure-1 numbers: slopes, the faithful kernel's plateau, and the crossings.

    * small: ``M = 4 B^2`` for ``B = 16, 32, ...`` below ``d^2`` (one point per tile size); the same
      points give the small-cache forward's slopes (``fwd_small_tiled_slope``, ``fwd_small_total_slope``).
    * large (faithful, fa2): powers of two from the smallest ``M`` that runs up to ``n d``.
    * ``crossings``: :func:`crossings` (bisection on the model, kernels and algorithms).
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
    out["crossings"] = crossings(n, d, dtype)
    fwd_Ms = [M for M in small_Ms]
    fwd = [small_forward_tiled_reads(small_forward_traffic(n, d, M, dtype=dtype)) for M in fwd_Ms]
    out["fwd_small_tiled_slope"] = loglog_slope(fwd_Ms, fwd)
    out["fwd_small_total_slope"] = loglog_slope(fwd_Ms, [small_forward_traffic(n, d, M, dtype=dtype).total_bytes
                                                         for M in fwd_Ms])
    out["rows"] = [rows[M] for M in sorted(rows)]
    return out


def crossings(n: int, d: int, dtype=torch.float32) -> dict:
    """Every crossing of :func:`kernel_crossing` / :func:`executor_crossing` at ``(n, d)``:
    ``executor_<variant>``, ``kernel_<variant>`` (all gradients), ``kernel_<variant>_g`` (dX path)
    and ``model_fa2_g_min_block_1`` (FA2 schedule with tiles below 16, dX path: the comparison behind
    the library's earlier "0.354 d^2", which came from a 2^(1/4) grid)."""
    out = {}
    for v in ("faithful", "fa2"):
        out[f"executor_{v}"] = executor_crossing(n, d, v)
        out[f"kernel_{v}"] = kernel_crossing(n, d, v, dtype)
        out[f"kernel_{v}_g"] = kernel_crossing(n, d, v, dtype, g_only=True)
    out["model_fa2_g_min_block_1"] = kernel_crossing(n, d, "fa2", dtype, g_only=True, min_block=1)
    return out


def crossing_lines(c: dict, d: int) -> list[str]:
    """:func:`crossings` in words (one line per comparison)."""
    f = lambda x: "never up to 16 d^2" if x is None else f"{x:,} ({x / d / d:.3f} d^2)"  # noqa: E731
    lines = []
    for v, name in (("faithful", "as written"), ("fa2", "FA2 order")):
        e = c[f"executor_{v}"]
        lines.append(f"algorithms (executor closed forms, words): Alg 9 {name} moves no more than Alg 6 from M = "
                     f"{f(e['M'])} by bisection; at every integer M from {f(e['always_from_M'])} on "
                     f"({e['flips_below']} integer M below that where it already does)")
    for v, name in (("faithful", "as written"), ("fa2", "FA2 order")):
        k, g = c[f"kernel_{v}"], c[f"kernel_{v}_g"]
        edge = k["min_feasible_M"]
        lines.append(f"kernels (model, tiles >= 16): large-cache {name} moves no more than small-cache from M = "
                     f"{f(k['M'])} (all gradients) / {f(g['M'])} (dX path); it runs from M = {f(edge)}"
                     + ("" if k["grid_agrees"] and g["grid_agrees"] else " (not a single crossing on the grid)"))
    x = c["model_fa2_g_min_block_1"]
    lines.append(f"model only, FA2 schedule with tiles below 16 (the kernels cannot run them), dX path: "
                 f"crossing at M = {f(x['M'])}")
    return lines
