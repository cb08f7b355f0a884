"""Chunk scheduling of the PyTorch backend: single-threaded worker threads share a plan's chunks."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from sparse_io_attn.block_sparse.torch_path.plan import _Chunk, _Plan

_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_PID = 0     # a forked child inherits the pool object but not its threads: rebuild there
_POOL_LOCK = threading.Lock()


def _init_worker(started: threading.Barrier) -> None:
    torch.get_num_threads()   # ATen's per-thread lazy init first, or it would undo the next line
    torch.set_num_threads(1)
    started.wait()


def _pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` worker threads whose PyTorch ops run single-threaded."""
    global _POOL, _POOL_SIZE, _POOL_PID
    with _POOL_LOCK:
        if _POOL_PID != os.getpid():
            _POOL, _POOL_SIZE, _POOL_PID = None, 0, os.getpid()
        if _POOL_SIZE < n:
            main_threads = torch.get_num_threads()
            started = threading.Barrier(n + 1)
            pool = ThreadPoolExecutor(n, thread_name_prefix="sparse_io_attn")
            for _ in range(n):           # start every worker now, each set to one thread
                pool.submit(_init_worker, started)
            started.wait()
            torch.set_num_threads(main_threads)  # set_num_threads also changes the process default
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = pool, n
        return _POOL


def _split(plan: _Plan, n: int) -> list[list[_Chunk]]:
    """Chunks dealt to ``n`` workers, largest first to the least loaded (fixed for a plan and n)."""
    key = ("split", n)
    if key not in plan.cache:
        loads, parts = [0] * n, [[] for _ in range(n)]
        for ch in plan.chunks_by_cost:
            w = loads.index(min(loads))
            parts[w].append(ch)
            loads[w] += ch.steps * ch.nb * ch.R * ch.C
        plan.cache[key] = parts
    return plan.cache[key]


def for_each_chunk(plan: _Plan, device: torch.device, make_state, fn, *, deterministic: bool) -> list:
    """Call ``fn(chunk, state)`` for every chunk; return the states.

    On CPU with several torch threads, ``n`` single-threaded workers, one ``make_state()`` each,
    share the chunks: one parallel region per chunk instead of one per small op, which matters on a
    loaded machine where every OpenMP barrier may wait for a descheduled thread. Chunks write
    disjoint query rows; key-side sums go to the worker's own state. ``deterministic``: a fixed
    split (the same sums in the same order on every call) instead of a shared work queue.
    Elsewhere (CUDA, one thread, one chunk) the chunks run in order in the calling thread.
    """
    n = min(torch.get_num_threads(), len(plan.chunks)) if device.type == "cpu" else 1
    if n <= 1:
        state = make_state()
        for ch in plan.chunks:
            fn(ch, state)
        return [state]
    states = [make_state() for _ in range(n)]
    queue = iter(plan.chunks_by_cost)
    lock = threading.Lock()

    def next_chunk():
        with lock:
            return next(queue, None)

    def work(state, mine):
        with torch.no_grad():
            for ch in mine if mine is not None else iter(next_chunk, None):
                fn(ch, state)

    parts = _split(plan, n) if deterministic else [None] * n
    futures = [_pool(n).submit(work, st, part) for st, part in zip(states, parts)]
    for f in futures:
        f.result()
    return states
