"""GPU benchmark of per-token selections and per-step metadata (issue 33, item 3; issue 47, item 6).

Part ``selection``: ``selection_attention(..., backend="triton")`` on MoBA-, NSA- and DSA-shaped
selections (the shapes of ``benchmarks/bench_selection.py``: MoBA one selection per query head, key
blocks of 64, top 8 with the own block; NSA one per GQA group, blocks of 64, 16 with block 0, own and
previous; DSA one shared by all heads, single tokens, top 2048), causal, bf16, at every ``--n``
(8192 .. 32768), each Triton kernel family of ``--families`` timed (``auto``: the dispatch's choice,
key-major for MoBA/NSA and element-masked for DSA; ``query``: the query-major kernels before issue 47,
kept as candidates until this run shows which wins), against

* ``torch.compile(flex_attention)`` with an index ``mask_mod`` (a boolean table of the same
  selection: ``[G, N, key blocks]``, or ``[N, N]`` for DSA) and the ``BlockMask`` that
  ``create_block_mask`` builds from it (128 x 128 blocks, FlexAttention's defaults);
* dense causal SDPA under each backend of ``--sdpa-backends`` (``torch.nn.attention.sdpa_kernel``;
  GQA through ``enable_gqa``, or K/V repeated to the query heads where the backend refuses it: the
  row says which).

Each row also has the plan's wall time (the selection's normalised rows and what the family derives
from them on the device: ``launch.prepare``), the exact traffic model's bytes per kept pair of each
family and the achieved bandwidth, and the speed targets of issue 47 (MoBA/NSA >= 1.2x Flex and faster
than flash SDPA at N >= 16384; DSA >= 1.0x Flex; the plan <= 10% of the forward+backward).

Part ``metadata``: per-step block selection at N = 8192 .. 32768 (B*H = 16, blocks of 128, k key
blocks per query block): ``pooled_topk`` scoring + ``patterns.topk`` layout + ``plan`` on the device,
against ``BlockMask.from_kv_blocks`` and ``create_block_mask`` for the same selection, next to the
attention time (forward+backward, ``backend="triton"``).

DSA-shaped rows at N above ``--dsa-max-n`` are skipped (its Flex table is ``[N, N]`` booleans).

Times: ``triton.testing.do_bench`` with ``return_mode="median"`` (ms; the header line says so:
``_gpu_timing``). Every row is appended to ``--jsonl`` when measured.

    python benchmarks/bench_gpu_selection.py --jsonl out.jsonl
    python benchmarks/bench_gpu_selection.py --parts selection --n 8192 16384 32768 --jsonl out.jsonl
    python benchmarks/bench_gpu_selection.py --plans-only --n 8192 16384 32768   # any device: plans, families, bytes
    python benchmarks/bench_gpu_selection.py --dry-run        # tiny, on a CPU: interpreter, eager Flex forward
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_timing as timing  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["selection", "metadata"], choices=["selection", "metadata"])
    p.add_argument("--n", type=int, nargs="+", default=[8192], help="N of the selection part (one or several)")
    p.add_argument("--families", nargs="+", default=["auto", "query"], choices=["auto", "query", "key", "masked"],
                   help="Triton selection kernel families timed (default: auto and the query-major candidate)")
    p.add_argument("--sdpa-backends", nargs="+", default=["flash", "cudnn", "efficient"],
                   choices=sorted(SDPA_BACKENDS), help="dense causal SDPA backends timed")
    p.add_argument("--plans-only", action="store_true",
                   help="build every shape's selection and plan at the sizes asked (any device, CPU included), "
                        "print the families, their predicted bytes and the timings a GPU run takes; launch no kernel")
    p.add_argument("--dsa-max-n", type=int, default=32768, help="largest N of the DSA-shaped rows")
    p.add_argument("--meta-n", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["moba", "nsa", "dsa"])
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--jsonl", type=Path, default=None)
    p.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true",
                   help="tiny shapes on the CPU (interpreter, eager Flex forward only, perf_counter times)")
    return p.parse_args(argv)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _wall_ms(fn, device, reps=5):
    """Median wall time (host + device, synchronised) of a metadata builder (one call on a CPU)."""
    reps = 1 if device == "cpu" else reps
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _fwd(attn, *args):
    def run():
        with torch.no_grad():
            attn(*args)
    return run


def _fwd_bwd(attn, q, k, v, do, dry=False):
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        for t in (qq, kk, vv):
            t.grad = None
        out = attn(qq, kk, vv)
        if not (dry and out.grad_fn is None):   # a dry run's eager Flex: forward only (no CPU backward)
            out.backward(do)
    return run


def _emit(args, row):
    print(json.dumps(row), flush=True)
    if args.jsonl is not None:
        with args.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def _sdpa_rows(args, q, k, v, do, bench) -> dict:
    """Dense causal SDPA forward and forward+backward per backend: GQA through ``enable_gqa``, else (the
    backend refuses it) K/V repeated to the query heads; a backend that does not run records its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row = {}
    rep = q.shape[1] // k.shape[1]
    for name in args.sdpa_backends:
        backend = getattr(SDPBackend, SDPA_BACKENDS[name])
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))

            def sdpa(q_, k_, v_, gqa=gqa):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=gqa and rep > 1)
            try:
                row[f"sdpa_{name}_fwd_ms"] = bench(_fwd(sdpa, q, kk, vv))
                row[f"sdpa_{name}_fwdbwd_ms"] = bench(_fwd_bwd(sdpa, q, kk, vv, do))
                row[f"sdpa_{name}_gqa"] = gqa
                break
            except RuntimeError as exc:
                row[f"sdpa_{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _flex(dry):
    from torch.nn.attention.flex_attention import create_block_mask
    return timing.flex(dry=dry), create_block_mask


def _shape_selection(g, shape: str, N: int, Hq: int, Hkv: int):
    """``(indices, block, top_k, G)`` of a shape (``bench_selection``'s builders)."""
    from bench_selection import dsa_indices, moba_indices, nsa_indices

    if shape == "dsa":
        top_k = min(2048, N // 2)
        return dsa_indices(g, N, top_k, local=min(256, top_k // 2)), 1, top_k, 1
    block, top_k = 64, (8 if shape == "moba" else 16)
    G = Hq if shape == "moba" else Hkv
    return (moba_indices if shape == "moba" else nsa_indices)(g, G, N, block, top_k), block, top_k, G


TARGETS = {"moba": 1.2, "nsa": 1.2, "dsa": 1.0}   # x Flex forward+backward, issue 47


def _targets(row: dict) -> str:
    notes = []
    if "speedup_vs_flex_fwdbwd" in row:
        want = TARGETS[row["shape"]]
        notes.append(f">= {want:g}x Flex {'met' if row['speedup_vs_flex_fwdbwd'] >= want else 'NOT met'}")
    if row["shape"] != "dsa" and row["N"] >= 16384 and "sdpa_flash_fwdbwd_ms" in row:
        ok = row["ours_fwdbwd_ms"] < row["sdpa_flash_fwdbwd_ms"]
        notes.append(f"faster than flash SDPA {'met' if ok else 'NOT met'}")
    if "ours_fwdbwd_ms" in row:
        ok = row["plan_ms"] <= 0.1 * row["ours_fwdbwd_ms"]
        notes.append(f"plan <= 10% {'met' if ok else 'NOT met'} ({100 * row['plan_ms'] / row['ours_fwdbwd_ms']:.0f}%)")
    return "; ".join(notes)


def part_selection(args, device, dtype, bench):
    from sparse_io_attn.layout.selection import Selection
    from sparse_io_attn.selection import traffic
    from sparse_io_attn.selection.api import selection_attention
    from sparse_io_attn.selection.plan import SelectionPlan
    from sparse_io_attn.selection.tiles import FAMILY_ENV
    from sparse_io_attn.selection.triton import launch

    Hq, Hkv, D, dry = args.heads, args.kv_heads, args.d, args.dry_run
    flex = None if args.no_flex or args.plans_only else _flex(dry)
    for N in args.n:
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, h, N, D, device=device, dtype=dtype) for h in (Hq, Hkv, Hkv, Hq))
        for shape in args.shapes:
            if shape == "dsa" and N > args.dsa_max_n:
                continue
            idx, block, top_k, G = _shape_selection(g, shape, N, Hq, Hkv)
            idx = idx.to(device)
            sel = Selection(idx, block)
            plan = SelectionPlan(sel, N, 0)
            pairs = traffic.selection_pairs(plan, 1, Hq)
            row = {"part": "selection", "shape": shape, "N": N, "Hq": Hq, "Hkv": Hkv, "G": G, "D": D, "block": block,
                   "K": top_k, "pairs_M": pairs / 1e6}
            for fam in args.families:
                chosen = launch.family(q, k, plan, fam)
                row[f"{fam}_family"] = chosen
                row[f"{fam}_bytes_per_pair"] = traffic.selection(plan, 1, Hq, Hkv, D, dtype,
                                                                 family_name=chosen).total_bytes / pairs
            row["plan_ms"] = _wall_ms(lambda: launch.prepare(q, k, SelectionPlan(sel, N, 0)), device,
                                      reps=1 if args.plans_only else 5)
            if args.plans_only:
                row["would_time"] = ([f"{f}_fwd_ms, {f}_fwdbwd_ms" for f in args.families]
                                     + [f"sdpa_{b}" for b in args.sdpa_backends] + ([] if args.no_flex else ["flex"]))
                _emit(args, row)
                continue
            launch.prepare(q, k, plan)
            ours = lambda q_, k_, v_: selection_attention(q_, k_, v_, plan, causal=True, backend="triton")  # noqa: E731
            for fam in args.families:
                os.environ[FAMILY_ENV] = fam
                try:
                    row[f"{fam}_fwd_ms"] = bench(_fwd(ours, q, k, v))
                    row[f"{fam}_fwdbwd_ms"] = bench(_fwd_bwd(ours, q, k, v, do))
                    row[f"{fam}_GBps"] = row[f"{fam}_bytes_per_pair"] * pairs / row[f"{fam}_fwdbwd_ms"] / 1e6
                except Exception as exc:  # record and go on: one GPU call runs every family
                    row[f"{fam}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                finally:
                    os.environ.pop(FAMILY_ENV, None)
            first = args.families[0]
            if f"{first}_fwdbwd_ms" in row:
                row["ours_fwd_ms"], row["ours_fwdbwd_ms"] = row[f"{first}_fwd_ms"], row[f"{first}_fwdbwd_ms"]
            row.update(_sdpa_rows(args, q, k, v, do, bench))
            if flex is not None:
                fa, create = flex
                nkb = math.ceil(N / block)
                table = torch.zeros(G, N, nkb + 1, dtype=torch.bool, device=device)
                table.scatter_(-1, torch.where(idx >= 0, idx, nkb).long(), True)
                table = table[..., :nkb].contiguous()
                per = Hq // G

                def mask_mod(b, h, q_idx, kv_idx):
                    return table[h // per, q_idx, kv_idx // block] & (kv_idx <= q_idx)
                build = lambda: create(mask_mod, 1, Hq, N, N, device=device, _compile=not dry)  # noqa: E731
                row["flex_create_block_mask_ms"] = _wall_ms(build, device, reps=3)
                bm = build()
                row["flex_sparsity_pct"] = float(bm.sparsity()) if hasattr(bm, "sparsity") else None
                fx = lambda q_, k_, v_: fa(q_, k_, v_, block_mask=bm, enable_gqa=Hq != Hkv)  # noqa: E731
                row["flex_fwd_ms"] = bench(_fwd(fx, q, k, v))
                row["flex_fwdbwd_ms"] = bench(_fwd_bwd(fx, q, k, v, do, dry))
                if "ours_fwdbwd_ms" in row:
                    row["speedup_vs_flex_fwd"] = row["flex_fwd_ms"] / row["ours_fwd_ms"]
                    row["speedup_vs_flex_fwdbwd"] = row["flex_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
            if "ours_fwdbwd_ms" in row and "sdpa_flash_fwdbwd_ms" in row:
                row["speedup_vs_sdpa_flash_fwdbwd"] = row["sdpa_flash_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
            row["targets"] = _targets(row)
            _emit(args, row)


def part_metadata(args, device, dtype, bench):
    from dynamic_metadata import kv_lists

    from sparse_io_attn import block_sparse_attention, patterns
    from sparse_io_attn.block_sparse.plan import plan as make_plan
    from sparse_io_attn.nn.selectors import pooled_topk

    block, H, D = 128, args.heads, args.d
    flex = None if args.no_flex else _flex(args.dry_run)
    for N in args.meta_n:
        kb = min(8, math.ceil(N / block))
        q, k, v, do = (torch.randn(1, H, N, D, device=device, dtype=dtype) for _ in range(4))
        selector = pooled_topk(block, kb)

        def metadata():
            layout = selector(q, k)
            return layout, make_plan(layout, causal=True, num_heads_q=H, num_heads_kv=H)
        layout, _ = metadata()
        row = {"part": "metadata", "N": N, "BH": H, "block": block, "k": kb, "D": D,
               "ours_selection_layout_plan_ms": _wall_ms(metadata, device),
               "ours_selection_only_ms": _wall_ms(lambda: selector(q, k), device)}
        attn = lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, layout, causal=True, backend="triton")  # noqa: E731
        row["attn_fwdbwd_ms"] = bench(_fwd_bwd(attn, q, k, v, do))
        row["metadata_pct_of_attn"] = 100 * row["ours_selection_layout_plan_ms"] / row["attn_fwdbwd_ms"]
        if flex is not None:
            from torch.nn.attention.flex_attention import BlockMask
            _, create = flex
            idx = kv_lists(layout.to("cpu"), kb).to(device)
            Mk = math.ceil(N / block)

            def causal(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            def from_kv():
                num = (idx >= 0).sum(-1, dtype=torch.int32)
                kv = idx.new_zeros(*idx.shape[:-1], Mk)
                kv[..., :idx.shape[-1]] = idx.clamp(min=0)
                return BlockMask.from_kv_blocks(num, kv, BLOCK_SIZE=block, mask_mod=causal, seq_lengths=(N, N))
            row["flex_from_kv_blocks_ms"] = _wall_ms(from_kv, device)
            table = torch.zeros(*idx.shape[:-1], Mk + 1, dtype=torch.bool, device=device)
            table.scatter_(-1, torch.where(idx >= 0, idx, Mk).long(), True)
            table = table[..., :Mk].contiguous()

            def mask_mod(b, h, q_idx, kv_idx):
                return table[0, h % table.shape[1], q_idx // block, kv_idx // block] & (q_idx >= kv_idx)
            row["flex_create_block_mask_ms"] = _wall_ms(lambda: create(mask_mod, 1, H, N, N, device=device,
                                                                        BLOCK_SIZE=block, _compile=not args.dry_run),
                                                     device, reps=3)
        _emit(args, row)


def main(argv=None):
    args = parse_args(argv)
    import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter or compiled, before triton loads)
    dry = args.dry_run
    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    if dry:
        args.n, args.meta_n, args.heads, args.kv_heads, args.d, args.dsa_max_n = [16], [128], 2, 1, 16, 16
        args.sdpa_backends = ["math"]
    elif args.plans_only:
        args.parts = [p for p in args.parts if p == "selection"]
    elif device == "cpu":
        sys.exit("no CUDA device: use --plans-only (plans, families, bytes) or --dry-run (a tiny interpreter run)")
    dtype = torch.float32 if dry else torch.bfloat16   # (plans only: the GPU's dtype)

    def bench(fn):
        return timing.bench(fn, dry=dry)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu" + (" (dry run)" if dry else ""),
                      "torch": torch.__version__, "dtype": str(dtype), "timing": timing.label("median", dry),
                      "flex": "torch.compile(flex_attention) at its defaults" + (" (dry run: eager, forward only)"
                                                                                  if dry else ""),
                      "sdpa": "torch.nn.attention.sdpa_kernel per backend: " + ", ".join(args.sdpa_backends)}),
          flush=True)
    for part in args.parts:
        try:
            (part_selection if part == "selection" else part_metadata)(args, device, dtype, bench)
        except Exception as exc:  # record and go on: one GPU call runs every part
            _emit(args, {"part": part, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            import traceback
            traceback.print_exc()


if __name__ == "__main__":
    main()
