"""`TrafficReport`: bytes read and written, per kernel and per tensor.

The same record comes from counting kernels (``source="counted"``, :class:`IOCounter`) and from the
traffic model (``source="predicted"``); equality compares the counts only, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Order of tensors in printed tables (others follow alphabetically).
TENSOR_ORDER = ("q", "k", "v", "o", "do", "lse", "delta", "dq", "dk", "dv", "layout")


def _tensor_key(name: str):
    return (TENSOR_ORDER.index(name), "") if name in TENSOR_ORDER else (len(TENSOR_ORDER), name)


@dataclass
class KernelTraffic:
    """Bytes one kernel (summed over its launches) read from and wrote to global memory."""
    name: str
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    launches: int = 0

    @property
    def bytes_read(self) -> int:
        return sum(self.reads.values())

    @property
    def bytes_written(self) -> int:
        return sum(self.writes.values())

    @property
    def total(self) -> int:
        return self.bytes_read + self.bytes_written

    def _key(self):
        nz = lambda d: {k: v for k, v in d.items() if v}  # noqa: E731  (zero entries are immaterial)
        return self.name, nz(self.reads), nz(self.writes), self.launches


class TrafficReport:
    """Per-kernel, per-tensor byte counts. ``str(report)`` prints a table."""

    def __init__(self, source: str = "counted"):
        self.source = source
        self.kernels: dict[str, KernelTraffic] = {}

    def add(self, kernel: str, reads: dict, writes: dict, launches: int = 1) -> None:
        kt = self.kernels.setdefault(kernel, KernelTraffic(kernel))
        for name, b in reads.items():
            kt.reads[name] = kt.reads.get(name, 0) + int(b)
        for name, b in writes.items():
            kt.writes[name] = kt.writes.get(name, 0) + int(b)
        kt.launches += launches

    def __add__(self, other: "TrafficReport") -> "TrafficReport":
        out = TrafficReport(self.source if self.source == other.source else "mixed")
        for rep in (self, other):
            for kt in rep.kernels.values():
                out.add(kt.name, kt.reads, kt.writes, kt.launches)
        return out

    @property
    def bytes_read(self) -> int:
        return sum(k.bytes_read for k in self.kernels.values())

    @property
    def bytes_written(self) -> int:
        return sum(k.bytes_written for k in self.kernels.values())

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def per_tensor(self) -> dict:
        """``{tensor: (bytes_read, bytes_written)}`` summed over kernels."""
        out: dict = {}
        for kt in self.kernels.values():
            for t in set(kt.reads) | set(kt.writes):
                r, w = out.get(t, (0, 0))
                out[t] = (r + kt.reads.get(t, 0), w + kt.writes.get(t, 0))
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, TrafficReport):
            return NotImplemented
        return (sorted(k._key() for k in self.kernels.values() if k.total or k.launches)
                == sorted(k._key() for k in other.kernels.values() if k.total or k.launches))

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "total_bytes": self.total_bytes,
            "kernels": {k.name: {"launches": k.launches, "reads": dict(k.reads), "writes": dict(k.writes),
                                 "bytes_read": k.bytes_read, "bytes_written": k.bytes_written}
                        for k in self.kernels.values()},
        }

    def table(self) -> str:
        rows = [("kernel", "tensor", "read B", "written B")]
        for kt in self.kernels.values():
            for t in sorted(set(kt.reads) | set(kt.writes), key=_tensor_key):
                rows.append((f"{kt.name} (x{kt.launches})", t, f"{kt.reads.get(t, 0):,}", f"{kt.writes.get(t, 0):,}"))
        rows.append(("total", "", f"{self.bytes_read:,}", f"{self.bytes_written:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
        lines = [f"TrafficReport ({self.source}), {self.total_bytes:,} bytes", fmt(rows[0]),
                 "-" * (sum(widths) + 6)]
        lines += [fmt(r) for r in rows[1:]]
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return (f"TrafficReport(source={self.source!r}, kernels={list(self.kernels)}, "
                f"bytes_read={self.bytes_read}, bytes_written={self.bytes_written})")
