"""The bound calculator at a million tokens and beyond: ``sparse-io-attn bounds --pattern ...`` at
N = 1M, 4M, 16M for a sliding window, BigBird and 4096-token documents (head dim 64, block 64).

Each command runs in a fresh process twice over: once as the plain command line (``python -m
sparse_io_attn.cli bounds ...``: its wall time and peak RSS, from ``os.wait4``), and once through a
small driver that imports the same modules first and then times ``cli.main`` alone (the work
beyond the import, and the RSS after the import). The import alone (``import sparse_io_attn.cli``
plus the dense regime the command loads) is measured the same way.

    python benchmarks/bounds_million.py            # writes benchmarks/results/bounds_million.md
    python benchmarks/bounds_million.py --sizes 1048576 --out /tmp/bm.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (1 << 20, 1 << 22, 1 << 24)
DOC_TOKENS = 4096


def patterns(n: int) -> list[str]:
    """The specs at ``n`` tokens: sliding window 512, BigBird defaults, documents of 4096 tokens."""
    return ["sliding_window:512", "bigbird", f"documents:{n // DOC_TOKENS}"]


def _command(n: int, spec: str) -> list[str]:
    return ["-m", "sparse_io_attn.cli", "bounds", "--seq-len", str(n), "--head-dim", "64", "--pattern", spec]


_DRIVER = """
import json, resource, sys, time, io, contextlib
t0 = time.perf_counter()
import sparse_io_attn.cli as cli
import sparse_io_attn.dense.regime
t1 = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {"import_s": t1 - t0, "rss_import": rss}
if len(sys.argv) > 1:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(sys.argv[1:])
    out.update(work_s=time.perf_counter() - t1, rc=rc,
               rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(json.dumps(out))
"""


def _run(args: list[str]) -> tuple[float, int, int, str]:
    """``(wall s, peak RSS bytes, exit status, stdout)`` of ``python args``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, proc.returncode, out


def _uptime() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    return out.split("load average:")[-1].strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--out", type=Path, default=RESULTS / "bounds_million.md")
    args = p.parse_args(argv)
    import torch

    load_before = _uptime()
    imp = json.loads(_run(["-c", _DRIVER])[3])
    rows = []
    for n in args.sizes:
        for spec in patterns(n):
            wall, rss, rc, _ = _run(_command(n, spec))
            _, _, _, out = _run(["-c", _DRIVER, *_command(n, spec)[2:]])
            d = json.loads(out)
            rows.append({"n": n, "spec": spec, "wall_s": wall, "rss": rss, "rc": rc, **d})
            print(f"{n} {spec}: {wall:.2f} s, {rss / 2**20:.0f} MiB, work {d['work_s']:.2f} s", flush=True)
    lines = ["# The bound calculator at 1M-16M tokens", "",
             f"Command: `python benchmarks/bounds_million.py{' ' + ' '.join(argv) if argv else ''}`", "",
             f"    machine: 2-core development VM (shared), nproc {os.cpu_count()}, Python "
             f"{platform.python_version()}, torch {torch.__version__}",
             f"    date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average (uptime) "
             f"before {load_before}, after {_uptime()}",
             f"    import alone (`import sparse_io_attn.cli` + the dense regime the command loads): "
             f"{imp['import_s']:.2f} s, {imp['rss_import'] / 2**20:.0f} MiB RSS", "",
             "| N | pattern | command wall s | command peak RSS MiB | work beyond import s | peak RSS beyond "
             "import MiB | exit |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']:,} | `{r['spec']}` | {r['wall_s']:.2f} | {r['rss'] / 2**20:.0f} | "
                     f"{r['work_s']:.2f} | {(r['rss_peak'] - r['rss_import']) / 2**20:.0f} | {r['rc']} |")
    lines += ["", "Command lines (run from the repository root):", ""]
    lines += [f"    python {' '.join(_command(r['n'], r['spec']))}" for r in rows]
    lines += ["", "*command*: the plain command line, wall time and peak RSS of the whole process "
              "(`os.wait4`). *beyond import*: a driver imports the same modules, then times `cli.main` "
              "with the same arguments; peak RSS beyond import is its `ru_maxrss` at the end minus after "
              "the import. Block 64, head dim 64, dtype bf16 (the default), M = the CPU default. "
              "Shared 2-core machine: times are indicative."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
