"""The C++ build's cache key and lock (sparse_io_attn/_cpu/build.py, build_lock.py), without compiling:
the key follows every input of the build, a lock left by a killed build is taken over, a live one is
waited for with a message and a bound. The real build's first use from two processes at once, after a
killed build, is tests/block_sparse/test_cpu_backend.py::test_two_processes_build_at_once_after_a_killed_build."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from sparse_io_attn._cpu import build as _build
from sparse_io_attn._cpu.build_lock import OWNER, TORCH_LOCK, WAIT_ENV, BuildLockError, build_lock, wait_seconds


# ------------------------------------------------------------------------ the key: one directory per build
@pytest.fixture
def base_name(monkeypatch):
    """The extension name of a plain build (no -march or sanitizer override from the environment)."""
    monkeypatch.delenv(_build.ARCH_ENV, raising=False)
    monkeypatch.delenv(_build.SANITIZE_ENV, raising=False)
    return _build.extension_name()


def test_equal_inputs_give_the_same_directory(base_name):
    assert _build.build_inputs() == _build.build_inputs()
    assert _build.extension_name() == base_name
    assert base_name.startswith("sparse_io_attn_cpu_") and len(base_name) == len("sparse_io_attn_cpu_") + 12


def _other_checkout(monkeypatch, tmp_path):
    # the same source bytes at other paths (the translation units include them by path)
    copies = []
    for i, src in enumerate(_build.SOURCES):
        (tmp_path / str(i)).mkdir()
        copies.append(tmp_path / str(i) / src.name)
        shutil.copyfile(src, copies[-1])
    monkeypatch.setattr(_build, "SOURCES", tuple(copies))


CHANGES = [
    pytest.param(_other_checkout, id="source-paths"),
    pytest.param(lambda mp, tmp: mp.setattr(_build, "HERE", tmp), id="include-path"),
    pytest.param(lambda mp, tmp: mp.setattr(sys, "prefix", str(tmp / "venv")), id="python-prefix"),
    pytest.param(lambda mp, tmp: mp.setattr(sys, "version", sys.version + " (another build)"), id="python-version"),
    pytest.param(lambda mp, tmp: mp.setattr(torch, "__file__", str(tmp / "torch" / "__init__.py")), id="torch-path"),
    pytest.param(lambda mp, tmp: mp.setattr(torch, "__version__", "0.0.0+other"), id="torch-version"),
    pytest.param(lambda mp, tmp: mp.setenv(_build.ARCH_ENV, "x86-64-v2"), id="flags"),
    pytest.param(lambda mp, tmp: mp.setenv("CXX", "clang++"), id="compiler"),
    pytest.param(lambda mp, tmp: mp.setenv(_build.SANITIZE_ENV, "address"), id="sanitizer"),
    pytest.param(lambda mp, tmp: mp.setattr(_build, "_cpu_signature", lambda: "another CPU"), id="cpu"),
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_build_input_changes_the_directory(base_name, monkeypatch, tmp_path, change):
    change(monkeypatch, tmp_path)
    assert _build.extension_name() != base_name


def test_the_key_hashes_what_load_is_given(monkeypatch, tmp_path):
    monkeypatch.setattr(_build, "HERE", tmp_path)
    args = _build._build_args()
    assert args["extra_include_paths"] == [str(tmp_path.resolve())]
    assert repr(sorted(args.items())) == _build.build_inputs()["arguments"]


# ------------------------------------------------------------------------ the lock
def _finished_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=300, check=True)
    return int(proc.stdout)


def test_a_killed_builds_lock_is_taken_over(tmp_path, capsys):
    """What a build killed inside torch's load leaves: torch's `lock` (an hour old) and the owner file
    naming a process that is gone. The next build removes the lock with a warning naming it, at once."""
    (tmp_path / OWNER).write_text(f"{_finished_pid()} somehost {time.time() - 3600:.0f}\n")
    (tmp_path / TORCH_LOCK).touch()
    os.utime(tmp_path / TORCH_LOCK, (time.time() - 3600,) * 2)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=f"removed the stale build lock {tmp_path / TORCH_LOCK}, left 36"):
        with build_lock(str(tmp_path), wait_s=600):
            assert not (tmp_path / TORCH_LOCK).exists()
            assert (tmp_path / OWNER).read_text().startswith(f"{os.getpid()} ")
    assert time.monotonic() - start < 60
    assert "waiting" not in capsys.readouterr().err
    with build_lock(str(tmp_path), wait_s=600):   # released: taken again at once, nothing to take over
        pass


HOLDER = """
import os, sys, time
from sparse_io_attn._cpu.build_lock import TORCH_LOCK, build_lock
build_dir = sys.argv[1]
with build_lock(build_dir, wait_s=60):
    open(os.path.join(build_dir, TORCH_LOCK), "x").close()   # as torch's FileBaton inside load
    open(os.path.join(build_dir, "held"), "w").close()
    time.sleep(600)
"""


def test_a_live_build_is_waited_for_with_a_message_then_a_clear_error(tmp_path, capsys):
    """Another process holds the build (inside torch's load); a second one says once whom it waits for
    and gives up after its bound with an error naming the lock and the holder; the live build's files
    are left alone. Killed mid-build, the holder's lock is released and its torch `lock` taken over."""
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(build_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (build_dir / "held").exists():
            assert holder.poll() is None, holder.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.1)
        owner = build_dir / OWNER
        start = time.monotonic()
        with pytest.raises(BuildLockError, match=rf"waited 1 s for process {holder.pid} on .*build lock {owner}.*"
                                                 rf"end it.*{WAIT_ENV}"):
            with build_lock(str(build_dir), wait_s=1.0):
                pytest.fail("entered a lock another process holds")
        assert time.monotonic() - start < 60
        err = capsys.readouterr().err
        assert err.count("waiting for") == 1 and f"process {holder.pid} on " in err and str(owner) in err
        assert (build_dir / TORCH_LOCK).exists()
    finally:
        holder.kill()
        holder.communicate(timeout=300)
    with pytest.warns(RuntimeWarning, match=f"removed the stale build lock {build_dir / TORCH_LOCK}"):
        with build_lock(str(build_dir), wait_s=1.0):
            assert not (build_dir / TORCH_LOCK).exists()
    assert "waiting" not in capsys.readouterr().err


def test_wait_bound_from_the_environment(monkeypatch):
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert wait_seconds() == 900
    monkeypatch.setenv(WAIT_ENV, "30")
    assert wait_seconds() == 30
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(WAIT_ENV, bad)
        with pytest.raises(BuildLockError, match=f"{WAIT_ENV}='{bad}' is not a positive number of seconds"):
            wait_seconds()


def test_a_lock_timeout_is_reported_as_is(monkeypatch):
    """load() passes the lock's message on (not the compiler advice of a failed build); auto falls back."""
    monkeypatch.setattr(_build, "_ops", None)
    monkeypatch.setattr(_build, "_error", None)
    monkeypatch.setattr(_build, "_warned", False)

    def held():
        raise BuildLockError("waited 1 s for process 7 on host, which holds the build lock /x/owner; end it")
    monkeypatch.setattr(_build, "_build", held)
    with pytest.raises(RuntimeError, match=r"unavailable: waited 1 s for process 7 .*/x/owner; end it\. "
                                           r"Use backend='torch'") as info:
        _build.load()
    assert "compiler" not in str(info.value)
    with pytest.warns(RuntimeWarning, match="waited 1 s for process 7"):
        assert not _build.available_for_auto()
