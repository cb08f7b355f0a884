"""Allocation sizes seen by ``torch.profiler`` (used to show that no n x n buffer is allocated).

Reads the profiler's event tree (``kineto_results.experimental_event_tree()`` and
``torch._C._profiler._EventType``), which is not a public PyTorch API: keep its use here, in one place.
"""
from __future__ import annotations


def allocation_sizes(fn) -> list[int]:
    """Sizes in bytes of the CPU allocations made while ``fn()`` runs (frees excluded)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.alloc_size > 0:
            sizes.append(e.extra_fields.alloc_size)
        stack.extend(e.children)
    return sizes


def largest_allocation(fn) -> int:
    """The largest single CPU allocation (bytes) made while ``fn()`` runs."""
    return max(allocation_sizes(fn), default=0)
