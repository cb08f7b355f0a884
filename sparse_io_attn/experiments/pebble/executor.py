"""An executable two-level memory: the paper's I/O model (Section 3.3, Appendix B.2) at tile level.

The *slow memory* (``mem.slow``, unlimited) holds named NumPy arrays. The *fast memory* holds at
most ``capacity`` words (one word = one matrix element) in named resident tiles. Operations:

* ``load(key, name, rows, cols)``: copy a tile of a slow array into fast memory (counted: read);
* ``store(key, name, rows, cols)``: copy a resident tile into a slow array (counted: written);
* ``alloc(key, shape)``: a zero tile in fast memory ("initialize ... in cache"; no I/O);
* ``compute(key, fn, *inputs)``: ``fast[key] = fn(*fast[inputs])``; every input must be resident;
  the result replaces ``key`` (no I/O; temporaries inside ``fn`` are not counted, as the paper's
  "compute ... in cache" steps);
* ``free(*keys)``: drop resident tiles ("delete ... from cache").

It raises :class:`CapacityError` before the resident words would exceed ``capacity`` and
:class:`NotResidentError` when a computation or store names a tile that is not resident. It counts
words read and written, in total and per slow array, and the high-water mark ``peak``.
This is the red-blue pebble game with one pebble per element, played tile by tile.
"""
from __future__ import annotations

import numpy as np


class CapacityError(RuntimeError):
    """The fast memory would hold more than its capacity."""


class NotResidentError(RuntimeError):
    """A computation or store used a tile that is not in fast memory."""


def _index(array: np.ndarray, rows, cols):
    if array.ndim == 1:
        if cols is not None:
            raise ValueError("a 1-D array takes rows only")
        return (rows,)
    return (rows, slice(None) if cols is None else cols)


class TwoLevelMemory:
    """Fast memory of ``capacity`` words over an unlimited slow memory (see the module docstring)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int number of words, got {capacity!r}")
        self.capacity = capacity
        self.slow: dict[str, np.ndarray] = {}
        self.fast: dict[str, np.ndarray] = {}
        self.used = 0
        self.peak = 0
        self.words_read = 0
        self.words_written = 0
        self.reads: dict[str, int] = {}
        self.writes: dict[str, int] = {}

    # ------------------------------------------------------------------ slow memory (no I/O)
    def put(self, name: str, array) -> None:
        """Place an input in slow memory (its initial blue pebbles; not counted)."""
        self.slow[name] = np.array(array, dtype=np.float64, copy=True)

    def allocate(self, name: str, shape) -> None:
        """An output array in slow memory (not counted)."""
        self.slow[name] = np.zeros(shape, dtype=np.float64)

    # ------------------------------------------------------------------ fast memory
    def _admit(self, key: str, size: int) -> None:
        old = self.fast[key].size if key in self.fast else 0
        new_used = self.used - old + size
        if new_used > self.capacity:
            raise CapacityError(f"placing {key!r} ({size} words) would fill the fast memory to "
                                f"{new_used} words > capacity {self.capacity}; resident: "
                                f"{ {k: v.size for k, v in self.fast.items()} }")
        self.used = new_used
        self.peak = max(self.peak, self.used)

    def load(self, key: str, name: str, rows=slice(None), cols=None, *, transpose: bool = False) -> None:
        """Read ``slow[name][rows, cols]`` (transposed in fast memory if asked) into tile ``key``."""
        tile = self.slow[name][_index(self.slow[name], rows, cols)]
        tile = np.array(tile.T if transpose else tile, copy=True)
        self._admit(key, tile.size)
        self.fast[key] = tile
        self.words_read += tile.size
        self.reads[name] = self.reads.get(name, 0) + tile.size

    def store(self, key: str, name: str, rows=slice(None), cols=None) -> None:
        """Write resident tile ``key`` to ``slow[name][rows, cols]``."""
        tile = self._get(key)
        target = self.slow[name]
        idx = _index(target, rows, cols)
        if target[idx].shape != tile.shape:
            raise ValueError(f"storing {key!r} of shape {tile.shape} into {name}{idx} of shape "
                             f"{target[idx].shape}")
        target[idx] = tile
        self.words_written += tile.size
        self.writes[name] = self.writes.get(name, 0) + tile.size

    def alloc(self, key: str, shape) -> None:
        """A zero tile in fast memory."""
        tile = np.zeros(shape, dtype=np.float64)
        self._admit(key, tile.size)
        self.fast[key] = tile

    def compute(self, key: str, fn, *inputs: str) -> None:
        """``fast[key] = fn(*(fast[k] for k in inputs))``; all inputs must be resident."""
        args = [self._get(k) for k in inputs]
        result = np.asarray(fn(*args), dtype=np.float64)
        self._admit(key, result.size)
        self.fast[key] = result

    def free(self, *keys: str) -> None:
        for key in keys:
            self.used -= self._get(key).size
            del self.fast[key]

    def _get(self, key: str) -> np.ndarray:
        try:
            return self.fast[key]
        except KeyError:
            raise NotResidentError(f"tile {key!r} is not in fast memory; resident: {sorted(self.fast)}") from None

    @property
    def words_moved(self) -> int:
        return self.words_read + self.words_written


def block(i: int, size: int, length: int) -> slice:
    """The ``i``-th (0-based) block of ``size`` along an axis of ``length`` (the last may be short)."""
    return slice(i * size, min((i + 1) * size, length))


def num_blocks(length: int, size: int) -> int:
    return -(-length // size)
