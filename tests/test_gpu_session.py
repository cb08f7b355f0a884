"""benchmarks/gpu_session.py, the prepared GPU session (issue 46.4), checked without a GPU: every step of
both parts names a script that exists and whose own argument parser takes the step's arguments (in its
GPU and its dry form), part 1 fits its budget, and the dry run (every script on the CPU: interpreter,
eager Flex forward, ncu and compute-sanitizer commands printed) passes end to end: part 1, and part 2
(longer) marked slow."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load(path: pathlib.Path, name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)     # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def session(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return _load(BENCHMARKS / "gpu_session.py", "gpu_session", monkeypatch)


def _script_args(step):
    """``(script path, its arguments)`` of a step that runs a benchmark script, else None."""
    cmd = [str(a) for a in step.cmd]
    if "echo" in cmd[:1]:
        cmd = cmd[cmd.index("dry") + 4:] if "dry" in cmd else cmd
    scripts = [i for i, a in enumerate(cmd) if a.startswith("benchmarks/") and a.endswith(".py")]
    if not scripts:
        return None
    i = scripts[0]
    return ROOT / cmd[i], cmd[i + 1:]


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry"])
@pytest.mark.parametrize("part", [1, 2])
def test_every_step_parses(session, tmp_path, monkeypatch, part, dry):
    steps = session.plan(part, tmp_path, dry)
    assert len({s.name for s in steps}) == len(steps)
    if part == 1 and not dry:
        assert sum(s.limit for s in steps) <= session.BUDGET_S
        assert [s.name for s in steps] == ["env", "tests", "bench", "selection"]
    for step in steps:
        if step.name == "tests":
            files = [a for a in step.cmd if str(a).startswith("tests/")]
            assert files and all((ROOT / f).exists() for f in files), files
            continue
        found = _script_args(step)
        if found is None:
            continue
        script, args = found
        assert script.exists(), script
        mod = _load(script, f"step_{script.stem}", monkeypatch)
        if hasattr(mod, "parse_args"):
            mod.parse_args(args)        # argparse exits (SystemExit) on an argument the script does not take


def _dry_run(part: int, tmp_path, *extra: str) -> dict:
    out, work = tmp_path / "out", tmp_path / "work"
    res = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_session.py"), "--part", str(part), "--dry-run",
                          "--out", str(out), "--work", str(work), *extra], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    summary = json.loads((out / f"summary_part{part}.json").read_text())
    failed = [s for s in summary["steps"] if s.get("status") not in ("ok", "not selected (--only/--skip)")]
    assert res.returncode == 0 and not failed, (failed, res.stdout[-3000:], res.stderr[-3000:])
    assert (out / f"gpu_session_part{part}.tar.gz").exists()
    return summary


def test_part1_dry_run(tmp_path):
    summary = _dry_run(1, tmp_path)
    assert [s["step"] for s in summary["steps"]] == ["env", "tests", "bench", "selection"]
    rows = [json.loads(ln) for ln in (tmp_path / "work" / "selection.jsonl").read_text().splitlines()]
    assert [r["shape"] for r in rows] == ["moba", "nsa", "dsa"] and all("auto_fwdbwd_ms" in r for r in rows)


@pytest.mark.slow
def test_part2_dry_run(tmp_path):
    """Every part-2 step but those that rerun part 1's scripts at other shapes or options only
    (``bench_gpu_block_sparse.py``: part 1's ``bench``; ``bench_gpu_selection.py``: part 1's ``selection``;
    their arguments are checked above)."""
    summary = _dry_run(2, tmp_path, "--skip", "bench_16k", "bench_4k", "flex_autotune", "selection_32k", "metadata")
    ran = [s["step"] for s in summary["steps"] if s.get("status") == "ok"]
    assert len(summary["steps"]) == 14 and len(ran) == 8 and {"floor", "ncu_dense", "bf16_grads"} <= set(ran)
    floor = [json.loads(ln) for ln in (tmp_path / "work" / "floor" / "floor.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in floor} == {"fwd", "fwd+bwd"} and all(r["graph_error"] for r in floor)
