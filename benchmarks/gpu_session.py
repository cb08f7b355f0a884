"""One GPU session (issue 33): every device check in one call, each step a subprocess with its own
time limit, under one deadline. Steps that do not fit the time left are skipped (and listed).

    python3 benchmarks/gpu_session.py --out $OUT --budget 450

Steps, in priority order: ``env`` (GPU, driver, CUDA, torch, triton; copy bandwidth and a bf16
matmul measured here), ``tests`` (tests/gpu and the Triton correctness matrix, compiled on CUDA),
``sanitizer`` (``compute-sanitizer --tool memcheck`` on one forward+backward of each op),
``bench`` (benchmarks/bench_gpu_block_sparse.py at N = 8192, D = 128), ``ncu``
(benchmarks/ncu_block_sparse.py per pattern), ``selection`` (benchmarks/bench_gpu_selection.py),
``decode`` (benchmarks/bench_decode_kernels.py on CUDA: against flex-decode and SDPA),
``bench_more`` (other N and D). Logs and result files go to a work folder; after every step the
folder is packed into ``<out>/gpu_session.tar.gz`` (the device tool brings back at most 8 files),
and ``<out>/summary.json`` says what ran, how long, and its exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TRITON_MATRIX = ["tests/gpu", "tests/block_sparse/test_correctness.py", "tests/block_sparse/test_triton_block_sparse.py",
                 "tests/block_sparse/test_traffic_block_sparse.py", "tests/selection/test_correctness.py",
                 "tests/selection/test_triton_selection.py", "tests/selection/test_traffic_selection.py",
                 "tests/block_sparse/test_decode.py", "tests/selection/test_decode_triton.py"]

ENV = r"""
import json, subprocess, time, torch, triton, triton.testing
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
p = torch.cuda.get_device_properties(0)
x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)   # 1 GiB
y = torch.empty_like(x)
copy_ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200)
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
print(json.dumps({"nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": triton.__version__, "sm_count": p.multi_processor_count,
                  "l2_bytes": getattr(p, "L2_cache_size", None), "copy_TBps": 2 * x.numel() * 2 / copy_ms / 1e9,
                  "bf16_matmul_8192_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
"""


def _tool(name: str) -> str:
    """``name`` on the PATH, else the newest under /usr/local/cuda*/bin or /opt/nvidia."""
    import glob
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/local/cuda*/bin/{name}") + glob.glob(f"/opt/nvidia/**/{name}", recursive=True))
    return hits[-1] if hits else name


def steps(work: Path, quick: bool) -> list[tuple[str, list[str], int, dict]]:
    b = "benchmarks/"
    ncu, sanitizer = _tool("ncu"), _tool("compute-sanitizer")
    no_tune = {"SPARSE_IO_ATTN_NO_AUTOTUNE": "1"}
    out = [
        ("env", [PY, "-c", ENV], 40, {}),
        ("tests", [PY, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", "-k", "triton or gpu",
                   "--timeout", "150", f"--junitxml={work}/tests.xml", *TRITON_MATRIX], 140, {}),
        ("sanitizer_warm", [PY, b + "gpu_sanitize_case.py"], 45, no_tune),
        ("sanitizer", [sanitizer, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "3",
                       PY, b + "gpu_sanitize_case.py"], 60, no_tune),
        ("bench", [PY, b + "bench_gpu_block_sparse.py", "--n", "8192", "--d", "128",
                   "--families", "sliding_window", "bigbird", "document", "causal",
                   "--densities", "0.05", "0.25", "1.0", "--jsonl", f"{work}/bench_n8192_d128.jsonl",
                   "--out", f"{work}/gpu_block_sparse_n8192_d128"], 170, {}),
    ]
    for fam, dens in (("sliding_window", "0.1"), ("causal", "1.0"), ("bigbird", "0.25")):
        out.append((f"ncu_{fam}", [PY, b + "ncu_block_sparse.py", "--n", "8192", "--d", "128", "--family", fam,
                                   "--density", dens, "--ncu", ncu, "--json", f"{work}/ncu_{fam}.json"], 40, {}))
    out += [
        ("selection", [PY, b + "bench_gpu_selection.py", "--jsonl", f"{work}/selection.jsonl"], 90, {}),
        ("metadata", [PY, b + "bench_gpu_selection.py", "--parts", "metadata", "--meta-n", "8192", "16384", "32768",
                      "--jsonl", f"{work}/metadata.jsonl"], 90, {}),
        ("decode", [PY, b + "bench_decode_kernels.py", "--device", "cuda", "--seq-lens", "8192,65536,262144,1048576",
                    "--dtypes", "bf16", "--rounds", "3", "--out", f"{work}/decode_gpu"], 150, {}),
        ("bench_more", [PY, b + "bench_gpu_block_sparse.py", "--n", "4096", "16384", "--d", "64", "128",
                        "--families", "sliding_window", "causal", "--densities", "0.1", "1.0",
                        "--jsonl", f"{work}/bench_more.jsonl", "--out", f"{work}/gpu_block_sparse_more"], 200, {}),
    ]
    if quick:
        out = [(n, c, min(t, 30), e) for n, c, t, e in out]
    return out


def pack(work: Path, out: Path) -> None:
    tmp = out / "gpu_session.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="gpu_session")
    tmp.replace(out / "gpu_session.tar.gz")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget", type=float, default=450, help="seconds for all steps together")
    p.add_argument("--only", nargs="*", default=None, help="run only these steps")
    p.add_argument("--skip", nargs="*", default=[], help="skip these steps")
    p.add_argument("--quick", action="store_true", help="30 s per step (a dry run of the driver)")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu_session")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    summary = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    for name, cmd, limit, extra in steps(work, args.quick):
        if (args.only is not None and not any(name.startswith(o) for o in args.only)) or \
                any(name.startswith(s) for s in args.skip):
            continue
        left = deadline - time.monotonic()
        if left < min(limit, 20):
            summary.append({"step": name, "status": "skipped (no time left)"})
            continue
        t0 = time.monotonic()
        log = work / f"{name}.log"
        with log.open("w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**env, **extra},
                                    timeout=min(limit, left), start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            except OSError as exc:
                rc = f"could not start: {exc}"
        summary.append({"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1)})
        tail = log.read_text(errors="replace").splitlines()[-6:]
        print(f"== {name}: rc={rc} {summary[-1]['seconds']} s", *("   " + ln[:220] for ln in tail), sep="\n", flush=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        pack(work, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    pack(work, args.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
