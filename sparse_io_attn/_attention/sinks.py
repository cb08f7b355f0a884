"""Attention sinks (FlashMLA's ``attn_sink``, gpt-oss's ``sinks``): one logit per query head that joins
every row's softmax denominator and contributes no value.

With a row's base-2 statistics (maximum ``m`` of its scaled scores, sum ``l = sum_j 2^(t_j - m)``)
and the head's sink ``s`` in natural-log units (``s2 = s log2(e)``), the sink row is

    m' = max(m, s2),  l' = l 2^(m - m') + 2^(s2 - m'),  out' = out l 2^(m - m') / l',
    lse' = (m' + log2 l') ln 2,  stats' = (m', log2 l').

A row with no allowed key has ``out = 0`` and ``lse = s``. Because ``stats'`` include the sink, the
backward recomputes ``P = 2^((t - m') - log2 l')``, the probabilities of the keys under the sink
softmax, with no change; ``delta = rowsum(dO * O)`` is the same sum (the sink has no value), and the
sink's own gradient is ``d s_h = -sum_{b, i} p_sink[b, h, i] delta[b, h, i]`` with
``p_sink = 2^(s2 - m' - log2 l')`` (:func:`sink_grad`).

The C++ kernels fold the sink in their row store (``_cpu/softmax.h::store_row``); the torch paths call
:func:`fold_sinks` on their fp32 results.
"""
from __future__ import annotations

import math

import torch

from sparse_io_attn._attention.delta import rounding_residual

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def sinks_base2(sinks: torch.Tensor) -> torch.Tensor:
    """fp32 ``sinks * log2(e)`` (``[Hq]``, contiguous): the sink in the kernels' base-2 units."""
    return (sinks.detach().to(torch.float32) * LOG2E).contiguous()


def fold_sinks(out: torch.Tensor, row_max: torch.Tensor, log2_sum: torch.Tensor, sinks: torch.Tensor):
    """Fold ``sinks [Hq]`` into fp32 results ``out [B, Hq, Nq, Dv]`` (in place) and the stats
    ``row_max``, ``log2_sum`` ``[B, Hq, Nq]`` (``+inf``/``0`` on rows without a key). Returns
    ``(out, lse, row_max, log2_sum)`` with the sink included; heads whose sink is ``-inf`` keep
    their rows unchanged."""
    s2 = sinks_base2(sinks).view(1, -1, 1)
    sink = torch.isfinite(s2)                                          # heads with a sink
    empty = torch.isposinf(row_max)
    m = torch.where(empty, float("-inf"), row_max)
    top = torch.where(sink, torch.maximum(m, s2), m)                   # m': finite where there is a sink
    base = torch.where(sink, top, 0.0)
    a = torch.where(empty, 0.0, torch.exp2(m - base + log2_sum))       # l 2^(m - m')
    total = a + torch.exp2(s2 - base)                                  # l' (>= 1 where there is a sink)
    out.mul_(torch.where(sink, a / total, 1.0).unsqueeze(-1))
    log2_total = torch.where(sink, torch.log2(total), log2_sum)
    lse = torch.where(sink | ~empty, (torch.where(sink, top, row_max) + log2_total) * LN2, float("-inf"))
    return out, lse, torch.where(sink, top, row_max), log2_total


def finish_forward(out: torch.Tensor, lse: torch.Tensor, row_max: torch.Tensor, log2_sum: torch.Tensor,
                   dtype: torch.dtype, sinks: torch.Tensor | None, residual: bool):
    """The torch paths' forward epilogue from fp32 ``out [B, Hq, Nq, Dv]`` and ``[B, Hq, Nq]`` rows:
    the sinks folded in (:func:`fold_sinks`), ``(out in dtype, lse, stats)`` and with ``residual`` the
    output's rounding residual (:func:`~sparse_io_attn._attention.delta.rounding_residual`) fourth."""
    if sinks is not None:
        out, lse, row_max, log2_sum = fold_sinks(out, row_max, log2_sum, sinks)
    result = (out.to(dtype), lse, torch.stack([row_max, log2_sum]))
    return (*result, rounding_residual(out, dtype)) if residual else result


def sink_grad(sinks: torch.Tensor, stats: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``d sinks [Hq]`` in sinks' dtype: ``-sum_{b, i} 2^(s2 - m' - log2 l') delta`` (``stats`` the
    forward's, sink included; ``delta [B, Hq, Nq]`` fp32)."""
    s2 = sinks_base2(sinks).view(1, -1, 1)
    p = torch.exp2(s2 - stats[0] - stats[1])          # 0 where m' = +inf (no key, sink -inf)
    return (-(p * delta).sum(dim=(0, 2))).to(sinks.dtype)


__all__ = ["finish_forward", "fold_sinks", "sink_grad", "sinks_base2"]
