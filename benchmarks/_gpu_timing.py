"""Shared by the GPU benchmarks: how each time is measured, and the label that says so (issue 46.4).

* :func:`bench`: ``triton.testing.do_bench`` (CUDA events around each call, the L2 flushed before
  each, ``warmup``/``rep`` in milliseconds) with its ``return_mode`` named: ``"median"`` unless asked
  otherwise (do_bench's own default is the *mean*); ``"all"`` returns every timed call.
* :func:`bench_graph`: ``triton.testing.do_bench_cudagraph``: the call captured in a CUDA graph and
  replayed, so the host's launch work is not in the time; a call that cannot be captured gives its
  error instead of a number.
* :func:`sdpa_backends`: the SDPA backends a comparison names (flash, cuDNN where this torch has it),
  :func:`sdpa`: one call pinned to one of them.
* :func:`flex`: FlexAttention compiled at its defaults or in a named ``torch.compile`` mode.

A dry run (``dry=True``: the ``--dry-run`` of every GPU script, on a CPU) keeps every code path but
replaces what needs CUDA: times are warm ``perf_counter`` medians, a CUDA graph is not captured, Flex
runs eagerly and forward only (FlexAttention has no CPU backward), and every label says "dry run".
"""
from __future__ import annotations

import statistics
import time

import torch

WARMUP_MS, REP_MS = 25, 100
SDPA_BACKENDS = ("flash", "cudnn")


def label(mode: str = "median", dry: bool = False) -> str:
    """What a time from :func:`bench` is."""
    if dry:
        return f"dry run: one warm perf_counter call on the CPU (stands in for do_bench {mode})"
    return f"triton.testing.do_bench(warmup={WARMUP_MS}, rep={REP_MS}, return_mode={mode!r}) ms"


GRAPH_LABEL = f"triton.testing.do_bench_cudagraph(rep={REP_MS}, return_mode='median') ms (graph replay)"


def _cpu(fn, grads, reps: int = 1) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        for g in grads:
            g.grad = None
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench(fn, grads=(), *, mode: str = "median", dry: bool = False):
    """Milliseconds of ``fn`` (a list of every timed call for ``mode="all"``); ``grads``: tensors whose
    ``.grad`` is reset before each call."""
    if dry:
        times = _cpu(fn, grads)
        return times if mode == "all" else statistics.median(times)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=list(grads) or None,
                                   return_mode=mode)


def bench_graph(fn, grads=(), *, dry: bool = False):
    """``(ms, None)`` of ``fn`` replayed from a CUDA graph, or ``(None, error)`` when it cannot be
    captured (``(None, "dry run")`` in a dry run)."""
    if dry:
        fn()
        return None, "dry run: no CUDA graph on a CPU"
    import triton.testing
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, grad_to_none=list(grads) or None,
                                                 return_mode="median"), None
    except Exception as exc:  # noqa: BLE001  (a capture failure is a finding: recorded)
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def sdpa_backends() -> dict:
    """``{name: SDPBackend}`` of :data:`SDPA_BACKENDS` this torch defines."""
    from torch.nn.attention import SDPBackend
    found = {"flash": getattr(SDPBackend, "FLASH_ATTENTION", None), "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}
    return {name: b for name, b in found.items() if b is not None}


def sdpa(backend):
    """``f(q, k, v, causal=False)``: ``scaled_dot_product_attention`` pinned to ``backend`` (GQA through
    ``enable_gqa``); a backend that cannot run the call raises."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, causal=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return call


def flex(mode: str | None = None, *, dry: bool = False):
    """``torch.compile(flex_attention, dynamic=False, mode=mode)`` (``None``: Flex's defaults) with
    dynamo's recompile limits raised (one compile per shape and mask function, never the fall-back to
    eager Flex a long sweep would hit); a dry run returns eager ``flex_attention`` under ``no_grad``."""
    from torch.nn.attention.flex_attention import flex_attention
    if dry:
        def eager(q, k, v, **kw):
            with torch.no_grad():
                return flex_attention(q.detach(), k.detach(), v.detach(), **kw)
        return eager
    from torch._dynamo import config as dynamo_config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 256)
    return torch.compile(flex_attention, dynamic=False, mode=mode)


def sync(dry: bool = False) -> None:
    if not dry:
        torch.cuda.synchronize()
