"""Shared by the Nsight Compute scripts (``ncu_block_sparse.py``, ``ncu_dense.py``): the metrics, the
command, and the per-launch rows of ncu's CSV.

A script runs itself under ``ncu`` in a child mode (``--child``); ncu profiles the launches whose
kernel name matches a regex, after skipping the warm-up launches (``--launch-skip``: those compile
and, for the block-sparse op, build its launches), with ``--clock-control none`` (the clocks as they
are) and its default cache flush before each kernel (a cold start, as the traffic models assume).
In a dry run (``--dry-run``, a CPU) the child runs in-process on the interpreter and ncu is not
called: the command it would run is printed.
"""
from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

METRICS = {
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "l1tex__m_xbar2l1tex_read_bytes.sum": "l2_to_sm_read",
    "l1tex__m_l1tex2xbar_write_bytes.sum": "sm_to_l2_write",
    "gpu__time_duration.sum": "time_ns",
}


def command(ncu: str, kernel_regex: str, script: str, child_args: list[str], *, skip: int = 0,
            count: int | None = None, nvtx_range: str | None = None) -> list[str]:
    """The ncu command profiling the launches matching ``kernel_regex``: ``count`` of them after ``skip``,
    or every one inside the child's NVTX ranges named ``nvtx_range`` (pushed on the launching thread)."""
    select = ["--launch-skip", str(skip)] + (["--launch-count", str(count)] if count is not None else [])
    if nvtx_range is not None:
        select += ["--nvtx", "--nvtx-include", f"{nvtx_range}/"]
    return [ncu, "--target-processes", "all", *select, "-k", f"regex:{kernel_regex}", "--clock-control", "none",
            "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base", sys.executable,
            script, "--child", *child_args]


def run(cmd: list[str], *, no_autotune: bool = True) -> tuple[list[dict], str]:
    """Run ``cmd`` (from :func:`command`): its launches in order (:func:`parse`) and the child's own
    output (ncu's stdout but the CSV); exits with ncu's error text when it fails."""
    env = dict(os.environ, SPARSE_IO_ATTN_NO_AUTOTUNE="1") if no_autotune else None
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"ncu failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return parse(res.stdout), "\n".join(ln for ln in res.stdout.splitlines() if not ln.startswith('"'))


def parse(text: str) -> list[dict]:
    """``[{"kernel": name, <metric short name>: value, ...}]``, one per profiled launch, in launch order,
    from ``ncu --csv --page raw --print-units base``."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        raise RuntimeError("ncu printed no kernel rows; check that the GPU is visible and ncu may profile "
                           "(permissions: NVreg_RestrictProfilingToAdminUsers)")
    head, data = rows[0], rows[2:]  # rows[1] holds the units
    out = []
    for row in data:
        rec = dict(zip(head, row))
        out.append({"kernel": rec.get("Kernel Name", ""),
                    **{short: float(rec[metric].replace(",", "")) for metric, short in METRICS.items()}})
    return out
