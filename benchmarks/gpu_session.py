"""The prepared GPU session (issues 43, 46, 47): every device check, in two calls of at most 7 minutes.

Each call runs one part; inside a part the steps run in priority order, each a subprocess with its own
time limit, under one deadline (``--budget`` seconds): a step that no longer fits is skipped and listed,
so the most important results land even when a call is cut. ``--list`` prints both parts' plans.

    python3 benchmarks/gpu_session.py --part 1 --out $OUT        # call 1 (run tool: timeout_s 430)
    python3 benchmarks/gpu_session.py --part 2 --out $OUT        # call 2 (--budget: the device time left)
    python3 benchmarks/gpu_session.py --part 1 --dry-run --out /tmp/dry    # on a CPU, before spending GPU time

Part 1, correctness and the two headlines (budget 400 s):
  ``env``       GPU, driver, CUDA, torch, triton; copy bandwidth and a bf16 matmul measured here
  ``tests``     ``tests/gpu`` and the Triton correctness matrices compiled on CUDA (block-sparse, selection
                and its kernel families and device plan, decode, the cached launch path), ``-k "triton or gpu"``
  ``bench``     ``bench_gpu_block_sparse.py`` N 8192, D 128, sliding window and causal at 5/25/100%:
                Flex at its defaults (the fixed export), SDPA flash and cuDNN, ``do_bench`` medians
  ``selection`` MoBA, NSA, DSA shapes at N 8192 and 16384, the auto family (the query-major one: 4.2x slower
                at MoBA N 8192 in the second run, ``gpu_h200_run2.md``), against
                Flex (index ``mask_mod``, its defaults) and SDPA per backend, with the per-step plan time
Part 2, the rest (budget 400 s), in this order:
  ``sanitizer_warm``, ``sanitizer``  ``compute-sanitizer --tool memcheck`` on one forward+backward of each
                op and one decode step of each (the warm run fills Triton's cache first)
  ``bf16_grads``  ``bf16_gradients.py``: bf16 o/dq/dk/dv against float64 on native-sparse-attention's test data,
                Triton (its delta from the fp32 output, issue 48) and torch, T 256 and 1024
  ``floor``     ``gpu_floor.py``: forward+backward at 2.5-10% kept, N 8192, D 128: ``do_bench``
                (``return_mode="all"``), ``do_bench_cudagraph``, host enqueue time, a profiler trace of 5 steps
  ``selection_32k``  the selection rows at N 32768
  ``bench_16k``  N 16384, D 128 (the first run had no time for it), sliding window and causal at 10/100%
  ``ncu_dkdv``   the dK/dV candidates of ``tiles.kernel_configs`` one at a time under ncu, next to the model
  ``decode``     one token against 8k-1M cached keys: window and MoBA shapes against flex-decode and SDPA
  ``ncu_dense``  the dense-form kernels (Algorithms 6 and 9) under ncu at M = d^2 and 4 d^2 (n 4096, d 128)
  ``flex_autotune``  Flex with ``mode="max-autotune-no-cudagraphs"`` at two headline shapes
  then, if time is left: ``ncu_bytes`` (every block-sparse kernel's bytes, causal), ``bench_4k`` (N 4096 at
  D 64 and 128), ``bench_16k_d64``, ``metadata`` (per-step pooled top-k + plan, N 8192-32768)
The first steps of part 2 fill its budget when each takes its whole limit; the last ones run in the time
the others leave.

Every step writes its log and result files into a work folder, packed after each step into
``<out>/gpu_session_part<N>.tar.gz`` (the device tool brings back at most 8 files); ``<out>/summary_part<N>.json``
says what ran, how long, its exit status, and what was skipped. Timing labels (mean or median, compiled or
not, SDPA backend, Flex mode) are in each result's header: ``benchmarks/_gpu_timing.py``.

``--dry-run``: the same plan on a CPU: every script with its ``--dry-run`` (tiny shapes, the Triton
interpreter, eager Flex forward, perf_counter times, the ncu/compute-sanitizer commands printed, not run),
``pytest --collect-only`` for the tests; a typo costs seconds here, not device minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
B = "benchmarks/"
TRITON_MATRIX = ["tests/gpu", "tests/block_sparse/test_correctness.py", "tests/block_sparse/test_triton_block_sparse.py",
                 "tests/block_sparse/test_traffic_block_sparse.py", "tests/block_sparse/test_launch_cache.py",
                 "tests/selection/test_correctness.py", "tests/selection/test_triton_selection.py",
                 "tests/selection/test_traffic_selection.py", "tests/selection/test_triton_families.py",
                 "tests/selection/test_triton_plan.py", "tests/block_sparse/test_decode.py",
                 "tests/selection/test_decode_triton.py"]
BUDGET_S = 400

ENV = r"""
import json, subprocess, sys, time, torch, triton
dry = "--dry-run" in sys.argv
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
       "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
if not dry:
    import triton.testing
    out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                        "clocks.max.sm", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    p = torch.cuda.get_device_properties(0)
    out.update(sm_count=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None))
    x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)   # 1 GiB
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    out.update(copy_TBps=2 * x.numel() * 2 / copy_ms / 1e9, bf16_matmul_8192_TFLOPs=2 * 8192 ** 3 / mm_ms / 1e9,
               timing="do_bench medians (random data)")
print(json.dumps(out, indent=1))
"""


@dataclass
class Step:
    """One subprocess: ``name``, its time limit in seconds, the command, extra environment."""
    name: str
    limit: int
    cmd: list
    env: dict = field(default_factory=dict)


def tool(name: str) -> str:
    """``name`` on the PATH, else the newest under /usr/local/cuda*/bin or /opt/nvidia."""
    import glob
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/local/cuda*/bin/{name}") + glob.glob(f"/opt/nvidia/**/{name}", recursive=True))
    return hits[-1] if hits else name


def _bench(work: Path, tag: str, *args: str) -> list:
    return [PY, B + "bench_gpu_block_sparse.py", *args, "--jsonl", f"{work}/{tag}.jsonl", "--out", f"{work}/{tag}"]


def plan(part: int, work: Path, dry: bool) -> list[Step]:
    """The steps of ``part`` in priority order (a dry run: the same steps, each in its dry form)."""
    ncu, sanitizer = tool("ncu"), tool("compute-sanitizer")
    no_tune = {"SPARSE_IO_ATTN_NO_AUTOTUNE": "1"}
    if part == 1:
        tests = [PY, "-m", "pytest", "-v", "-n", "14", "-p", "no:cacheprovider", "-k", "triton or gpu",
                 "--timeout", "150", f"--junitxml={work}/tests.xml", *TRITON_MATRIX]
        if dry:
            tests = [PY, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-k", "triton or gpu",
                     *TRITON_MATRIX]
        steps = [
            Step("env", 20, [PY, "-c", ENV]),
            Step("tests", 150, tests),     # -v: each result on its line, so a cut run still names its failures
            Step("bench", 120, _bench(work, "bench_n8192_d128", "--n", "8192", "--d", "128", "--families",
                                      "sliding_window", "causal", "--densities", "0.05", "0.25", "1.0")),
            Step("selection", 110, [PY, B + "bench_gpu_selection.py", "--parts", "selection", "--n", "8192", "16384",
                                    "--families", "auto", "--jsonl", f"{work}/selection.jsonl"]),
        ]
    elif part == 2:
        sanitize = [sanitizer, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "3",
                    PY, B + "gpu_sanitize_case.py"]
        steps = [
            Step("sanitizer_warm", 25, [PY, B + "gpu_sanitize_case.py"], no_tune),
            Step("sanitizer", 50, ["echo", "dry run: would run", *sanitize] if dry else sanitize, no_tune),
            Step("bf16_grads", 45, [PY, B + "bf16_gradients.py", "--device", "cuda", "--T", "256", "1024", "--D",
                                    "64", "100", "--backends", "triton", "torch", "--out", f"{work}/bf16_gradients.md"]),
            Step("floor", 60, [PY, B + "gpu_floor.py", "--out", f"{work}/floor"]),
            Step("selection_32k", 70, [PY, B + "bench_gpu_selection.py", "--parts", "selection", "--n", "32768",
                                       "--jsonl", f"{work}/selection_32k.jsonl"]),
            Step("bench_16k", 75, _bench(work, "bench_n16384_d128", "--n", "16384", "--d", "128", "--families",
                                         "sliding_window", "causal", "--densities", "0.1", "1.0")),
            Step("ncu_dkdv", 40, [PY, B + "ncu_block_sparse.py", "--dkdv-candidates", "--n", "8192", "--d", "128",
                                  "--family", "causal", "--density", "1.0", "--ncu", ncu,
                                  "--json", f"{work}/ncu_dkdv_candidates.json"]),
            Step("decode", 75, [PY, B + "bench_decode_kernels.py", "--device", "cuda", "--seq-lens",
                                "8192,65536,1048576", "--dtypes", "bf16", "--rounds", "2", "--no-before",
                                "--out", f"{work}/decode_gpu"]),
            Step("ncu_dense", 60, [PY, B + "ncu_dense.py", "--n", "4096", "--ncu", ncu,
                                   "--json", f"{work}/ncu_dense.json"]),
            Step("flex_autotune", 90, _bench(work, "flex_max_autotune", "--n", "8192", "--d", "128", "--families",
                                             "causal", "sliding_window", "--densities", "0.05", "--flex-modes",
                                             "max-autotune-no-cudagraphs", "--no-sdpa")),
            Step("ncu_bytes", 30, [PY, B + "ncu_block_sparse.py", "--n", "8192", "--d", "128", "--family", "causal",
                                   "--density", "1.0", "--ncu", ncu, "--json", f"{work}/ncu_causal.json"]),
            Step("bench_4k", 60, _bench(work, "bench_n4096", "--n", "4096", "--d", "64", "128", "--families",
                                        "sliding_window", "causal", "--densities", "0.1", "1.0")),
            Step("bench_16k_d64", 60, _bench(work, "bench_n16384_d64", "--n", "16384", "--d", "64", "--families",
                                             "sliding_window", "causal", "--densities", "0.1", "1.0")),
            Step("metadata", 40, [PY, B + "bench_gpu_selection.py", "--parts", "metadata", "--meta-n", "8192",
                                  "16384", "32768", "--jsonl", f"{work}/metadata.jsonl"]),
        ]
    else:
        raise ValueError(f"part must be 1 or 2, got {part}")
    if dry:
        for s in steps:
            if s.cmd[0] == PY and s.cmd[1] != "-m":
                s.cmd = s.cmd + ["--dry-run"]
            if s.name == "decode":
                s.cmd = [a for a in s.cmd if a not in ("--device", "cuda")]
    return steps


def pack(work: Path, out: Path, part: int) -> None:
    tmp = out / f"gpu_session_part{part}.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname=f"gpu_session_part{part}")
    tmp.replace(out / f"gpu_session_part{part}.tar.gz")


def run_step(step: Step, work: Path, env: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    log = work / f"{step.name}.log"
    with log.open("w") as f:
        f.write("$ " + " ".join(map(str, step.cmd)) + "\n")
        f.flush()
        try:
            proc = subprocess.Popen(step.cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**env, **step.env},
                                    start_new_session=True)
        except OSError as exc:
            rc = f"could not start: {exc}"
        else:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"   # the step's whole process group (pytest's workers too), not only its first process
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"step": step.name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "limit": step.limit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", type=int, choices=(1, 2), help="which call's steps")
    p.add_argument("--out", type=Path, help="folder for the summary and the packed results")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all steps together (default {BUDGET_S}; a dry run: no deadline)")
    p.add_argument("--only", nargs="*", default=None, help="run only these steps (name prefixes)")
    p.add_argument("--skip", nargs="*", default=[], help="skip these steps (name prefixes)")
    p.add_argument("--dry-run", action="store_true", help="the plan on a CPU: every step in its dry form")
    p.add_argument("--list", action="store_true", help="print both parts' plans and exit")
    p.add_argument("--work", type=Path, default=None, help="work folder (default /tmp/gpu_session_part<N>[_dry])")
    args = p.parse_args(argv)
    if args.list:
        for part in (1, 2):
            steps = plan(part, Path("/tmp/gpu_session"), False)
            print(f"part {part}: {sum(s.limit for s in steps)} s of limits, budget {BUDGET_S} s")
            for s in steps:
                print(f"  {s.name:15s} {s.limit:4d} s  {' '.join(map(str, s.cmd))[:150]}")
        return 0
    if args.part is None or args.out is None:
        p.error("--part and --out are required (or --list)")
    budget = args.budget if args.budget is not None else (1e9 if args.dry_run else BUDGET_S)
    deadline = time.monotonic() + budget
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path("/tmp") / f"gpu_session_part{args.part}{'_dry' if args.dry_run else ''}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    summary = {"part": args.part, "dry_run": args.dry_run, "budget_s": budget, "steps": []}
    summary_file = args.out / f"summary_part{args.part}.json"
    for step in plan(args.part, work, args.dry_run):
        chosen = args.only is None or any(step.name.startswith(o) for o in args.only)
        if not chosen or any(step.name.startswith(s) for s in args.skip):
            summary["steps"].append({"step": step.name, "status": "not selected (--only/--skip)"})
            continue
        left = deadline - time.monotonic()
        if left < min(step.limit, 20):
            summary["steps"].append({"step": step.name, "status": "skipped (no time left)"})
            continue
        timeout = min(step.limit, left) if not args.dry_run else max(step.limit, 300)
        res = run_step(step, work, env, timeout)
        res["status"] = "ok" if res["rc"] == 0 else "failed"
        summary["steps"].append(res)
        tail = (work / f"{step.name}.log").read_text(errors="replace").splitlines()[-6:]
        print(f"== {step.name}: rc={res['rc']} {res['seconds']} s (limit {step.limit})",
              *("   " + ln[:220] for ln in tail), sep="\n", flush=True)
        summary_file.write_text(json.dumps(summary, indent=1))
        pack(work, args.out, args.part)
    summary_file.write_text(json.dumps(summary, indent=1))
    pack(work, args.out, args.part)
    print(json.dumps(summary))
    return 0 if all(s.get("status", "ok") != "failed" for s in summary["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
