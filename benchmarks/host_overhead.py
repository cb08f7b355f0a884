"""Host time per ``block_sparse_attention`` forward+backward on backend ``"triton"``, the kernels stubbed
(issue 46 point 2): what the Python around the launches costs, measured on a CPU.

The stub (:func:`stubbed_launches`, the same for every checkout timed) replaces what runs on the GPU
and nothing else:

* ``JITFunction.run`` and ``InterpretedFunction.run`` (Triton's launch of one kernel: argument
  binding, the compiled-kernel lookup and the driver call; on this machine the interpreter) return
  at once; each call is counted (launches per step);
* the autotuner's benchmark of one configuration (``Autotuner._bench``, in every Triton 3.x) returns
  the same times for every configuration, so the first call of a tuning key tunes without a GPU (the
  first configuration wins);
* ``sparse_io_attn._triton.runtime.autotune_enabled`` returns True: the launches take the path they
  take on CUDA (autotuned, ``COUNT_IO`` off), not the interpreter's fixed first configuration.

Everything else runs as on a GPU: the public call (checks, the plan's cache lookup), the custom op
and its autograd wiring, the launchers (arguments, grids, configurations, output allocation), the
autotuner wrapper. Inputs are CPU tensors (allocation is the CPU allocator's, not CUDA's caching
one: the shape is kept small so that it stays a small share). Per case: the median over
``--repeats`` calls, after warm-up calls that build the plan and tune every key.

    python benchmarks/host_overhead.py                        # this checkout, a table
    python benchmarks/host_overhead.py --profile              # cProfile of forward+backward, top 25
    python benchmarks/host_overhead.py --compare /work/main . --rounds 6 --out benchmarks/results/host_overhead.md

``--compare`` runs the script under each checkout's own ``.venv/bin/python`` (``PYTHONPATH`` set to
the checkout), alternating, ``--rounds`` times, and writes the paired table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("sliding_window", "causal")


@contextlib.contextmanager
def stubbed_launches(record: list | None = None):
    """Within the block no Triton kernel runs (see the module docstring); yields a dict counting the
    stubbed launches (``"launches"``). ``record``: a list receiving each launch as ``(kernel, grid,
    {argument name: value})`` (the tests' view of what would have run)."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from sparse_io_attn._triton import runtime

    count = {"launches": 0}

    def run(self, *args, grid, warmup, **kwargs):
        count["launches"] += 1
        if record is not None:
            record.append((self, grid, dict(zip(self.arg_names, args), **kwargs)))

    saved = [(jit.JITFunction, "run", jit.JITFunction.run),
             (interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run),
             (autotuner.Autotuner, "_bench", autotuner.Autotuner._bench),
             (runtime, "autotune_enabled", runtime.autotune_enabled)]
    jit.JITFunction.run = run
    interpreter.InterpretedFunction.run = run
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
    runtime.autotune_enabled = lambda: True
    try:
        yield count
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _cases(args):
    import torch
    from _cpu_timing import fwd_bwd

    from sparse_io_attn import block_sparse_attention, patterns

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, H, N, D, block = args.batch, args.heads, args.n, args.d, args.block
    q, k, v, do = (torch.randn(B, H, N, D, dtype=dtype) for _ in range(4))
    layouts = {"sliding_window": (patterns.sliding_window(N, block, 2 * block), False),
               "causal": (patterns.causal(N, block), True)}
    runs = {}
    for name in args.cases:
        layout, causal = layouts[name]
        attn = (lambda lay, c: lambda q, k, v: block_sparse_attention(q, k, v, lay, causal=c, backend="triton"))(
            layout, causal)

        def fwd(attn=attn):
            with torch.no_grad():
                attn(q, k, v)
        runs[f"{name} fwd"] = fwd
        runs[f"{name} fwd+bwd"] = fwd_bwd(attn, q, k, v, do)
    return runs


def outputs_only(fn):
    """``fn`` with the Triton backend's ``forward``/``backward`` replaced, for the call, by functions that
    only allocate the outputs: the floor of the op's wiring (checks, plan lookup, custom op, autograd)."""
    import torch

    from sparse_io_attn.block_sparse.triton import launch

    def forward(q, k, v, plan, *, sm_scale, decode=None):
        B, H, N, _ = q.shape
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty(B, H, N, dtype=torch.float32), torch.empty(2, B, H, N, dtype=torch.float32))

    def backward(do, q, k, v, out, stats, plan, *, sm_scale):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    def run():
        real = launch.forward, launch.backward
        launch.forward, launch.backward = forward, backward
        try:
            fn()
        finally:
            launch.forward, launch.backward = real
    return run


def measure(args) -> dict:
    """``{"header", "median_us", "launches"}`` of this checkout (the stub active throughout); each case
    also as ``"<case> [outputs-only backend]"`` (:func:`outputs_only`), timed in the same rounds."""
    import torch

    import sparse_io_attn
    import sparse_io_attn._triton.runtime  # noqa: F401  (the interpreter switch, before triton loads)
    import triton
    from _cpu_timing import time_interleaved

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with stubbed_launches() as count:
        runs = _cases(args)
        runs.update({f"{name} [outputs-only backend]": outputs_only(fn) for name, fn in list(runs.items())})
        launches = {}
        for name, fn in runs.items():
            for _ in range(args.warmup):
                fn()
            before = count["launches"]
            fn()
            launches[name] = count["launches"] - before
        times = time_interleaved(runs, args.repeats)
    header = {"checkout": str(Path(sparse_io_attn.__file__).resolve().parent.parent), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(), "load": os.getloadavg()[0]}
    return {"header": header, "median_us": {n: statistics.median(t) * 1e6 for n, t in times.items()},
            "launches": launches}


def profile(args) -> None:
    import cProfile
    import pstats

    import sparse_io_attn._triton.runtime  # noqa: F401
    with stubbed_launches():
        runs = _cases(args)
        fn = runs[f"{args.cases[0]} fwd+bwd"]
        for _ in range(args.warmup):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeats):
            fn()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


# ------------------------------------------------------------------------------------ comparison
def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    return {"cpu": cpu, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _run_checkout(checkout: Path, argv: list[str]) -> dict:
    py = checkout / ".venv" / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=str(checkout), TRITON_INTERPRET="1")
    res = subprocess.run([str(py if py.exists() else sys.executable), str(Path(__file__).resolve()), "--json",
                          *argv], capture_output=True, text=True, env=env, cwd=checkout, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{checkout}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare(args, passthrough: list[str]) -> None:
    before, after = (Path(c).resolve() for c in args.compare)
    load0 = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        pair = {}
        for which, checkout in (("before", before), ("after", after))[::(1 if r % 2 == 0 else -1)]:
            pair[which] = _run_checkout(checkout, passthrough)
        rounds.append(pair)
        print(f"round {r + 1}: " + ", ".join(f"{n}: {pair['before']['median_us'][n]:.0f} -> "
                                             f"{pair['after']['median_us'][n]:.0f} us" for n in pair["after"]["median_us"]),
              flush=True)
    load1 = os.getloadavg()
    names = list(rounds[0]["after"]["median_us"])
    lines = ["| case | launches (before, after) | before (median of rounds) | after | after / before | per-round us (before -> after) |",
             "|---|---|---|---|---|---|"]
    for n in names:
        b = statistics.median(p["before"]["median_us"][n] for p in rounds)
        a = statistics.median(p["after"]["median_us"][n] for p in rounds)
        per = ", ".join(f"{p['before']['median_us'][n]:.0f}->{p['after']['median_us'][n]:.0f}" for p in rounds)
        lines.append(f"| {n} | {rounds[0]['before']['launches'][n]}, {rounds[0]['after']['launches'][n]} | "
                     f"{b:.1f} us | {a:.1f} us | {a / b:.2f} | {per} |")
    hb, ha = rounds[0]["before"]["header"], rounds[0]["after"]["header"]
    m = _machine()
    text = "\n".join([
        "# Host time per block-sparse forward+backward, Triton launches stubbed (issue 46 point 2)", "",
        f"- machine: {m['cpu']}, {m['cores']} cores (shared); {m['date']}; load average (1, 5, 15 min) "
        f"{tuple(round(x, 2) for x in load0)} at start, {tuple(round(x, 2) for x in load1)} at the end",
        f"- before: `{hb['checkout']}` (torch {hb['torch']}, triton {hb['triton']}, Python {hb['python']}); "
        f"after: `{ha['checkout']}` (torch {ha['torch']}, triton {ha['triton']})",
        f"- command: `python benchmarks/host_overhead.py --compare {' '.join(args.compare)} --rounds {args.rounds} "
        f"{' '.join(passthrough)}` ({args.rounds} rounds alternating the checkouts, each a fresh process; per "
        f"case the median of {args.repeats} interleaved calls after {args.warmup} warm-up calls)",
        f"- shape: B {args.batch}, H {args.heads}, N {args.n}, D {args.d}, {args.dtype}, blocks of {args.block}; "
        f"sliding window of 2 blocks each side (not causal), causal layout (causal=True); the layout passed as "
        f"users do (the plan found in its cache)",
        "- stub: `JITFunction.run`/`InterpretedFunction.run` return at once, the autotuner's benchmark of a "
        "configuration returns one time for all, `autotune_enabled()` is True (the CUDA path); see the script's docstring",
        "", *lines, ""])
    if args.out is not None:
        notes = ""
        if args.out.exists() and "<!-- notes -->" in args.out.read_text():
            notes = args.out.read_text().split("<!-- notes -->", 1)[1]
        args.out.write_text(text + "\n<!-- notes -->" + notes)
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--profile", action="store_true", help="cProfile of the first case's forward+backward")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="two checkouts, each run with its own .venv")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=None, help="markdown file of --compare (notes after "
                                                          "'<!-- notes -->' are kept)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.compare:
        skip = {"--compare": 2, "--rounds": 1, "--out": 1}
        passthrough, i = [], 0
        while i < len(raw):
            if raw[i] in skip:
                i += 1 + skip[raw[i]]
                continue
            passthrough.append(raw[i])
            i += 1
        compare(args, passthrough)
    elif args.profile:
        profile(args)
    else:
        res = measure(args)
        if args.json:
            print(json.dumps(res))
        else:
            print(res["header"])
            for name, us in res["median_us"].items():
                print(f"{name:24s} {us:9.1f} us   ({res['launches'][name]} launches)")


if __name__ == "__main__":
    main()
