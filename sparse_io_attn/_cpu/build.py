"""JIT build and loading of the library's C++ CPU kernels, and the fallback when they cannot be built.

One extension holds every op's CPU kernels: the translation units in :data:`SOURCES` (one
``kernel.cpp`` per op folder's ``cpu/``), which include their own headers and the shared ones in
this folder (``simd.h``: ISA selection and vector helpers; ``tiles.h``: work buffers, task runner,
tile products, packing; ``softmax.h``: the online-softmax row step and row store; ``entry.h``: the ops'
argument checks and result shapes; ``split_k.h``: the decode split and merge). It is compiled on first use with :func:`torch.utils.cpp_extension.load`
(ninja, the translation units in parallel, ``-O3`` and ``-march=native`` on x86-64) into torch's default extensions
directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). The extension's name, hence
its build directory, carries a digest of everything that changes the build (:func:`build_inputs`: the
sources' and headers' paths and contents, the flags and include path, the compiler, Python's version,
ABI and environment, torch's version and install path, the CPU's feature flags), so a cached build is
reused exactly when it matches: two checkouts or virtual environments build their own copies instead of
rebuilding one in turn, and a ``-march=native`` binary is never loaded on a CPU it was not built for.
Processes building at once (``pytest -n 2``) are serialised by :func:`~sparse_io_attn._cpu.build_lock.build_lock`
around torch's own lock: one builds, the others say once on stderr whom they wait for, load its library
when it is done, and give up with a ``RuntimeError`` naming the lock after ``SPARSE_IO_ATTN_BUILD_WAIT``
seconds (default 900); torch's ``lock`` file left by a killed build is removed with a warning.
``SPARSE_IO_ATTN_CPU_MARCH=x86-64-v3`` (or any ``-march`` value) builds for another instruction set
instead of ``native``: the vector code is chosen at compile time (AVX-512 fast paths, else at::vec's
AVX2 or generic code).
``SPARSE_IO_ATTN_SANITIZE=address,undefined`` builds with ``-fsanitize=...`` under its own extension
name (``sparse_io_attn_cpu_sanitize_*``); load it with the sanitizer runtime preloaded
(``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``, see ``make fuzz-sanitize``).

The ops are registered with ``TORCH_LIBRARY`` (namespace ``sparse_io_attn_cpu``): no pybind11,
which keeps the first build short.

:func:`load` returns ``torch.ops.sparse_io_attn_cpu`` or raises ``RuntimeError`` naming what is
missing and how to fix it; the outcome is remembered for the process. :func:`is_available`
answers without raising (it builds on first call).
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

import torch

from sparse_io_attn._cpu.build_lock import BuildLockError, build_lock, wait_seconds

HERE = Path(__file__).parent
PACKAGE = HERE.parent
#: one translation unit per op, registering its ops with TORCH_LIBRARY_FRAGMENT in NAMESPACE
SOURCES = (PACKAGE / "block_sparse" / "cpu" / "kernel.cpp", PACKAGE / "selection" / "cpu" / "kernel.cpp")


def included_headers(sources=SOURCES) -> tuple[Path, ...]:
    """Every header the sources include with ``#include "name"`` (looked up beside the including
    file, then in this folder), recursively: what the build's digest covers."""
    found: dict[Path, None] = {}
    todo = list(sources)
    while todo:
        path = todo.pop()
        for name in re.findall(r'#include "([^"]+)"', path.read_text()):
            header = path.parent / name if (path.parent / name).is_file() else HERE / name
            if header not in found:
                found[header] = None
                todo.append(header)
    return tuple(sorted(found))


HEADERS = included_headers()
NAMESPACE = "sparse_io_attn_cpu"
DISABLE_ENV = "SPARSE_IO_ATTN_NO_CPU_KERNEL"   # set to 1: behave as if the kernel could not be built
ARCH_ENV = "SPARSE_IO_ATTN_CPU_MARCH"          # -march value instead of "native" (x86)
SANITIZE_ENV = "SPARSE_IO_ATTN_SANITIZE"       # e.g. address,undefined: a sanitizer build (own cache entry)

_lock = threading.Lock()
_ops = None            # torch.ops namespace once loaded
_error: str | None = None   # why the kernel is unavailable (set once)


def _openmp() -> bool:
    """Whether torch runs at::parallel_for on OpenMP, whose parallel region is inline code in the
    ATen headers: the extension must then be compiled and linked with -fopenmp (the loader reuses
    the libgomp.so.1 torch already loaded), or its parallel_for runs on one thread."""
    return "OpenMP" in torch.__config__.parallel_info() and platform.system() == "Linux"


def _cflags() -> list[str]:
    # -ffp-contract=off: no a * b + c fused behind the source's back (the softmax subtracts the rounded
    # scaled score, see forward.h, and backward must repeat the forward's arithmetic exactly)
    flags = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-Wno-unused-variable", "-Wno-unused-parameter"]
    if _openmp():
        flags.append("-fopenmp")
    machine = platform.machine().lower()
    arch = os.environ.get(ARCH_ENV, "")
    if arch:                       # e.g. x86-64-v3 (AVX2) or x86-64 (SSE2): a portable or test build
        flags.append(f"-march={arch}")
    elif machine in ("x86_64", "amd64", "i686", "i386"):
        flags.append("-march=native")
    elif machine in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    return flags + _sanitize_flags()


def _sanitize_flags() -> list[str]:
    """``-fsanitize=<list>`` from ``SPARSE_IO_ATTN_SANITIZE`` (compile and link), or nothing. Python
    itself is not instrumented: run with the sanitizer runtime preloaded (``make fuzz-sanitize``)."""
    checks = os.environ.get(SANITIZE_ENV, "").strip()
    if checks in ("", "0"):
        return []
    return [f"-fsanitize={checks}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build_args() -> dict:
    """What :func:`torch.utils.cpp_extension.load` is given besides the name and the sources."""
    return dict(extra_cflags=_cflags(), extra_include_paths=[str(HERE.resolve())],
                extra_ldflags=(["-fopenmp"] if _openmp() else []) + _sanitize_flags())


def build_inputs() -> dict[str, str]:
    """Everything that changes the build, by name: what :func:`extension_name` hashes. The sources'
    and headers' paths (the translation units include them by path: each checkout builds its own) and
    contents; ``load``'s arguments (flags, include path); the compiler; Python (version, ABI, the
    environment's prefix, its headers); torch (version and install path, whose headers and libraries
    the build reads); the CPU (what ``-march=native`` depends on)."""
    return {
        "sources": "\n".join(f"{path.resolve()} {hashlib.sha1(path.read_bytes()).hexdigest()}"
                             for path in (*SOURCES, *HEADERS)),
        "arguments": repr(sorted(_build_args().items())),
        "compiler": f"{os.environ.get('CXX', '')} {_compiler()}",
        "python": f"{sys.version} {sysconfig.get_config_var('SOABI')} {sys.prefix} {sysconfig.get_paths()['include']}",
        "torch": f"{torch.__version__} {Path(torch.__file__).resolve().parent}",
        "cpu": _cpu_signature(),
    }


def extension_name() -> str:
    """``sparse_io_attn_cpu[_sanitize]_<digest of build_inputs()>``: torch's build directory's name, so
    two checkouts or environments never share (and rebuild) one directory."""
    text = "\0".join(f"{key}={value}" for key, value in sorted(build_inputs().items()))
    kind = "_sanitize" if _sanitize_flags() else ""
    return f"sparse_io_attn_cpu{kind}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx.split()[0]) if cxx else None


def _ensure_ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel puts it next to the venv's
    python, which is not on PATH when the venv is not activated (``.venv/bin/python -m pytest``)."""
    if shutil.which("ninja"):
        return True
    candidates = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    try:
        import ninja  # the PyPI package ships the binary
        candidates.insert(0, getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def _problem() -> str | None:
    """Why a build cannot even start (None: try it)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"disabled by the environment variable {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    missing = [path for path in (*SOURCES, *HEADERS) if not path.is_file()]
    if missing:
        return (f"the kernel source {missing[0]} is missing from the installed package; reinstall "
                f"sparse_io_attn from a source checkout (pip install -e .)")
    if _compiler() is None:
        return (f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r} on PATH); install one "
                f"(e.g. `apt-get install g++` or `conda install gxx_linux-64`) or point CXX at it")
    if not _ensure_ninja_on_path():
        return "the ninja build tool was not found; `pip install ninja` (a dependency of sparse_io_attn)"
    return None


def _translation_units(build_dir: str) -> list[str]:
    """One file per source in the build directory, named after the source's folder
    (``block_sparse_cpu_kernel.cpp``: torch's builder names each object after its source's file name,
    and every op folder's source is ``kernel.cpp``), holding ``#include "<the source's path>"`` so
    that the source's own quoted includes still resolve beside it. Replaced (atomically: another
    process may be compiling it) only when it changes, as ninja rebuilds what is newer than its object."""
    units = []
    for path in SOURCES:
        parts = path.relative_to(PACKAGE).parts if path.is_relative_to(PACKAGE) else (path.parent.name, path.name)
        unit = os.path.join(build_dir, "_".join(parts))
        text = f'#include "{path.resolve()}"\n'
        try:
            with open(unit) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:
            tmp = f"{unit}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, unit)
        units.append(unit)
    return units


def _build():
    from torch.utils import cpp_extension

    name = extension_name()
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    with build_lock(build_dir, wait_seconds()):
        if not os.path.exists(os.path.join(build_dir, f"{name}.so")):
            print(f"sparse_io_attn: compiling the CPU attention kernel (first use with this checkout, Python, "
                  f"torch and CPU; about a minute) into {build_dir}", file=sys.stderr, flush=True)
        cpp_extension.load(name=name, sources=_translation_units(build_dir), **_build_args(),
                           is_python_module=False, verbose=False)
    return getattr(torch.ops, NAMESPACE)


def load():
    """``torch.ops.sparse_io_attn_cpu`` (building the kernel on first use), or ``RuntimeError``."""
    global _ops, _error
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is None and _error is None:
            problem = _problem()
            if problem is None:
                try:
                    _ops = _build()
                except BuildLockError as e:  # another process's build held past the bound
                    problem = str(e)
                except Exception as e:  # compiler errors, link errors, a broken cache, ...
                    msg = " ".join(str(e).split())
                    problem = (f"building the C++ kernel failed ({type(e).__name__}: {msg[:500]}); check that "
                               f"a working C++ compiler and ninja are installed, or remove the stale build "
                               f"directory under torch's extensions dir ({_extensions_root()})")
            _error = problem
    if _ops is None:
        raise RuntimeError(f"sparse_io_attn backend='cpu' is unavailable: {_error}. Use backend='torch' "
                           f"(the portable PyTorch path) meanwhile; backend='auto' falls back to it.")
    return _ops


def is_available() -> bool:
    """Whether backend ``"cpu"`` can run (builds the kernel on the first call)."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    """Why :func:`load` fails (after a failed :func:`load`/:func:`is_available`), else None."""
    return None if _ops is not None else _error


def _extensions_root() -> str:
    from torch.utils import cpp_extension
    try:
        return os.path.dirname(cpp_extension._get_build_directory(extension_name(), verbose=False).rstrip(os.sep))
    except Exception:
        return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def _reset() -> None:
    """Forget the outcome of a failed load (tests). A loaded library stays loaded."""
    global _error
    _error = None


_warned = False


@torch.compiler.assume_constant_result
def available_for_auto() -> bool:
    """What ``backend="auto"`` asks on CPU: True when the kernel loads (building it on first use);
    False, with one ``UserWarning`` per process, when it cannot be built. A constant for
    ``torch.compile`` (evaluated once while tracing)."""
    global _warned
    if is_available():
        return True
    if not _warned:
        _warned = True
        import warnings
        warnings.warn(f"sparse_io_attn: the fused CPU kernel (backend='cpu') is unavailable, backend='auto' "
                      f"uses the slower PyTorch path (backend='torch'): {_error}", RuntimeWarning, stacklevel=4)
    return False
