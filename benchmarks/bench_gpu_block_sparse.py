"""GPU benchmark of backend="triton" against compiled FlexAttention and dense SDPA (flash).

Grid (issue 3, section 4): B*H = 16 (B = 1, H = 16), N in {4096, 16384}, D in {64, 128}, bf16,
layout families sliding window / BigBird / causal / random at target densities {5, 10, 25, 50, 100}%,
forward and forward+backward. FlexAttention gets the identical ``BlockMask``
(``layout.to_flex_block_mask(causal)``) and runs at its own default tiles (``flex_ms``); only if that
fails to compile is the error recorded (``flex_default_error``) and Flex timed again with 64 x 64 tiles,
in its own column (``flex_64x64_ms``, never mixed with ``flex_ms``). Each row records the export's
``mask_mod`` rule and tables (``flex_mask``). SDPA runs dense (``is_causal`` for the
causal family). Times with ``triton.testing.do_bench`` (``return_mode="median"``, named in the header's
``timing``; do_bench's default is the mean). SDPA runs dense, once per backend named (``sdpa_flash_ms``,
``sdpa_cudnn_ms``; a backend that cannot run the call records ``sdpa_<name>_error``). ``--flex-modes``:
Flex at its defaults (``default``: ``flex_ms``) and/or compiled with ``mode="max-autotune-no-cudagraphs"``
(``flex_mat_ms``). Next to each time: kept blocks, kept-element FLOPs, TFLOP/s and the bytes the traffic
model predicts (what ``IOCounter`` counts). At density 1 only the sliding-window (dense) and causal
families run: the others' dense layout is the same one.

Density targets: sliding window and BigBird parameters are searched to the closest density; the
causal family keeps that fraction of the causal (lower-triangle) blocks and runs with
``causal=True`` (100% = the causal layout); random keeps that fraction of all blocks per head.

    python benchmarks/bench_gpu_block_sparse.py                 # full grid, writes benchmarks/results/
    python benchmarks/bench_gpu_block_sparse.py --n 4096 --d 64 --families random
    python benchmarks/bench_gpu_block_sparse.py --dry-run       # tiny, on a CPU: every path, stubs for CUDA
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_timing as timing  # noqa: E402

FAMILIES = ("sliding_window", "bigbird", "causal", "random", "document")
DENSITIES = (0.05, 0.10, 0.25, 0.50, 1.00)
RESULTS = Path(__file__).resolve().parent / "results"
# Flex's tiles when its default choice does not compile (an H200, torch 2.11, the int32-table export
# before narrow tables: the default forward asked for 262,144 B of shared memory at D = 128); timed
# in the separate column flex_64x64_ms, the error in flex_default_error.
FLEX_FALLBACK = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}
#: --flex-modes -> (torch.compile mode, column prefix)
FLEX_MODES = {"default": (None, "flex"), "max-autotune-no-cudagraphs": ("max-autotune-no-cudagraphs", "flex_mat")}
DENSE_FAMILIES = ("sliding_window", "causal")   # the families run at density 1 (the others' is the same layout)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384], help="sequence lengths")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head dims")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block", type=int, default=128, help="layout block size (FlexAttention default 128)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention)")
    p.add_argument("--flex-modes", nargs="+", default=["default"], choices=sorted(FLEX_MODES),
                   help="Flex at its defaults and/or compiled with mode='max-autotune-no-cudagraphs'")
    p.add_argument("--no-sdpa", action="store_true", help="skip dense SDPA")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="append each row as one JSON line when it is measured (survives a timeout)")
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/gpu_block_sparse_<gpu>)")
    p.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true",
                   help="tiny configuration (N 64, D 16, B*H 2, blocks of 16, the first family at density 0.5) "
                        "on the CPU: the Triton interpreter, "
                        "eager Flex forward only, SDPA's CPU backends, perf_counter times (benchmarks/_gpu_timing.py); "
                        "writes nothing unless --out is given")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ layouts
def _closest(build, lo: int, hi: int, target: float):
    """Integer parameter in [lo, hi] whose layout density is closest to target (density increasing)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if build(mid).density < target:
            lo = mid
        else:
            hi = mid
    a, b = build(lo), build(hi)
    return a if abs(a.density - target) <= abs(b.density - target) else b


def make_layout(family: str, n: int, block: int, density: float, heads: int):
    """``(layout, causal)`` of a family at (about) the target block density."""
    from sparse_io_attn import patterns

    if family == "causal":
        lay = patterns.causal(n, block) if density >= 1 else patterns.random(n, block, density, causal=True,
                                                                               num_heads=heads)
        return lay, True
    if density >= 1:
        return patterns.dense(n, block), False
    if family == "sliding_window":
        return _closest(lambda w: patterns.sliding_window(n, block, w), 0, n, density), False
    if family == "document":
        # packed documents (causal inside each): lengths drawn to fill n, the mean about n * density
        g = torch.Generator().manual_seed(0)
        mean = max(block, int(n * density))
        cu = [0]
        while cu[-1] < n:
            cu.append(min(n, cu[-1] + int(mean * (0.5 + torch.rand(1, generator=g).item()))))
        return patterns.document(cu, block, causal=True), True
    if family == "bigbird":
        nb = math.ceil(n / block)
        return _closest(lambda r: patterns.bigbird(n, block, num_random=r, num_global=1, num_heads=heads),
                        0, nb, density), False
    return patterns.random(n, block, density, num_heads=heads), False


# ------------------------------------------------------------------------------------------ timing
def _first_call(fn, dry: bool) -> float:
    """Seconds of the first call (compile + autotune + run): kept apart from the timed runs."""
    t0 = time.perf_counter()
    fn()
    timing.sync(dry)
    return time.perf_counter() - t0


def _op(attn, q, k, v, do, mode, dry: bool = False):
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                attn(q, k, v)
        return fwd

    def fwd_bwd():
        out = attn(q, k, v)
        if dry and out.grad_fn is None:   # a dry run's eager Flex: forward only (no CPU backward)
            return
        out.backward(do)
    return fwd_bwd


def _flex_times(flex, prefix: str, block_mask, q, k, v, do, mode, dry: bool) -> dict:
    """Flex (``flex``: compiled at its defaults or in a mode; columns ``<prefix>_*``) with the exported
    ``block_mask``: first call and time, or the compile error and, for the defaults, in the labelled
    columns ``flex_64x64_*``, the same with :data:`FLEX_FALLBACK` tiles."""
    from sparse_io_attn.layout import _flex

    out = {"flex_mask": _flex.describe(block_mask.mask_mod)}
    fx = lambda q, k, v: flex(q, k, v, block_mask=block_mask)  # noqa: E731
    try:
        out[f"{prefix}_first_call_s"] = _first_call(_op(fx, q, k, v, do, mode, dry), dry)
        out[f"{prefix}_ms"] = timing.bench(_op(fx, q, k, v, do, mode, dry), [q, k, v], dry=dry)
        return out
    except Exception as exc:  # noqa: BLE001  (Inductor's default tiles can exceed shared memory)
        out[f"{prefix}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if prefix != "flex":
        return out
    fx = lambda q, k, v: flex(q, k, v, block_mask=block_mask, kernel_options=FLEX_FALLBACK)  # noqa: E731
    out["flex_64x64_kernel_options"] = FLEX_FALLBACK
    out["flex_64x64_first_call_s"] = _first_call(_op(fx, q, k, v, do, mode, dry), dry)
    out["flex_64x64_ms"] = timing.bench(_op(fx, q, k, v, do, mode, dry), [q, k, v], dry=dry)
    return out


def _sdpa_times(sdpas: dict, q, k, v, do, mode, causal: bool, dry: bool) -> dict:
    """Dense SDPA per named backend: ``sdpa_<name>_ms``, or ``sdpa_<name>_error``."""
    out = {}
    for name, call in sdpas.items():
        fn = _op(lambda q, k, v: call(q, k, v, causal), q, k, v, do, mode, dry)  # noqa: B023
        try:
            fn()
            out[f"sdpa_{name}_ms"] = timing.bench(fn, [q, k, v], dry=dry)
        except Exception as exc:  # noqa: BLE001  (a backend this GPU or build does not have)
            out[f"sdpa_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def matmul_tflops(device: str, dtype: torch.dtype, n: int = 8192) -> float | None:
    """bf16 (or ``dtype``) ``n^3`` matmul rate on random data, this process, this run (the ceiling)."""
    if device != "cuda":
        return None
    import triton.testing
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    return 2 * n ** 3 / ms / 1e9


def machine_header(device: str, dtype: torch.dtype) -> dict:
    import triton
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, Triton interpreter, dry run)"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "timing": timing.label("median", device != "cuda"),
            "autotune (warps/stages)": device == "cuda" and os.environ.get("SPARSE_IO_ATTN_NO_AUTOTUNE", "0") != "1",
            "driver": _driver(device), "matmul_tflops": matmul_tflops(device, dtype)}


def _driver(device: str) -> str | None:
    if device != "cuda":
        return None
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args) -> tuple[dict, list[dict]]:
    import sparse_io_attn._triton.runtime  # noqa: F401  (picks compiled vs interpreter before triton is imported)
    from sparse_io_attn import block_sparse_attention
    from sparse_io_attn.accounting import traffic

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU (--dry-run runs it on a CPU)")
    device = "cpu" if dry else "cuda"
    if dry:   # every code path once: the first family, one density
        args.n, args.d, args.batch, args.heads, args.block, args.dtype = [64], [16], 1, 2, 16, "fp32"
        args.families, args.densities = args.families[:1], [0.5]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    header = machine_header(device, dtype)
    flexes = {} if args.no_flex else {FLEX_MODES[m][1]: timing.flex(FLEX_MODES[m][0], dry=dry) for m in args.flex_modes}
    sdpas = {} if args.no_sdpa else {name: timing.sdpa(b) for name, b in timing.sdpa_backends().items()}
    header["flex"] = {FLEX_MODES[m][1]: f"torch.compile(flex_attention, dynamic=False, mode={FLEX_MODES[m][0]!r})"
                      + (" (dry run: eager, forward only)" if dry else "") for m in ([] if args.no_flex else args.flex_modes)}
    header["sdpa"] = {name: f"dense scaled_dot_product_attention under sdpa_kernel({b})" for name, b in
                      ({} if args.no_sdpa else timing.sdpa_backends()).items()}
    B, H = args.batch, args.heads
    rows = []
    for n in args.n:
        for d in args.d:
            q, k, v, do = (torch.randn(B, H, n, d, device=device, dtype=dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            sdpa_cache = {}
            for family in args.families:
                for target in args.densities:
                    if target >= 1 and family not in DENSE_FAMILIES:
                        continue   # the same dense layout as sliding_window's
                    layout, causal = make_layout(family, n, args.block, target, H)
                    layout = layout.to(device)
                    kept = layout.nnz_blocks * (B * H // layout.num_layouts)
                    block_mask = layout.to_flex_block_mask(causal) if flexes else None
                    for mode in args.modes:
                        bwd = mode != "fwd"
                        row = {"N": n, "D": d, "family": family, "target_density": target,
                               "density": round(layout.density, 4), "layout": layout.name, "causal": causal,
                               "mode": mode, "kept_blocks": kept}
                        flops = traffic.block_sparse_flops(layout, B, H, d, causal=causal)
                        if bwd:
                            flops += traffic.block_sparse_flops(layout, B, H, d, causal=causal, backward=True)
                        model = (traffic.block_sparse if bwd else traffic.block_sparse_forward)(
                            layout, B, H, H, d, dtype, causal=causal)
                        row["flops"] = flops
                        row["model_bytes"] = model.total_bytes
                        tri = lambda q, k, v, lay=layout, c=causal: block_sparse_attention(  # noqa: E731
                            q, k, v, lay, causal=c, backend="triton")
                        row["triton_first_call_s"] = _first_call(_op(tri, q, k, v, do, mode), dry)
                        row["triton_ms"] = timing.bench(_op(tri, q, k, v, do, mode), [q, k, v], dry=dry)
                        for prefix, flex in flexes.items():
                            row.update(_flex_times(flex, prefix, block_mask, q, k, v, do, mode, dry))
                        if (mode, causal) not in sdpa_cache:
                            sdpa_cache[mode, causal] = _sdpa_times(sdpas, q, k, v, do, mode, causal, dry)
                        row.update(sdpa_cache[mode, causal])
                        for col in [c for c in row if c.endswith("_ms") and c != "triton_ms"]:
                            row[f"speedup_vs_{col[:-3]}"] = row[col] / row["triton_ms"]
                        row["triton_tflops"] = flops / row["triton_ms"] / 1e9
                        row["triton_us_per_kept_block"] = 1e3 * row["triton_ms"] / max(kept, 1)
                        if header.get("matmul_tflops"):
                            row["frac_of_matmul"] = row["triton_tflops"] / header["matmul_tflops"]
                            for col in ("flex_ms", "flex_mat_ms", "flex_64x64_ms"):
                                if col in row:
                                    row[col.replace("_ms", "_tflops")] = flops / row[col] / 1e9
                        rows.append(row)
                        if args.jsonl is not None:
                            with args.jsonl.open("a") as f:
                                f.write(json.dumps({**row, "machine": header}) + "\n")
                        print(_fmt_row(row), flush=True)
    return header, rows


COLUMNS = [("N", "{}"), ("D", "{}"), ("family", "{}"), ("density", "{:.3f}"), ("mode", "{}"),
           ("kept_blocks", "{}"), ("triton_ms", "{:.3f}"), ("flex_ms", "{:.3f}"), ("speedup_vs_flex", "{:.2f}x"),
           ("flex_mat_ms", "{:.3f}"), ("speedup_vs_flex_mat", "{:.2f}x"),
           ("flex_64x64_ms", "{:.3f}"), ("speedup_vs_flex_64x64", "{:.2f}x"),
           ("sdpa_flash_ms", "{:.3f}"), ("sdpa_cudnn_ms", "{:.3f}"), ("triton_tflops", "{:.1f}"), ("flex_tflops", "{:.1f}"),
           ("frac_of_matmul", "{:.2f}"), ("triton_us_per_kept_block", "{:.3f}"),
           ("model_bytes", "{:,}")]


def _fmt_row(row: dict) -> str:
    return " | ".join(fmt.format(row[c]) if c in row else "-" for c, fmt in COLUMNS)


def write_results(stem: Path, header: dict, rows: list[dict]) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"machine": header, "rows": rows}, indent=1))
    keys = sorted({k for r in rows for k in r})
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = ["# Block-sparse attention, backend triton vs FlexAttention vs dense SDPA", "",
             *(f"- {k}: {v}" for k, v in header.items()), "",
             "| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + _fmt_row(r) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.{{json,csv,md}}")


def main(argv=None) -> None:
    args = parse_args(argv)
    header, rows = run(args)
    print("\n".join(f"# {k}: {v}" for k, v in header.items()))
    print(" | ".join(c for c, _ in COLUMNS))
    for r in rows:
        print(_fmt_row(r))
    if args.out is not None or not args.dry_run:
        gpu = header["device"].replace(" ", "_").replace("/", "_")
        write_results(args.out or RESULTS / f"gpu_block_sparse_{gpu}", header, rows)


if __name__ == "__main__":
    main()
