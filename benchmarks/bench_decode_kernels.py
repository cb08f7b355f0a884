"""CPU benchmark of the decode kernels (issue 38, item 1): one attention call of one query token
against a KV cache of ``Nk`` keys, ``block_sparse_attention`` and ``selection_attention`` on backend
``"cpu"`` against dense ``scaled_dot_product_attention`` on the same cache.

Setting: 2 torch threads, B = 1, Hq = 8, Hkv = 2, D = 64, Nq = 1, Nk in {8k, 64k, 256k, 1M}, fp32
and bf16:

* ``window``: a sliding window of 1024 keys, the decoded row of ``patterns.sliding_window(...,
  causal=True)`` (element-exact: a partial block at the window's start and on the diagonal), blocks
  of 64, ``causal="bottom_right"``. The decode layout is built directly from the window's key blocks
  (``layout ms``: the window built at a small length and moved to the end of the cache, O(window));
  ``plan ms`` is ``sparse_io_attn.plan`` of it (its CSC lists are O(key blocks)), both timed apart
  from the attention calls, which reuse one plan.
* ``moba``: MoBA-shaped per-token selections, one per query head (G = Hq), blocks of 64, top 8: the
  token's own block and 7 distinct random earlier ones (the selector's cost is not included: issue
  38's item 2). ``sel plan ms`` is the ``SelectionPlan`` (the rows normalised in C++), timed apart.
* ``moba+selector``: the whole MoBA decode step with its selector, ``nn.selectors.moba(64, 8)``:
  ``step`` on the cache's decode state (chunk means and the incomplete chunk's keys of the first
  ``Nk - 1`` keys) appending the last key, which completes a chunk (the costlier step, one in 64),
  then ``selection_attention`` on the chosen chunks with its plan built in the call.
* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``, what a model calls, and
  ``sdpa folded``: the GQA group's query heads folded into the query length
  (``q.view(B, Hkv, Hq // Hkv, D)`` against the same ``k``, ``v``), the fastest dense baseline we know.
* ``before``: the same calls on the prefill kernels (``decode=False``: one task per (head, query
  tile), K^T packed for every key block, fp16/bf16 converted per call), for comparison.

One process; every method of a size runs once per round (each round's start rotates), after one
warm-up round; a method's time in a round is the mean of ``inner`` back-to-back calls (``inner`` from
the warm-up, about 10 ms of calls), and the table reports the median over rounds. Successive calls
rotate over ``caches`` independent q/K/V sets (as many as fit 1 GiB, at most 8: the layers of a
model), so a call does not find the previous call's kept blocks in the cache. ``GB/s`` is the
window's kept K/V bytes (kept keys x Hkv x D x 2 x element size) per second of the window call. The
machine header records the CPU, threads, torch version and the load average at start and end: on a
shared machine compare the ratios, which come from the same rounds.

Targets (issue 38) at Nk = 65,536: window >= 20x faster than SDPA; MoBA with its selector >= 8x.

``--device cuda`` runs the same table on a GPU with backend ``"triton"`` (the block-sparse decode
kernels; the selection kernel as it is) against SDPA (flash) and compiled FlexAttention with the same
``BlockMask`` (``layout.to_flex_block_mask()``: flex-decode for one query token), each call captured
in a CUDA graph and timed with ``triton.testing.do_bench_cudagraph`` (median: the kernels' time, not
the host's launch overhead), and adds ``moba_bs``: the MoBA-shaped selection of one token as a
per-head block layout through the block-sparse decode kernel.

    python benchmarks/bench_decode_kernels.py                    # writes benchmarks/results/decode_kernels.md
    python benchmarks/bench_decode_kernels.py --quick --out /tmp/dec   # small sizes, two rounds
    python benchmarks/bench_decode_kernels.py --device cuda --out /tmp/decode_gpu
    python benchmarks/bench_decode_kernels.py --dry-run --out /tmp/dec_dry   # the --device cuda path on a CPU

``--dry-run`` runs the ``--device cuda`` path on a CPU at tiny sizes (Nk 256, window 64, blocks of 32,
Hq 2, Hkv 1, D 16, fp32, one round): backend ``"triton"`` on the interpreter, eager Flex (flex-decode's
stand-in), perf_counter times instead of CUDA graphs (``benchmarks/_gpu_timing.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparse_io_attn import BlockSparseLayout, Selection, block_sparse_attention, patterns, plan, selection_attention
from sparse_io_attn.block_sparse import cpu as block_cpu
from sparse_io_attn.cli._common import DTYPE_NAMES, format_header, format_table, machine_header
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.nn.selectors import moba as moba_selector
from sparse_io_attn.selection import cpu as selection_cpu
from sparse_io_attn.selection.plan import SelectionPlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_timing as timing  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--seq-lens", default="8192,65536,262144,1048576", help="KV lengths (comma-separated)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7, help="timed rounds after one warm-up round")
    p.add_argument("--no-before", action="store_true", help="skip the prefill-kernel ('before') columns")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cache-bytes", type=float, default=2 ** 30, help="bytes of rotated q/K/V sets (default 1 GiB)")
    p.add_argument("--quick", action="store_true", help="8k and 64k keys, two rounds: a smoke run")
    p.add_argument("--dry-run", action="store_true", help="the --device cuda path on a CPU at tiny sizes")
    p.add_argument("--out", type=Path, default=RESULTS / "decode", help="output stem (.md/.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.rounds = "8192,65536", 2
    if args.dry_run:
        args.device, args.seq_lens, args.dtypes, args.rounds = "cpu", "256", "fp32", 1
        args.heads, args.kv_heads, args.head_dim, args.window, args.block = 2, 1, 16, 64, 32
    return args


# ------------------------------------------------------------------------------------ inputs
def window_layout(Nk: int, block: int, window: int) -> BlockSparseLayout:
    """The decoded (last) row of ``patterns.sliding_window(Nk, block, window, causal=True)``: built at
    a small length S (``rows(S - 1, S)``) and moved by whole blocks to the end of ``Nk`` keys."""
    S = -(-(window + 1 + 2 * block) // block) * block
    small = patterns.sliding_window(S, block, window, causal=True).rows(S - 1, S)
    assert (Nk - S) % block == 0, "Nk must be a multiple of the block"
    return BlockSparseLayout(small.crow_indices, small.col_indices + (Nk - S) // block, block_size=block,
                             seqlen=(1, Nk), partial_ids=small.partial_ids, partial_masks=small.partial_masks)


def moba_selection(g: torch.Generator, Hq: int, Nk: int, block: int, top_k: int) -> Selection:
    """``[1, Hq, 1, top_k]``: the token's own (last) block, then ``top_k - 1`` distinct random earlier ones."""
    own = (Nk - 1) // block
    rows = [torch.cat([torch.tensor([own]), torch.randperm(own, generator=g)[:top_k - 1]]) for _ in range(Hq)]
    return Selection(torch.stack(rows)[None, :, None, :], block)


def timed(fn, repeats: int = 5):
    """``(median seconds, last result)`` of ``fn()`` over ``repeats`` calls."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def time_rounds(methods: dict, rounds: int, target_s: float = 0.01) -> dict:
    """``{name: [seconds per call, one per round]}``: a warm-up call (which sets each method's inner
    count), then ``rounds`` rounds running every method ``inner`` times (each round's start rotates)."""
    inner = {}
    for name, fn in methods.items():
        fn()
        t0 = time.perf_counter()
        fn()
        inner[name] = max(1, min(500, round(target_s / max(time.perf_counter() - t0, 1e-7))))
    names = list(methods)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, n = methods[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
    return times


# ------------------------------------------------------------------------------------ one size
def rotating(fn, sets: list):
    """``fn(q, k, v)`` on the next of ``sets`` at every call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(*sets[state["i"]])
    return call


def gpu_time(fn, dry: bool = False) -> float:
    """Median ms of ``fn`` captured in a CUDA graph (``do_bench_cudagraph``); a call that cannot be
    captured is timed with ``do_bench`` instead (host launch overhead included), and said so. A dry
    run: a warm perf_counter call."""
    import triton.testing
    if dry:
        return timing.bench(fn, dry=True)
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"not capturable ({type(e).__name__}: {str(e)[:120]}); timed with do_bench", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench(args, Nk: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    B, Hq, Hkv, D, bk = 1, args.heads, args.kv_heads, args.head_dim, args.block
    dev, gpu = torch.device(args.device), args.device == "cuda" or args.dry_run
    es = torch.finfo(dtype).bits // 8
    caches = max(1, min(8, int(args.cache_bytes // (2 * B * Hkv * Nk * D * es))))
    sets = [tuple(torch.randn(B, h, n, D, generator=g, device=dev, dtype=dtype) for h, n in
                  ((Hq, 1), (Hkv, Nk), (Hkv, Nk))) for _ in range(caches)]
    scale = D ** -0.5
    backend = "triton" if gpu else "cpu"

    layout_s, layout = timed(lambda: window_layout(Nk, bk, args.window))
    plan_s, wplan = timed(lambda: plan(window_layout(Nk, bk, args.window), causal="bottom_right"))
    plan_s -= layout_s
    kept = int(wplan.rows.full_ptr[-1, -1] + wplan.rows.part_ptr[-1, -1]) * bk    # keys of the kept blocks
    wplan = wplan.to(dev)
    wplan_h = wplan.for_heads(Hq, Hkv)
    selection = moba_selection(g if not gpu else torch.Generator().manual_seed(Nk), Hq, Nk, bk, args.top_k)
    delta = causal_offset("bottom_right", 1, Nk)
    sel_plan_s, splan = timed(lambda: SelectionPlan(selection, Nk, delta))
    splan = SelectionPlan(selection.to(dev), Nk, delta) if gpu else splan

    # MoBA with its selector (issue 38: "selection included"): the decode state of the cache's first
    # Nk - 1 keys (chunk means + the incomplete chunk's keys), one step appending the last key (it
    # completes a chunk when Nk is a multiple of the block: the costlier step, one in 64) and
    # selecting, then the attention on that selection (its plan built in the call)
    moba_sel = moba_selector(bk, args.top_k)
    state = moba_sel.init_state(sets[0][1][:, :, :Nk - 1])
    saved = (state.summaries, state.tail, state.length)

    def moba_step(q, k, v):
        state.summaries, state.tail, state.length = saved     # back to Nk - 1 keys (no copy)
        chosen = moba_sel.step(q, k[:, :, Nk - 1:], state)
        return selection_attention(q, k, v, chosen, causal="bottom_right", backend=backend, check=False)

    fold = lambda q: q.view(B, Hkv, Hq // Hkv, D)  # noqa: E731  (the GQA group's heads as query rows)
    methods = {
        "window": lambda q, k, v: block_sparse_attention(q, k, v, wplan, causal="bottom_right", backend=backend),
        "moba": lambda q, k, v: selection_attention(q, k, v, splan, causal="bottom_right", backend=backend),
        "moba_selected": moba_step,
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "sdpa_folded": lambda q, k, v: F.scaled_dot_product_attention(fold(q), k, v),
    }
    if gpu:
        torch._dynamo.reset()   # a fresh compile per size (the recompile limit would fall back to eager flex)
        flex = timing.flex(dry=args.dry_run)
        moba_layout = BlockSparseLayout.from_kv_indices(selection.indices.to(dev), bk, (1, Nk))
        moba_plan = plan(moba_layout, causal="bottom_right")
        masks = {"window": layout.to(dev).to_flex_block_mask(), "moba": moba_layout.to_flex_block_mask()}
        methods["moba_bs"] = lambda q, k, v: block_sparse_attention(q, k, v, moba_plan, causal="bottom_right",
                                                                    backend="triton")
        for name, bm in masks.items():
            # flex-decode takes masks shared by a GQA group's heads; per-head masks under GQA fall back to
            # the main flex kernel, whose tiles must divide the 64-key blocks
            for opts in (None, {"BLOCK_M": 64, "BLOCK_N": 64}):
                fn = (lambda bm_, o: lambda q, k, v: flex(q, k, v, block_mask=bm_, scale=scale, enable_gqa=True,
                                                          kernel_options=o))(bm, opts)
                try:
                    fn(*sets[0])
                except Exception as e:  # noqa: BLE001  (a compile failure: recorded, the next options tried)
                    print(f"flex {name} with kernel_options={opts} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[-1][:200] if str(e) else ''}", flush=True)
                    continue
                methods[f"flex_{name}"] = fn
                break
    if not args.no_before:
        if gpu:
            from sparse_io_attn.block_sparse.triton import launch as triton_launch
            methods["window_before"] = lambda q, k, v: triton_launch.forward(q, k, v, wplan_h, sm_scale=scale,
                                                                             decode=False)
        else:
            methods["window_before"] = lambda q, k, v: block_cpu.forward(q, k, v, wplan_h, sm_scale=scale,
                                                                         decode=False)
            methods["moba_before"] = lambda q, k, v: selection_cpu.forward(q, k, v, splan, sm_scale=scale,
                                                                           decode=False)
    # the sparse calls are finite, SDPA equals the folded fp32 dense result, the window call equals
    # dense attention restricted to the window (via the prefill kernel on the same plan)
    q, k, v = sets[0]
    dense = F.scaled_dot_product_attention(fold(q).float(), k.float(), v.float()).reshape(B, Hq, 1, D)
    for name in methods:
        out = methods[name](q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(out).all(), name
    assert (methods["sdpa"](q, k, v).float() - dense).abs().max() < (1e-4 if dtype == torch.float32 else 3e-2)
    if "flex_window" in methods:
        assert (methods["flex_window"](q, k, v).float() - methods["window"](q, k, v).float()).abs().max() < 3e-2

    calls = {name: rotating(fn, sets) for name, fn in methods.items()}
    if gpu:
        times = {name: [] for name in calls}
        for r in range(args.rounds):
            names = list(calls)
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(gpu_time(calls[name], args.dry_run) / 1e3)
    else:
        times = time_rounds(calls, args.rounds)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    row = {"Nk": Nk, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "caches": caches,
           **{f"{n}_ms": m for n, m in med.items()},
           "window_x_sdpa": med["sdpa"] / med["window"], "window_x_folded": med["sdpa_folded"] / med["window"],
           "moba_x_sdpa": med["sdpa"] / med["moba"], "moba_x_folded": med["sdpa_folded"] / med["moba"],
           "moba_selected_x_sdpa": med["sdpa"] / med["moba_selected"],
           "window_GBps": kept * Hkv * D * 2 * es / (med["window"] * 1e-3) / 1e9,
           "layout_ms": layout_s * 1e3, "plan_ms": plan_s * 1e3, "sel_plan_ms": sel_plan_s * 1e3,
           "kept_keys": kept}
    return row


COLUMNS = [("Nk", "Nk"), ("dtype", "dtype"), ("window_ms", "window ms"), ("moba_ms", "moba ms"),
           ("moba_selected_ms", "moba+selector ms"),
           ("sdpa_ms", "sdpa ms"), ("sdpa_folded_ms", "sdpa folded ms"), ("window_x_sdpa", "window x sdpa"),
           ("window_x_folded", "window x folded"), ("moba_x_sdpa", "moba x sdpa"), ("moba_x_folded", "moba x folded"),
           ("moba_selected_x_sdpa", "moba+selector x sdpa"),
           ("window_GBps", "window GB/s"), ("window_before_ms", "window before ms"),
           ("moba_before_ms", "moba before ms"), ("layout_ms", "layout ms"), ("plan_ms", "plan ms"),
           ("sel_plan_ms", "sel plan ms")]
GPU_COLUMNS = COLUMNS[:7] + [("flex_window_ms", "flex window ms"), ("moba_bs_ms", "moba bs ms"),
                             ("flex_moba_ms", "flex moba ms")] + COLUMNS[7:14] + COLUMNS[15:]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gpu = args.device == "cuda" or args.dry_run
    if not gpu:
        block_cpu.load()
    g = torch.Generator(device=args.device).manual_seed(0)
    load_start = round(os.getloadavg()[0], 2)
    header = machine_header(device=args.device)
    rows = []
    for Nk in (int(x) for x in args.seq_lens.split(",")):
        for name in args.dtypes.split(","):
            rows.append(bench(args, Nk, DTYPES[name], g))
            print(format_table(rows[-1:], GPU_COLUMNS if gpu else COLUMNS), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    header["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    header["load_avg_1min"] = load_start
    columns = GPU_COLUMNS if gpu else COLUMNS
    columns = columns if not args.no_before else [c for c in columns if "before" not in c[0]]
    table = format_table(rows, columns)
    setting = (f"B 1, Hq {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, Nq 1, "
               f"{'backend triton' if gpu else f'backend cpu, threads {args.threads}'}; "
               f"window {args.window} (blocks of {args.block}, bottom-right); MoBA-shaped: G = Hq, blocks of "
               f"{args.block}, top {args.top_k}; {args.rounds} rounds, medians"
               + (f"; times: {timing.GRAPH_LABEL} per call, median over rounds (calls that cannot be captured: "
                  f"do_bench, printed); sdpa: scaled_dot_product_attention's own backend choice; flex: "
                  f"torch.compile(flex_attention) at its defaults (flex-decode for one query token)" if gpu else "")
               + (" (DRY RUN on a CPU: interpreter, eager Flex, perf_counter)" if args.dry_run else ""))
    text = (f"{format_header(header)}\n# load average at the end {header['load_avg_1min_end']}\n# {setting}\n\n"
            f"```\n{table}\n```\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"header": header, "setting": setting, "rows": rows},
                                                        indent=1))
    md = args.out.with_suffix(".md")
    notes = md.read_text().split("<!-- notes -->", 1)[1] if md.exists() and "<!-- notes -->" in md.read_text() else ""
    md.write_text(f"# Decoding: one token against a long KV cache (`benchmarks/bench_decode_kernels.py`)\n\n{text}\n<!-- notes -->{notes}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
