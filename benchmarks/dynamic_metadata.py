"""Metadata time against attention time for data-dependent (per-step) block selections, backend
"cpu", next to FlexAttention building the same selection.

A model that chooses its layout from the activations pays, at every step, for the selection and the
kernels' schedule on top of the attention itself. For each grid point (N tokens, B*H heads, k key
blocks kept per query block; head dim 64, blocks of 64, float32, causal top-left, Hkv = H) one
process runs interleaved rounds (every method once per round, the starting method rotating) after
one warm-up round, with 2 torch threads:

* ``selection``: ``pooled_topk(64, k)(q, k)``, i.e. :meth:`PooledTopKSelector.scores` (mean-pooled q times
  mean-pooled k, ``[B, H, Mq, Mk]``) and :func:`~sparse_io_attn.layout.patterns.topk`, which builds
  the layout with :meth:`BlockSparseLayout.from_kv_indices`;
* ``schedule``: :meth:`sparse_io_attn.AttentionPlan.build` ``(layout, causal=True)`` on a layout
  that was never scheduled (built untimed before each timing, so its cache is empty). The CSR list
  (forward, dQ) and the CSC list (dK/dV) are built together: the backward reuses this object, so
  one build per step is the whole schedule cost;
* ``from_kv_indices``: :meth:`BlockSparseLayout.from_kv_indices` alone on the selection's indices
  (the part of ``selection`` that FlexAttention's constructors replace);
* ``fwd`` / ``fwd+bwd``: ``block_sparse_attention(q, k, v, layout, causal=True, backend="cpu")``,
  forward, and forward with ``out.backward(do)``, on a layout whose schedule was built by an untimed
  call first (so these are attention times only);
* ``flex_kv``: ``BlockMask.from_kv_blocks`` with ``kv_num_blocks`` / ``kv_indices`` (padded to
  ``Mk`` columns, FlexAttention's convention) from the selection's indices and a causal
  ``mask_mod``, every selected block a partial block (``compute_q_blocks=True``: the transposed
  lists its backward reads, the counterpart of our CSC list);
* ``flex_create``: ``create_block_mask`` (``_compile=False``) with a ``mask_mod`` looking the block
  up in a ``[B, H, Mq, Mk]`` boolean table scattered from the same indices (timed with the table),
  and causal. It evaluates ``mask_mod`` on all ``B*H*N*N`` elements, so it runs only where that
  is at most ``--flex-create-max`` elements.

* ``selection_1t`` / ``schedule_1t`` (and ``from_kv_indices_1t``, ``flex_kv_1t``): the same with
  one torch thread (a diagnostic: on a host busier than its cores, every small operation that opens
  a two-thread parallel region waits for the second thread to be scheduled, which can dominate the
  metadata time).

Metadata = selection + schedule (two threads). The target: metadata <= 5% of forward+backward
attention time at N >= 8192 (the ``target`` column says, per row, whether it is met; ``target_1t``
says the same for the one-thread metadata against the same two-thread attention). The Flex columns
compare the construction from given indices: ours = ``from_kv_indices`` + ``schedule`` against
``flex_kv`` and ``flex_create`` (the scoring and ranking before it would be the same for both),
with two threads and with one.

Correctness guard (not timed): at every point where a FlexAttention mask is built, the layout's block
mask (:meth:`~BlockSparseLayout.to_block_mask`) must equal each BlockMask's ``to_dense()``.

Rounds: ``--repeats`` (median) where the first, untimed forward took less than ``--slow-s``
seconds, one round above (the ``rounds`` column); the cheap methods (selection, schedule,
``from_kv_indices``, ``flex_kv``) run ``--meta-calls`` times per round, and the table reports the
median of those calls (the CSV also has each method's minimum).

    python benchmarks/dynamic_metadata.py                     # writes benchmarks/results/dynamic_metadata.{md,csv}
    python benchmarks/dynamic_metadata.py --grid 4096:1:8:8 --repeats 3 --out /tmp/dm
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch

from sparse_io_attn import block_sparse_attention
from sparse_io_attn.block_sparse import cpu as cpu_backend
from sparse_io_attn.block_sparse.plan import AttentionPlan
from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_csv
from sparse_io_attn.layout import BlockSparseLayout
from sparse_io_attn.nn.selectors import pooled_topk

from _cpu_timing import fwd_bwd  # noqa: E402  (benchmarks/ on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK, HEAD_DIM = 64, 64
TARGET_PCT, TARGET_MIN_N = 5.0, 8192
# (N, B, H, k): B*H in {8, 32} as B=1, H=8 and B=2, H=16. Pruned to keep the run near 15 minutes
# on a shared 2-core machine: N = 32768 only with B*H = 8 (pass --grid to add 32768:2:16:8,32768:2:16:32)
GRID = tuple((N, B, H, k) for N in (4096, 8192, 16384, 32768) for B, H in ((1, 8), (2, 16)) for k in (8, 32)
             if k <= N // BLOCK and not (N == 32768 and B * H == 32))


def parse_point(text: str) -> tuple[int, int, int, int]:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a grid point is N:B:H:k with positive ints, got {text!r}")
    N, B, H, k = (int(p) for p in parts)
    if k > math.ceil(N / BLOCK):
        raise argparse.ArgumentTypeError(f"k={k} exceeds the {math.ceil(N / BLOCK)} key blocks of N={N}")
    return N, B, H, k


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", type=lambda s: [parse_point(x) for x in s.split(",")], default=list(GRID),
                   help="comma-separated N:B:H:k points (default: the full grid)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds where the forward is fast (median)")
    p.add_argument("--meta-calls", type=int, default=3,
                   help="calls per round of the metadata methods (cheap; more samples for the median)")
    p.add_argument("--slow-s", type=float, default=2.5,
                   help="one timed round where the first (untimed) forward took longer (seconds)")
    p.add_argument("--flex-create-max", type=float, default=2 ** 27,
                   help="run create_block_mask only where B*H*N*N is at most this (0: never)")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention constructors")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "dynamic_metadata",
                   help="output stem (.md/.csv); 'none' writes nothing")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- the selection's indices
def kv_lists(layout: BlockSparseLayout, k: int) -> torch.Tensor:
    """The layout's kept key blocks per query-block row, ``int32 [lb, lh, Mq, k]`` (sorted, ``-1``
    in empty slots after the used ones): the selection's indices in FlexAttention's row order."""
    crow = layout.crow_indices.to(torch.int64)                             # [L, Mq + 1], absolute
    start, count = crow[:, :-1], crow[:, 1:] - crow[:, :-1]                 # [L, Mq]
    slot = torch.arange(k)
    used = slot < count[..., None]
    col = layout.col_slots.to(torch.int64)
    idx = torch.where(used, col[torch.where(used, start[..., None] + slot, 0)], -1)
    return idx.to(torch.int32).view(layout.layout_batch, layout.layout_heads, layout.num_q_blocks, k)


def flex_from_kv_blocks(idx: torch.Tensor, N: int):
    """``BlockMask.from_kv_blocks`` of the indices (every block partial, causal ``mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask

    Mk = math.ceil(N / BLOCK)
    num = (idx >= 0).sum(-1, dtype=torch.int32)
    kv = idx.new_zeros(*idx.shape[:-1], Mk)
    kv[..., :idx.shape[-1]] = idx.clamp(min=0)
    return BlockMask.from_kv_blocks(num, kv, BLOCK_SIZE=BLOCK, mask_mod=_causal, seq_lengths=(N, N))


def flex_create_block_mask(idx: torch.Tensor, N: int):
    """``create_block_mask`` with a ``mask_mod`` reading a block table scattered from the indices."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, Mq, _ = idx.shape
    Mk = math.ceil(N / BLOCK)
    table = torch.zeros(B, H, Mq, Mk + 1, dtype=torch.bool)
    table.scatter_(-1, torch.where(idx >= 0, idx, Mk).to(torch.int64), True)
    table = table[..., :Mk]

    def mask_mod(b, h, q_idx, kv_idx):
        return table[b, h, q_idx // BLOCK, kv_idx // BLOCK] & (q_idx >= kv_idx)
    return create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=BLOCK, _compile=False)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def target_note(N: int, pct_of_fwdbwd: float) -> str:
    """Whether metadata <= 5% of forward+backward ("-" below N = 8192, where no target is set)."""
    if N < TARGET_MIN_N:
        return "-"
    return "met" if pct_of_fwdbwd <= TARGET_PCT else "NOT met"


# ------------------------------------------------------------------------------- timing
def timed(fn):
    """A method timing all of ``fn()``."""
    def run():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def one_thread(run):
    """``run`` with one torch thread (the caller's thread count restored after)."""
    def wrapped():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)
    return wrapped


def time_rounds(methods: dict, repeats: int) -> dict:
    """``{name: [seconds per call]}`` for ``methods = {name: (run, calls_per_round)}``, where ``run()``
    returns its own elapsed seconds (so it can do untimed set-up): one warm-up call of each, then
    ``repeats`` rounds calling every method ``calls_per_round`` times, the first method of a round
    rotating."""
    for run, _ in methods.values():
        run()
    names = list(methods)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, calls = methods[name]
            times[name] += [run() for _ in range(calls)]
    return times


def bench_point(N: int, B: int, H: int, k: int, *, repeats: int, meta_calls: int, slow_s: float, flex: bool,
                flex_create_max: float) -> dict:
    start = time.perf_counter()
    torch.manual_seed(N + 31 * B * H + k)
    q, kk, v, do = (torch.randn(B, H, N, HEAD_DIM) for _ in range(4))
    selector = pooled_topk(BLOCK, k)
    layout = selector(q, kk)
    idx = kv_lists(layout, k)
    ours = lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, layout, causal=True, backend="cpu")  # noqa: E731
    fb = fwd_bwd(ours, q, kk, v, do)
    t0 = time.perf_counter()
    ours(q, kk, v)                         # builds the layout's schedule, untimed
    rounds = repeats if time.perf_counter() - t0 < slow_s else 1

    def schedule_fresh():
        fresh = selector(q, kk)            # a new layout object: empty schedule cache
        t0 = time.perf_counter()
        AttentionPlan.build(fresh, True)
        return time.perf_counter() - t0

    m = meta_calls
    methods = {"selection": (timed(lambda: selector(q, kk)), m), "schedule": (schedule_fresh, m),
               "selection_1t": (one_thread(timed(lambda: selector(q, kk))), m),
               "schedule_1t": (one_thread(schedule_fresh), m),
               "from_kv_indices": (timed(lambda: BlockSparseLayout.from_kv_indices(idx, BLOCK, N, check=False)), m),
               "fwd": (timed(lambda: ours(q, kk, v)), 1), "fwdbwd": (timed(fb), 1)}
    create = flex and B * H * N * N <= flex_create_max
    methods["from_kv_indices_1t"] = (one_thread(methods["from_kv_indices"][0]), m)
    if flex:
        methods["flex_kv"] = (timed(lambda: flex_from_kv_blocks(idx, N)), m)
        methods["flex_kv_1t"] = (one_thread(methods["flex_kv"][0]), m)
    if create:
        methods["flex_create"] = (timed(lambda: flex_create_block_mask(idx, N)), 1)
    # correctness guard (untimed): both FlexAttention masks select exactly the layout's blocks
    if flex:
        ref = layout.to_block_mask()
        builders = [flex_from_kv_blocks] + ([flex_create_block_mask] if create else [])
        for build in builders:
            got = build(idx, N).to_dense().bool()
            assert torch.equal(got, ref), f"{build.__name__} selects other blocks than the layout at N={N}"
    times = time_rounds(methods, rounds)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    mins = {f"min_{name}_ms": min(t) * 1e3 for name, t in times.items()}
    meta = ms["selection"] + ms["schedule"]
    row = {"N": N, "B": B, "H": H, "BH": B * H, "k": k, "kept_blocks": int(layout.nnz_blocks),
           "selection_ms": ms["selection"], "schedule_ms": ms["schedule"], "metadata_ms": meta,
           "fwd_ms": ms["fwd"], "fwdbwd_ms": ms["fwdbwd"],
           "meta_pct_fwd": 100 * meta / ms["fwd"], "meta_pct_fwdbwd": 100 * meta / ms["fwdbwd"]}
    row["target"] = target_note(N, row["meta_pct_fwdbwd"])
    meta_1t = ms["selection_1t"] + ms["schedule_1t"]
    row.update(selection_1t_ms=ms["selection_1t"], schedule_1t_ms=ms["schedule_1t"], metadata_1t_ms=meta_1t,
               meta_1t_pct_fwdbwd=100 * meta_1t / ms["fwdbwd"])
    row["target_1t"] = target_note(N, row["meta_1t_pct_fwdbwd"])
    row["ours_kv_sched_ms"] = ms["from_kv_indices"] + ms["schedule"]
    row["flex_kv_ms"] = ms.get("flex_kv")
    row["ours_kv_sched_1t_ms"] = ms["from_kv_indices_1t"] + ms["schedule_1t"]
    row["flex_kv_1t_ms"] = ms.get("flex_kv_1t")
    row["flex_create_ms"] = ms.get("flex_create")
    row["flex_checked"] = flex
    row["rounds"] = rounds
    row["meta_samples"] = rounds * meta_calls
    row.update(mins)
    row["point_s"] = time.perf_counter() - start
    return row


def bench(points, *, repeats: int = 3, meta_calls: int = 3, slow_s: float = 2.5, flex: bool = True,
          flex_create_max: float = 2 ** 27, threads: int = 2, log=print) -> tuple[dict, list]:
    """Run the grid ``points`` (``(N, B, H, k)`` tuples) with ``threads`` torch threads (the caller's
    count restored after): ``(header, rows)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _bench(points, repeats=repeats, meta_calls=meta_calls, slow_s=slow_s, flex=flex,
                      flex_create_max=flex_create_max, threads=threads, log=log)
    finally:
        torch.set_num_threads(before)


def _bench(points, *, repeats, meta_calls, slow_s, flex, flex_create_max, threads, log) -> tuple[dict, list]:
    cpu_backend.load()   # build (or load) the kernel before anything is timed
    header = machine_header(torch.float32, "cpu")
    header.update(grid=" ".join(f"{N}:{B}:{H}:{k}" for N, B, H, k in points),
                  nproc=len(os.sched_getaffinity(0)), threads=threads,
                  shape=f"D={HEAD_DIM} block={BLOCK} fp32 causal Hkv=H",
                  load_avg_at_start=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                  repeats=f"one warm-up round, then the median of {repeats} rounds (1 round where the first "
                          f"forward took >= {slow_s:g} s); selection, schedule, from_kv_indices and "
                          f"from_kv_blocks (each with 2 threads and with 1) {meta_calls} calls per round")
    rows = []
    for N, B, H, k in points:
        row = bench_point(N, B, H, k, repeats=repeats, meta_calls=meta_calls, slow_s=slow_s, flex=flex,
                          flex_create_max=flex_create_max)
        rows.append(row)
        log(format_table([row], COLUMNS))
    header["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return header, rows


COLUMNS = [("N", "N"), ("BH", "B*H"), ("k", "k"), ("selection_ms", "selection ms"), ("schedule_ms", "schedule ms"),
           ("metadata_ms", "metadata ms"), ("fwd_ms", "fwd ms"), ("fwdbwd_ms", "fwd+bwd ms"),
           ("meta_pct_fwd", "meta % fwd"), ("meta_pct_fwdbwd", "meta % f+b"), ("target", "<=5% f+b (N>=8192)"),
           ("metadata_1t_ms", "metadata ms 1 thread"), ("meta_1t_pct_fwdbwd", "meta 1t % f+b"),
           ("target_1t", "<=5% (1t meta)"),
           ("ours_kv_sched_ms", "ours from_kv_indices+schedule ms"), ("flex_kv_ms", "Flex from_kv_blocks ms"),
           ("ours_kv_sched_1t_ms", "ours 1 thread ms"), ("flex_kv_1t_ms", "Flex from_kv_blocks 1 thread ms"),
           ("flex_create_ms", "Flex create_block_mask ms"), ("rounds", "rounds")]


def write_outputs(stem: Path, header: dict, rows: list) -> None:
    met = [r for r in rows if r["target"] != "-"]
    md = ["# Metadata vs attention time for per-step (data-dependent) block selections, backend \"cpu\"", "",
          "```", format_header(header),
          f"# nproc {header['nproc']}, torch threads {header['threads']}, {header['shape']}",
          f"# load average (1, 5, 15 min) at start {header['load_avg_at_start']}, at end {header['load_avg_at_end']}"
          " (shared machine: other jobs ran at the same time)",
          f"# rounds: {header['repeats']}",
          f"# grid (N:B:H:k): {header['grid']}",
          "```", "", format_table(rows, COLUMNS), "",
          f"Target (metadata <= {TARGET_PCT:g}% of forward+backward at N >= {TARGET_MIN_N}): "
          f"{sum(r['target'] == 'met' for r in met)} of {len(met)} rows met with the two-thread metadata, "
          f"{sum(r['target_1t'] == 'met' for r in met)} of {len(met)} with the one-thread metadata.", "",
          "Columns: metadata = selection (pooled block scores, `nn.selectors.pooled_topk`, + `patterns.topk`, which builds the layout "
          "with `from_kv_indices`) + schedule (`schedule(layout, 0)` on a fresh layout: CSR and CSC "
          "lists, built once per step and shared by forward and backward). fwd / fwd+bwd: "
          "`block_sparse_attention(..., causal=True, backend=\"cpu\")` with the schedule already built. "
          "The last five timing columns compare building from the selection's indices: ours "
          "(`from_kv_indices` + `schedule`) against FlexAttention's `BlockMask.from_kv_blocks` "
          "(with its transposed lists) and `create_block_mask(_compile=False)` with a block-table "
          "`mask_mod` (run only where B*H*N*N is small; `-` elsewhere); \"1 thread\": the same two "
          "constructions (ours: `from_kv_indices` + `schedule`) with one torch thread. Both FlexAttention masks were "
          "checked to select exactly the layout's blocks (`to_dense()` equals `layout.to_block_mask()`). "
          "\"metadata ms 1 thread\": selection + schedule timed with `torch.set_num_threads(1)` in the same "
          "rounds, against the same two-thread attention (a diagnostic of the load: see the notes).",
          "", "Two threads against one: the one-thread metadata runs the same operations in the same "
          "rounds. Where it is much faster, the two-thread time is mostly waiting: the selection and the "
          "schedule are many small tensor operations, and each that opens a two-thread parallel region "
          "waits until the second thread gets a core, which on a host with a load average above its core "
          "count (see the header) can take a scheduler time slice per operation. The grid leaves out N = 32768 with "
          "B*H = 32 to keep the run near 15 minutes (add it with `--grid`).",
          "", "Written by `python benchmarks/dynamic_metadata.py` (default grid).", ""]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(md))
    write_csv(stem.with_suffix(".csv"), rows, header)


def main(argv=None) -> int:
    args = parse_args(argv)
    header, rows = bench(args.grid, repeats=args.repeats, meta_calls=args.meta_calls, slow_s=args.slow_s,
                         flex=not args.no_flex, flex_create_max=args.flex_create_max, threads=args.threads,
                         log=lambda s: print(s, flush=True))
    print(format_header(header))
    print(format_table(rows, COLUMNS))
    if str(args.out) != "none":
        write_outputs(args.out, header, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
