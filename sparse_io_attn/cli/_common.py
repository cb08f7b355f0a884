"""Helpers shared by the subcommands: argument parsing of sizes/dtypes/patterns, the machine
header, a progress bar (tqdm), CSV/JSON writers, timing and plot set-up.

Errors a user can fix raise ``ValueError`` (the command prints one line and exits 2). An optional
extra that is not installed (matplotlib, from the ``plot`` extra) raises :class:`MissingExtra`
(one line, exit 3).
"""
from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from sparse_io_attn._memory import available_memory_bytes
from sparse_io_attn.layout.patterns import from_spec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
RESULTS_DIR = Path("benchmarks") / "results"


class MissingExtra(RuntimeError):
    """An optional extra of the package (``pip install 'sparse-io-attn[<extra>]'``) this command
    needs is not installed."""


# ---------------------------------------------------------------------------------------- parsing
def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_count(text: str) -> int:
    """``"4096"``, ``"4k"`` (= 4096), ``"131k"`` (= 131072), ``"1M"`` (= 1048576) -> int > 0."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"expected a positive integer such as 4096, 4k or 131k, got {text!r}")
    value = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def parse_list(text: str, item=str, *, allowed=None, what: str = "list") -> list:
    """Comma-separated list; with ``allowed``, each item must be one of them."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"{what} must be a non-empty comma-separated list, got {text!r}")
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise ValueError(f"{what}: unknown {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
    return [item(s) for s in items]


def build_layout(spec: str, seqlen: int, block_size: int, *, num_heads: int = 1):
    """A :class:`BlockSparseLayout` from a pattern spec such as ``"sliding_window:512"`` (see
    :func:`sparse_io_attn.layout.patterns.from_spec` for the grammar)."""
    return from_spec(spec, seqlen=seqlen, block_size=block_size, num_heads=num_heads)


# ---------------------------------------------------------------------------------------- header
def machine_header(dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> dict:
    """Where a number came from: device, software versions, dtype, threads, time (UTC)."""
    device = torch.device(device)
    if device.type == "cuda":
        dev = f"cuda: {torch.cuda.get_device_name(device)}"
    else:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
            cpu = names[0] if names else cpu
        except OSError:
            pass
        dev = f"cpu: {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    try:  # the version without importing triton (importing it first would skip the interpreter set-up)
        triton_version = importlib.metadata.version("triton")
    except Exception:
        triton_version = "absent"
    return {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "dtype": DTYPE_NAMES.get(dtype, str(dtype)) if dtype is not None else "-",
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def format_header(header: dict) -> str:
    return (f"# device: {header['device']}\n# torch {header['torch']}, triton {header['triton']}"
            f"{' (interpreter)' if header.get('triton_interpreter') else ''}, python {header['python']}, "
            f"dtype {header['dtype']}, {header['date_utc']} UTC, load average {header.get('load_avg_1min')}")


# ---------------------------------------------------------------------------------------- progress
class progress:
    """``with progress(total, "bench") as bar: ... bar.update()``: a tqdm bar on stderr, silent when
    ``enabled`` is False."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled

    def __enter__(self):
        self.bar = tqdm(total=self.total, desc=self.desc, file=sys.stderr, leave=False) if self.enabled else None
        return self

    def update(self, k: int = 1, note: str | None = None):
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note)
            self.bar.update(k)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------- timing
def time_fn(fn, *, warmup: int = 1, repeats: int = 5, max_seconds: float = 30.0, sync=None) -> dict:
    """Median wall time of ``fn()`` over warm repeats (seconds), with the spread.

    Stops repeating once ``max_seconds`` have been spent (at least 3 timed runs when ``repeats >=
    3``). Returns ``{"median_s", "min_s", "max_s", "iqr_s", "runs"}``.
    """
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times, start = [], time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > max_seconds and i >= min(2, repeats - 1):
            break
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iqr_s": q[2] - q[0], "runs": len(times)}


# ---------------------------------------------------------------------------------------- output
def format_csv(rows: list[dict], header: dict | None = None) -> str:
    """Rows as CSV text (columns in order of first appearance); with ``header``, the machine header
    goes first as ``# key: value`` comment lines."""
    fields: list = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    buf = io.StringIO()
    if header:
        for k, v in header.items():
            buf.write(f"# {k}: {v}\n")
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for r in rows:
        w.writerow({k: _csv_value(r.get(k)) for k in fields})
    return buf.getvalue()


def write_csv(path, rows: list[dict], header: dict | None = None) -> Path:
    """:func:`format_csv` written to ``path`` (its directory created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(format_csv(rows, header))
    return path


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (torch.dtype, Path)):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot serialize {type(o).__name__} to JSON")


def _clean(o):
    """Replace NaN/inf floats (not valid JSON) with None, recursively."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def to_json(obj) -> str:
    return json.dumps(_clean(json.loads(json.dumps(obj, default=_json_default))), indent=2)


def write_json(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(obj) + "\n")
    return path


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A left/right aligned text table; ``columns`` = ``[(key, title), ...]``; numbers right."""
    cells = [[title for _, title in columns]]
    for r in rows:
        cells.append([_fmt_cell(r.get(k)) for k, _ in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    numeric = [all(_is_num(r.get(k)) or r.get(k) is None for r in rows) for k, _ in columns]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt_cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.3g}" if (abs(v) < 1e-2 or abs(v) >= 1e5) and v != 0 else f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def check_writable(path, what: str) -> None:
    """Raise ``ValueError`` *before* any work when file ``path`` cannot be written: its directory is
    created (the writers need it anyway) and the file opened for appending, then removed again if
    it did not exist. ``-`` (stdout) and ``None`` pass."""
    if path is None or str(path) == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        existed = p.exists()
        with open(p, "a"):
            pass
        if not existed:
            p.unlink()
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written ({e.strerror}); choose another path") from None


def check_writable_dir(path, what: str) -> None:
    """Raise ``ValueError`` before any work when directory ``path`` cannot be created or written to."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {path} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written ({e.strerror}); choose another directory") from None


def check_memory(needed_bytes: float, what: str, device="cpu", fix: str = "use a smaller --seq-len") -> None:
    """Refuse a run up front (``ValueError`` with both numbers) when it needs more memory than the
    device has available."""
    free, source = available_memory_bytes(device)
    if free is not None and needed_bytes > free:
        raise ValueError(f"{what} needs about {human_bytes(needed_bytes)} but {human_bytes(free)} is available "
                         f"({source}); {fix}")


def human_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b} B"


# ---------------------------------------------------------------------------------------- plotting
def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend; :class:`MissingExtra` when
    matplotlib (the ``plot`` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("plots need matplotlib, the 'plot' extra: pip install 'sparse-io-attn[plot]' "
                           "(sweeps write only the CSV and Markdown with --no-plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def log_axes(ax, xlabel: str, ylabel: str, title: str, *, xbase: int = 10, **legend) -> None:
    """A sweep plot's axes: both logarithmic (x in base ``xbase``), labelled, the title in 10 pt, a
    7 pt legend (``legend``: more of its options) and a light grid on major and minor ticks."""
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, **legend)
    ax.grid(True, which="both", alpha=0.25)


def add_header_footnote(fig, header: dict) -> None:
    fig.text(0.01, 0.005, f"{header['device']} | torch {header['torch']} | triton {header['triton']} | "
             f"dtype {header['dtype']}", fontsize=6, color="0.4", ha="left", va="bottom")


def save_figure(fig, path, header: dict) -> None:
    """Machine footnote, tight layout, write ``path`` (PNG, 130 dpi) and close the figure."""
    add_header_footnote(fig, header)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    pyplot().close(fig)
