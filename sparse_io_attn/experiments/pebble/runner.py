"""Run the paper's algorithms on fresh inputs: put them in slow memory, execute, collect counts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparse_io_attn.dense.reference import paper_forward
from sparse_io_attn.experiments.pebble.closed_form import IOCount, algorithm1_counts, large_cache_peak
from sparse_io_attn.experiments.pebble.executor import TwoLevelMemory
from sparse_io_attn.experiments.pebble.algorithm9 import algorithm9
from sparse_io_attn.experiments.pebble.algorithm6 import algorithm1, algorithm6, small_cache_forward


@dataclass(frozen=True)
class PebbleRun(IOCount):
    """Result of one executor run: the words moved and the high-water mark (an :class:`IOCount`,
    comparable with the closed forms), ``g`` (d x d, float64; for a forward run, the output ``O``,
    n x d), the fast memory's ``capacity`` and the words per array."""
    g: np.ndarray
    capacity: int
    reads_by_array: dict
    writes_by_array: dict


def _np(x) -> np.ndarray:
    return x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)


def _setup(capacity: int, **arrays) -> TwoLevelMemory:
    mem = TwoLevelMemory(capacity)
    for name, a in arrays.items():
        mem.put(name, _np(a))
    return mem


def _result(mem: TwoLevelMemory, g) -> PebbleRun:
    assert not mem.fast, f"algorithm left tiles resident: {sorted(mem.fast)}"
    return PebbleRun(reads=mem.words_read, writes=mem.words_written, peak=mem.peak, g=np.array(g),
                     capacity=mem.capacity, reads_by_array=dict(mem.reads), writes_by_array=dict(mem.writes))


def run_small_cache(A1, A2, A3, X, Y, dO, M: int, *, capacity: int | None = None) -> PebbleRun:
    """Algorithm 6 with a fast memory of ``capacity`` words (default ``M``: the algorithm fits)."""
    mem = _setup(M if capacity is None else capacity, A1=A1, A2=A2, A3=A3, X=X, Y=Y, dO=dO)
    return _result(mem, algorithm6(mem, M))


def run_small_cache_forward(A1, A2, A3, X, Y, M: int, *, capacity: int | None = None) -> PebbleRun:
    """The small-cache forward (:func:`~.algorithm6.small_cache_forward`) with a fast memory of
    ``capacity`` words (default ``M``: it fits); ``.g`` holds the output ``O`` (n x d)."""
    mem = _setup(M if capacity is None else capacity, A1=A1, A2=A2, A3=A3, X=X, Y=Y)
    return _result(mem, small_cache_forward(mem, M))


def run_large_cache(A1, A2, A3, X, Y, dO, M: int, *, variant: str = "faithful",
                    capacity: int | None = None) -> PebbleRun:
    """Algorithm 9 (``variant`` "faithful" or "fa2"). O and l come from the forward pass (computed
    here by :func:`paper_forward`, as Appendix D assumes). Default capacity: the algorithm's exact
    high-water mark :func:`large_cache_peak`, which exceeds ``M`` (the paper's constants are loose);
    pass ``capacity=M`` to see it fail."""
    O, l = paper_forward(A1, A2, A3, X, Y)
    n, d = _np(A1).shape
    cap = large_cache_peak(n, d, M, variant) if capacity is None else capacity
    mem = _setup(cap, A1=A1, A2=A2, A3=A3, X=X, Y=Y, dO=dO, O=O, l=l)
    return _result(mem, algorithm9(mem, M, variant))


def run_no_cache(A1, A2, A3, X, Y, dO) -> PebbleRun:
    """Algorithm 1 with a fast memory exactly as large as it needs."""
    n, d = _np(A1).shape
    mem = _setup(algorithm1_counts(n, d).peak, A1=A1, A2=A2, A3=A3, X=X, Y=Y, dO=dO)
    return _result(mem, algorithm1(mem))
