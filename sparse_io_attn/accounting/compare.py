"""Set measured (or predicted) traffic against the paper's lower bounds.

``compare(report, bound)`` takes a :class:`~sparse_io_attn.accounting.TrafficReport` (counted by
the kernels or predicted by the traffic model) or a plain byte count, and a
:class:`~sparse_io_attn.bounds.Bound`. Since the bound's value uses unit constants (the paper gives
Θ/Ω only) and can sit below the unavoidable traffic, the reference is
``floor = max(compulsory, bound)``; the record says which of the two binds.

Per head: ``compare({(b, h): report}, bounds)`` with one ``Bound`` per ``(batch element, head)``
(a mapping with the same keys, or a sequence in sorted ``(b, h)`` order, which is what
:meth:`~sparse_io_attn.bounds.heads.HeadNnzStats.bounds` returns) gives a :class:`HeadComparison`:
one :class:`Comparison` per head and a :class:`HeadTotal`. The groups are independent problems, so
the total's bound, compulsory traffic and floor are the sums of the heads' (each head needs its own
``max(compulsory, bound)``).

Per-token selections: :func:`selection_bound` is Theorem 1.2 for a
:class:`~sparse_io_attn.selection.plan.SelectionPlan`'s allowed ``(query, key)`` pairs, so
``compare(counted_report, selection_bound(plan, B, Hq, D, M, dtype=...))`` sets a selection
attention call's counted traffic against it.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from sparse_io_attn.bounds.calculator import Bound, explicit_scope, sparse_informal
from sparse_io_attn.bounds.units import dtype_name, itemsize
from sparse_io_attn.selection.plan import SelectionPlan
from sparse_io_attn.selection.traffic import selection_pairs
from sparse_io_attn.tally.report import TrafficReport


@dataclass(frozen=True)
class _Bytes:
    """Measured bytes next to compulsory, bound and floor bytes, all in bytes of ``dtype``; the
    ratios of ``measured_bytes`` to each (``inf`` over 0)."""
    source: str
    dtype: str
    measured_bytes: int
    bytes_read: int | None
    bytes_written: int | None
    compulsory_bytes: int
    bound_bytes: float
    floor_bytes: float
    binds: str

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
            "ratio_to_floor": self.ratio_to_floor,
        }


@dataclass(frozen=True)
class Comparison(_Bytes):
    """Measured bytes against a bound, all in bytes of ``dtype``.

    ``ratio_to_bound`` = measured / bound (unit constants), ``ratio_to_compulsory`` = measured /
    compulsory, ``ratio_to_floor`` = measured / max(compulsory, bound); ``binds`` names the larger
    of the two (``"compulsory"`` or ``"bound"``).
    """
    bound: Bound

    def to_dict(self) -> dict:
        return dict(super().to_dict(), bound=self.bound.to_dict())

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


def compare(report, bound, *, dtype=None):
    """Compare ``report`` (a ``TrafficReport`` or an int number of bytes) with ``bound``.

    ``dtype`` converts the bound's words to bytes; it defaults to the dtype the bound was built
    with, and one of the two is required.

    Per head: ``report`` a mapping ``{(b, h): TrafficReport or int}`` (what
    :func:`~sparse_io_attn.sparse_operands.predict_traffic_per_head` returns) and ``bound`` one
    ``Bound`` per head, a mapping with the same keys or a sequence in sorted ``(b, h)`` order
    (:meth:`~sparse_io_attn.bounds.heads.HeadNnzStats.bounds`); returns a :class:`HeadComparison`.
    """
    if isinstance(report, Mapping):
        return per_head_comparison(report, bound, dtype=dtype)
    if isinstance(bound, (Mapping, list, tuple)):
        raise TypeError(f"one Bound per head needs one report per head: pass report as {{(b, h): "
                        f"TrafficReport or int}} (e.g. predict_traffic_per_head(...)), got "
                        f"{type(report).__name__}")
    return _compare_one(report, bound, dtype)


def selection_bound(plan: SelectionPlan, batch: int, num_heads_q: int, head_dim: int, M, *, dtype=None) -> Bound:
    """Theorem 1.2 (:func:`~sparse_io_attn.bounds.sparse_informal`) for one selection attention call
    of ``batch * num_heads_q`` independent (batch, query head) problems: per head ``Z_input =
    min(Nq, Nk) * head_dim`` (the smaller input matrix, as Theorem 4.5's ``Z_A``) and ``Z_QK`` = its
    allowed ``(query, key)`` pairs (:func:`~sparse_io_attn.selection.traffic.selection_pairs`, the
    mean over the heads: exact when every head has the same count, as with ``G = 1``; with per-group
    or per-head selections the heads' mean stands in for each head's own count). ``n`` and ``d``
    (the output term of the compulsory traffic) are passed when ``Nq == Nk``. ``M`` in words or a
    size string, as the calculator takes it. Use with :func:`compare`."""
    if not isinstance(plan, SelectionPlan):
        raise TypeError(f"plan must be a SelectionPlan (sparse_io_attn.selection.plan_selection), got "
                        f"{type(plan).__name__}")
    heads = batch * num_heads_q
    if heads < 1 or head_dim < 1:
        raise ValueError(f"batch, num_heads_q and head_dim must be positive, got {batch}, {num_heads_q}, {head_dim}")
    pairs = selection_pairs(plan, batch, num_heads_q)
    z_qk = pairs // heads if pairs % heads == 0 else pairs / heads
    Nq, Nk = plan.seqlen
    square = dict(n=Nq, d=head_dim) if Nq == Nk else {}
    note = "" if plan.num_selections == 1 else \
        "Z_QK: allowed (query, key) pairs averaged over the (batch, head) problems"
    return sparse_informal(min(Nq, Nk) * head_dim, z_qk, M, dtype=dtype, heads=heads, note=note, **square)


def _compare_one(report, bound: Bound, dtype) -> Comparison:
    """:func:`compare` of one report with one bound."""
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


@dataclass(frozen=True)
class HeadTotal(_Bytes):
    """The total row of a :class:`HeadComparison`, in bytes of ``dtype``: ``measured_bytes`` (the
    heads' sum, or the whole call's counted report when one was given), ``compulsory_bytes`` and
    ``bound_bytes`` the sums over the heads, ``floor_bytes`` the sum of the heads' floors
    ``max(compulsory, bound)`` (independent problems: each needs its own, so this is at least
    ``max(compulsory_bytes, bound_bytes)``); ``binds``: ``"compulsory"`` or ``"bound"`` when every
    head agrees, else ``"mixed"``."""


@dataclass(frozen=True)
class HeadComparison(Mapping):
    """One :class:`Comparison` per ``(batch element, head)`` and their :class:`HeadTotal`.

    A read-only mapping ``{(b, h): Comparison}`` in sorted ``(b, h)`` order (``hc[b, h]``,
    ``hc.keys()``, ``len(hc)``); ``total`` is the total row; ``note`` says what the rows measure
    when the total comes from a counted report and the heads from the model's shares."""
    heads: dict
    total: HeadTotal
    note: str = ""

    def __getitem__(self, key) -> Comparison:
        try:
            return self.heads[key]
        except (KeyError, TypeError):
            raise KeyError(f"no head {key!r}: this comparison holds {_keys_text(self.heads)}") from None

    def __iter__(self):
        return iter(self.heads)

    def __len__(self) -> int:
        return len(self.heads)

    def to_dict(self) -> dict:
        return {"dtype": self.total.dtype, "note": self.note,
                "heads": [{"b": b, "h": h, **c.to_dict()} for (b, h), c in self.heads.items()],
                "total": self.total.to_dict()}

    def table(self) -> str:
        """One row per head and the total row: measured, compulsory, bound (unit constants), floor,
        the three ratios and which binds."""
        comps = list(self.heads.values())
        first = comps[0].bound
        size = itemsize(self.total.dtype)
        Ms = sorted({c.bound.M for c in comps})
        m_text = f"M = {Ms[0]:,} words" if len(Ms) == 1 else f"M = {Ms[0]:,} .. {Ms[-1]:,} words (per head)"
        theorem = (f"{first.kind}: {first.theorem}" if all(c.bound.theorem == first.theorem for c in comps)
                   else "mixed bounds (see to_dict())")
        head = [f"{theorem}, per (batch, head): {len(comps)} independent problems",
                f"{m_text} ({self.total.dtype}, {size} B/word); total: sums over the heads, "
                f"floor = sum of the heads' max(compulsory, bound)"]
        if self.note:
            head.append(self.note)
        notes = sorted({c.bound.note for c in comps if c.bound.note})
        head += [f"note: {n}" for n in notes]
        rows = [("(b, h)", "measured B", "compulsory B", "bound B", "floor B", "/compulsory", "/bound",
                 "/floor", "binds")]

        def row(label, c, binds):
            return (label, f"{c.measured_bytes:,}", f"{c.compulsory_bytes:,}", f"{c.bound_bytes:,.0f}",
                    f"{c.floor_bytes:,.0f}", f"{c.ratio_to_compulsory:.2f}", f"{c.ratio_to_bound:.2f}",
                    f"{c.ratio_to_floor:.2f}", binds)

        rows += [row(f"({b}, {h}) {c.source}", c, c.binds) for (b, h), c in self.heads.items()]
        t = self.total
        bound_heads = sum(c.binds == "bound" for c in comps)
        binds = t.binds if t.binds != "mixed" else f"mixed: bound {bound_heads}, compulsory {len(comps) - bound_heads}"
        total = row(f"total ({t.source})", t, binds)
        w = [max(len(r[i]) for r in rows + [total]) for i in range(len(total))]
        fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c if i == 8 else c.rjust(w[i])  # noqa: E731
                                  for i, c in enumerate(r))
        rule = "-" * (sum(w) + 2 * (len(w) - 1))
        return "\n".join(head + [fmt(rows[0]), rule] + [fmt(r) for r in rows[1:]] + [rule, fmt(total)])

    def __str__(self) -> str:
        return self.table()


def _keys_text(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(str(k) for k in keys[:limit])
    return f"{len(keys)} heads [{shown}{', ...' if len(keys) > limit else ''}]"


def _head_key(key) -> tuple:
    """A ``(b, h)`` key as a pair of non-negative ints (``TypeError``/``ValueError``)."""
    ok = (isinstance(key, tuple) and len(key) == 2
          and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in key))
    if not ok:
        raise TypeError(f"per-head reports and bounds are keyed by (b, h) pairs of ints (batch element, "
                        f"head), as predict_traffic_per_head returns them; got key {key!r}")
    if min(key) < 0:
        raise ValueError(f"(b, h) keys are non-negative indices, got {key!r}")
    return int(key[0]), int(key[1])


def per_head_comparison(report: Mapping, bound, *, dtype=None, total=None, note: str = "") -> HeadComparison:
    """The per-head form of :func:`compare`. ``total``: the whole call's ``TrafficReport`` (counted),
    used for the total row in place of the heads' sum, which it must equal; ``note`` is shown with
    the table (what the rows measure)."""
    reports = {}
    for key, value in report.items():
        reports[_head_key(key)] = value
    if not reports:
        raise ValueError("report holds no heads: pass {(b, h): TrafficReport or int} with one entry per head")
    keys = sorted(reports)
    if isinstance(bound, Mapping):
        bounds = {_head_key(k): v for k, v in bound.items()}
        missing, extra = sorted(set(keys) - set(bounds)), sorted(set(bounds) - set(keys))
        if missing or extra:
            raise ValueError(f"bound must have one entry per head of the report ({_keys_text(keys)}); "
                             f"missing {missing[:8]}, not in the report {extra[:8]}")
    elif isinstance(bound, (list, tuple)):
        if len(bound) != len(keys):
            raise ValueError(f"got {len(bound)} bounds for a report of {_keys_text(keys)}: pass one Bound "
                             f"per head, in sorted (b, h) order (HeadNnzStats.bounds(M) gives them)")
        bounds = dict(zip(keys, bound))
    else:
        raise TypeError(f"a per-head report needs one Bound per head: a mapping {{(b, h): Bound}} or a "
                        f"sequence in sorted (b, h) order (e.g. head_nnz_stats(A1, X, A2, qk_layout)"
                        f".bounds(M, dtype=...)), got {type(bound).__name__}")
    if dtype is None:
        sizes = {itemsize(b.dtype): b.dtype for b in bounds.values() if isinstance(b, Bound) and b.dtype}
        if len(sizes) > 1:
            raise ValueError(f"the per-head bounds were built with dtypes of different sizes "
                             f"{sorted(sizes.values())}; pass dtype= to convert every bound's words with one "
                             f"element size")
    heads = {}
    for key in keys:
        try:
            heads[key] = _compare_one(reports[key], bounds[key], dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"head {key}: {e}") from None
    comps = list(heads.values())
    if total is None:
        sources = {c.source for c in comps}
        partial = any(c.bytes_read is None for c in comps)
        measured = sum(c.measured_bytes for c in comps)
        rd = None if partial else sum(c.bytes_read for c in comps)
        wr = None if partial else sum(c.bytes_written for c in comps)
        source = sources.pop() if len(sources) == 1 else "mixed"
    else:
        if not isinstance(total, TrafficReport):
            raise TypeError(f"total must be the whole call's TrafficReport, got {type(total).__name__}")
        measured, rd, wr, source = total.total_bytes, total.bytes_read, total.bytes_written, total.source
        shares = sum(c.measured_bytes for c in comps)
        if measured != shares:
            raise ValueError(f"the total report has {measured:,} bytes but the heads sum to {shares:,}: "
                             f"the per-head reports must be the shares of that call")
    binds = {c.binds for c in comps}
    return HeadComparison(heads=heads, note=note, total=HeadTotal(
        source=source, dtype=comps[0].dtype, measured_bytes=measured, bytes_read=rd, bytes_written=wr,
        compulsory_bytes=sum(c.compulsory_bytes for c in comps), bound_bytes=sum(c.bound_bytes for c in comps),
        floor_bytes=sum(c.floor_bytes for c in comps), binds=binds.pop() if len(binds) == 1 else "mixed"))
