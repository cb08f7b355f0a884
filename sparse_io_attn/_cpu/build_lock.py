"""The build directory's lock: one process builds, the others wait with a message and a bound, and a
lock left by a killed build is taken over.

torch's :func:`~torch.utils.cpp_extension.load` serialises builds with a file ``lock`` in the build
directory (:class:`torch.utils.file_baton.FileBaton`: created with ``O_EXCL``, removed when the build
ends); every other process polls while the file exists, with no message and no bound. A process killed
during a build leaves the file behind, and every later first use would wait forever.

:func:`build_lock` wraps ``load`` in a lock that cannot be left behind: ``fcntl.flock`` on the file
:data:`OWNER` in the build directory, which the operating system releases when its holder exits, however
it exits. The holder writes its pid, host and start time into that file (for the messages of the
processes that wait). Every process of this library calls ``load`` only while holding :data:`OWNER`, so a
torch ``lock`` that the holder finds was left by a dead build: it is removed, with a warning naming it.
A process that finds :data:`OWNER` held says so once on stderr (the file, the holder's pid) and raises
:class:`BuildLockError` naming the file and the holder after ``wait_s`` seconds
(:func:`wait_seconds`: ``SPARSE_IO_ATTN_BUILD_WAIT``, default 900): never silently, never forever. A live
holder is never taken over (it may be compiling); the error says how to end it.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock only
    fcntl = None

OWNER = "owner"        # flock-held by the building process; holds "pid host start"
TORCH_LOCK = "lock"    # torch's FileBaton in the build directory
WAIT_ENV = "SPARSE_IO_ATTN_BUILD_WAIT"   # seconds to wait for another process's build
DEFAULT_WAIT_S = 900.0
POLL_S = 0.2


class BuildLockError(RuntimeError):
    """The build directory stayed held past the bound, or the bound is not a number."""


def wait_seconds() -> float:
    """How long to wait for another process's build: ``SPARSE_IO_ATTN_BUILD_WAIT`` or 900 s."""
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise BuildLockError(f"{WAIT_ENV}={text!r} is not a positive number of seconds; set it to e.g. 1800 "
                             f"(how long to wait for another process's build) or unset it (900)")
    return seconds


def _holder(path: str) -> str:
    """Who holds the lock, from what it wrote into ``path``."""
    try:
        with open(path) as f:
            pid, host, start = f.read().split()
        since = time.strftime("%H:%M:%S", time.localtime(float(start)))
    except (OSError, ValueError):
        return "another process"
    return f"process {pid} on {host} (building since {since})"


def _acquire(fd: int, path: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not told:
            told = True
            print(f"sparse_io_attn: waiting for {_holder(path)} to finish building the CPU kernel (lock {path}; "
                  f"giving up after {wait_s:g} s, {WAIT_ENV} to change)", file=sys.stderr, flush=True)
        if time.monotonic() >= deadline:
            raise BuildLockError(
                f"waited {wait_s:g} s for {_holder(path)}, which holds the build lock {path}; if that process "
                f"is hung, end it (its lock is released when it exits), or set {WAIT_ENV} to wait longer")
        time.sleep(POLL_S)


def _take_over_stale(build_dir: str) -> None:
    """Remove torch's ``lock`` found while holding :data:`OWNER`: a killed build left it."""
    lock = os.path.join(build_dir, TORCH_LOCK)
    try:
        age = time.time() - os.path.getmtime(lock)
        os.remove(lock)
    except FileNotFoundError:
        return
    warnings.warn(f"sparse_io_attn: removed the stale build lock {lock}, left {age:.0f} s ago by a build that "
                  f"was killed (no process held {os.path.join(build_dir, OWNER)}); building again", RuntimeWarning,
                  stacklevel=4)


@contextmanager
def build_lock(build_dir: str, wait_s: float):
    """Hold the build directory ``build_dir`` (which must exist) for one process: wait for another holder
    at most ``wait_s`` seconds (a message once, then :class:`BuildLockError`), take over a stale torch
    ``lock``, and release on exit (or when the process dies)."""
    if fcntl is None:
        yield
        return
    path = os.path.join(build_dir, OWNER)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)
        _take_over_stale(build_dir)
        yield
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock
