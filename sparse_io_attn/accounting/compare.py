"""Set measured (or predicted) traffic against the paper's lower bounds.

``compare(report, bound)`` takes a :class:`~sparse_io_attn.accounting.TrafficReport` (counted by
the kernels or predicted by the traffic model) or a plain byte count, and a
:class:`~sparse_io_attn.bounds.Bound`. Since the bound's value uses unit constants (the paper gives
Θ/Ω only) and can sit below the unavoidable traffic, the reference is
``floor = max(compulsory, bound)``; the record says which of the two binds.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparse_io_attn.bounds.calculator import Bound, explicit_scope
from sparse_io_attn.bounds.units import dtype_name, itemsize
from sparse_io_attn.tally.report import TrafficReport


@dataclass(frozen=True)
class Comparison:
    """Measured bytes against a bound, all in bytes of ``dtype``.

    ``ratio_to_bound`` = measured / bound (unit constants), ``ratio_to_compulsory`` = measured /
    compulsory, ``ratio_to_floor`` = measured / max(compulsory, bound); ``binds`` names the larger
    of the two (``"compulsory"`` or ``"bound"``).
    """
    source: str
    dtype: str
    measured_bytes: int
    bytes_read: int | None
    bytes_written: int | None
    compulsory_bytes: int
    bound_bytes: float
    floor_bytes: float
    binds: str
    bound: Bound

    @property
    def ratio_to_bound(self) -> float:
        return self.measured_bytes / self.bound_bytes if self.bound_bytes else float("inf")

    @property
    def ratio_to_compulsory(self) -> float:
        return self.measured_bytes / self.compulsory_bytes if self.compulsory_bytes else float("inf")

    @property
    def ratio_to_floor(self) -> float:
        return self.measured_bytes / self.floor_bytes if self.floor_bytes else float("inf")

    def to_dict(self) -> dict:
        return {
            "source": self.source, "dtype": self.dtype, "measured_bytes": self.measured_bytes,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "compulsory_bytes": self.compulsory_bytes, "bound_bytes": self.bound_bytes,
            "floor_bytes": self.floor_bytes, "binds": self.binds,
            "ratio_to_bound": self.ratio_to_bound, "ratio_to_compulsory": self.ratio_to_compulsory,
            "ratio_to_floor": self.ratio_to_floor, "bound": self.bound.to_dict(),
        }

    def table(self, verbose: bool = False) -> str:
        """The comparison as a text table; ``verbose`` adds the explicit-constant bounds, each labelled
        with its scope (materialising QK^T is not attention: FlashAttention moves less than that
        once M >> d^2)."""
        b = self.bound
        size = itemsize(self.dtype)
        rows = [("quantity", "bytes", "measured / this"),
                (f"measured ({self.source})", f"{self.measured_bytes:,}", "1.00")]
        if self.bytes_read is not None:
            rows += [("  read", f"{self.bytes_read:,}", ""), ("  written", f"{self.bytes_written:,}", "")]
        rows += [("compulsory (inputs once, outputs once)", f"{self.compulsory_bytes:,}", f"{self.ratio_to_compulsory:.2f}"),
                 (f"bound, {b.binding} term (unit constants)", f"{self.bound_bytes:,.0f}", f"{self.ratio_to_bound:.2f}")]
        for name, (words, _cite) in (b.explicit_constant.items() if verbose else ()):
            eb = words * size
            if eb:
                rows.append((f"explicit: {name} ({explicit_scope(name)})", f"{eb:,.0f}", f"{self.measured_bytes / eb:.2f}"))
        rows.append((f"floor = max(compulsory, bound): {self.binds} binds", f"{self.floor_bytes:,.0f}",
                     f"{self.ratio_to_floor:.2f}"))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        fmt = lambda r: f"{r[0].ljust(w[0])}  {r[1].rjust(w[1])}  {r[2].rjust(w[2])}"  # noqa: E731
        head = (f"{b.kind}: {b.theorem}\n{b.regime} cache regime, M = {b.M:,} words "
                f"({self.dtype}, {size} B/word), dividing point M = {b.crossover_M:,.0f} words")
        return "\n".join([head, fmt(rows[0]), "-" * (sum(w) + 4)] + [fmt(r) for r in rows[1:]])

    def __str__(self) -> str:
        return self.table()


def compare(report, bound: Bound, *, dtype=None) -> Comparison:
    """Compare ``report`` (a ``TrafficReport`` or an int number of bytes) with ``bound``.

    ``dtype`` converts the bound's words to bytes; it defaults to the dtype the bound was built
    with, and one of the two is required.
    """
    if not isinstance(bound, Bound):
        raise TypeError(f"bound must be a sparse_io_attn.bounds.Bound (from dense_backward, "
                        f"dense_forward or sparse), got {type(bound).__name__}")
    if dtype is None:
        if bound.dtype is None:
            raise ValueError("cannot convert the bound to bytes: pass dtype= (e.g. torch.bfloat16) "
                             "or build the bound with dtype=")
        dtype = bound.dtype
    if isinstance(report, TrafficReport):
        measured, rd, wr, source = report.total_bytes, report.bytes_read, report.bytes_written, report.source
    elif isinstance(report, int) and not isinstance(report, bool):
        if report < 0:
            raise ValueError(f"a byte count cannot be negative, got {report}")
        measured, rd, wr, source = report, None, None, "given"
    else:
        raise TypeError(f"report must be a TrafficReport or an int number of bytes, got "
                        f"{type(report).__name__}")
    compulsory = bound.compulsory_bytes(dtype)
    value = bound.bytes(dtype)
    floor = max(float(compulsory), value)
    return Comparison(source=source, dtype=dtype_name(dtype), measured_bytes=int(measured), bytes_read=rd,
                      bytes_written=wr, compulsory_bytes=compulsory, bound_bytes=value, floor_bytes=floor,
                      binds="compulsory" if compulsory >= value else "bound", bound=bound)
