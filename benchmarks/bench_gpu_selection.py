"""GPU benchmark of per-token selections and per-step metadata (issue 33, item 3).

Part ``selection``: ``selection_attention(..., backend="triton")`` on MoBA-, NSA- and DSA-shaped
selections (the shapes of ``benchmarks/bench_selection.py``: MoBA one selection per query head, key
blocks of 64, top 8 with the own block; NSA one per GQA group, blocks of 64, 16 with block 0, own and
previous; DSA one shared by all heads, single tokens, top 2048), causal, bf16, against

* ``torch.compile(flex_attention)`` with an index ``mask_mod`` (a boolean table of the same
  selection: ``[G, N, key blocks]``, or ``[N, N]`` for DSA) and the ``BlockMask`` that
  ``create_block_mask`` builds from it (128 x 128 blocks, FlexAttention's default);
* dense causal SDPA (``is_causal=True``, GQA through ``enable_gqa``), once per backend named
  (``sdpa_flash_*``, ``sdpa_cudnn_*``; a backend that cannot run records ``sdpa_<name>_error``).

``--n`` takes several lengths (issue 47: N 8192-32768), each length's rows in the order MoBA, NSA, DSA;
DSA-shaped rows at N above ``--dsa-max-n`` are skipped (its Flex table is ``[N, N]`` booleans: 1 GiB at 32768).

Part ``metadata``: per-step block selection at N = 8192 .. 32768 (B*H = 16, blocks of 128, k key
blocks per query block): ``pooled_topk`` scoring + ``patterns.topk`` layout + ``plan`` on the device,
against ``BlockMask.from_kv_blocks`` and ``create_block_mask`` for the same selection, next to the
attention time (forward+backward, ``backend="triton"``).

Times: ``triton.testing.do_bench`` with ``return_mode="median"`` (ms; the header line says so). Every
row is appended to ``--jsonl`` when measured.

    python benchmarks/bench_gpu_selection.py --jsonl out.jsonl
    python benchmarks/bench_gpu_selection.py --dry-run        # tiny, on a CPU: interpreter, eager Flex forward
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_timing as timing  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["selection", "metadata"], choices=["selection", "metadata"])
    p.add_argument("--n", type=int, nargs="+", default=[8192], help="N of the selection part")
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
    """Median wall time (host + device, synchronised) of a metadata builder (one call in a dry run)."""
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


def _flex(dry):
    from torch.nn.attention.flex_attention import create_block_mask
    return timing.flex(dry=dry), create_block_mask


def part_selection(args, device, dtype, bench):
    from bench_selection import dsa_indices, moba_indices, nsa_indices

    from sparse_io_attn.layout.selection import Selection
    from sparse_io_attn.selection.api import selection_attention
    from sparse_io_attn.selection.plan import SelectionPlan

    Hq, Hkv, D, dry = args.heads, args.kv_heads, args.d, args.dry_run
    g = torch.Generator().manual_seed(0)
    flex = None if args.no_flex else _flex(dry)
    sdpas = {name: timing.sdpa(b) for name, b in timing.sdpa_backends().items()}
    for N in args.n:
        q, k, v, do = (torch.randn(1, h, N, D, device=device, dtype=dtype) for h in (Hq, Hkv, Hkv, Hq))
        for shape in args.shapes:
            if shape == "dsa":
                if N > args.dsa_max_n:
                    continue
                block, top_k, G = 1, min(2048, N // 2), 1
                idx = dsa_indices(g, N, top_k)
            else:
                block, top_k = 64, (8 if shape == "moba" else 16)
                G = Hq if shape == "moba" else Hkv
                idx = (moba_indices if shape == "moba" else nsa_indices)(g, G, N, block, top_k)
            idx = idx.to(device)
            sel = Selection(idx, block)
            plan_ms = _wall_ms(lambda: SelectionPlan(sel, N, 0).keys(), device)  # noqa: B023
            plan = SelectionPlan(sel, N, 0)
            ours = lambda q_, k_, v_: selection_attention(q_, k_, v_, plan, causal=True, backend="triton")  # noqa: E731,B023
            row = {"part": "selection", "shape": shape, "N": N, "Hq": Hq, "Hkv": Hkv, "G": G, "D": D, "block": block,
                   "K": top_k, "plan_ms": plan_ms}
            row["ours_fwd_ms"] = bench(_fwd(ours, q, k, v))
            row["ours_fwdbwd_ms"] = bench(_fwd_bwd(ours, q, k, v, do))
            for name, call in sdpas.items():
                dense = lambda q_, k_, v_: call(q_, k_, v_, True)  # noqa: E731,B023
                try:
                    row[f"sdpa_{name}_fwd_ms"] = bench(_fwd(dense, q, k, v))
                    row[f"sdpa_{name}_fwdbwd_ms"] = bench(_fwd_bwd(dense, q, k, v, do))
                    row[f"speedup_vs_sdpa_{name}_fwdbwd"] = row[f"sdpa_{name}_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
                except Exception as exc:  # noqa: BLE001  (a backend this GPU or build does not have)
                    row[f"sdpa_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if flex is not None:
                row.update(_flex_selection(flex, idx, G, block, q, k, v, do, device, bench, dry))
                row["speedup_vs_flex_fwd"] = row["flex_fwd_ms"] / row["ours_fwd_ms"]
                row["speedup_vs_flex_fwdbwd"] = row["flex_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
            _emit(args, row)


def _flex_selection(flex, idx, G, block, q, k, v, do, device, bench, dry) -> dict:
    """Flex at its defaults with an index ``mask_mod`` over a boolean table of the selection and the
    ``BlockMask`` ``create_block_mask`` builds from it."""
    fa, create = flex
    _, Hq, N, _ = q.shape
    nkb = math.ceil(N / block)
    table = torch.zeros(G, N, nkb + 1, dtype=torch.bool, device=device)
    table.scatter_(-1, torch.where(idx >= 0, idx, nkb).long(), True)
    table = table[..., :nkb].contiguous()
    per = Hq // G

    def mask_mod(b, h, q_idx, kv_idx):
        return table[h // per, q_idx, kv_idx // block] & (kv_idx <= q_idx)
    build = lambda: create(mask_mod, 1, Hq, N, N, device=device, _compile=not dry)  # noqa: E731
    row = {"flex_create_block_mask_ms": _wall_ms(build, device, reps=3)}
    bm = build()
    row["flex_sparsity_pct"] = float(bm.sparsity()) if hasattr(bm, "sparsity") else None
    fx = lambda q_, k_, v_: fa(q_, k_, v_, block_mask=bm, enable_gqa=Hq != k.shape[1])  # noqa: E731
    row["flex_fwd_ms"] = bench(_fwd(fx, q, k, v))
    row["flex_fwdbwd_ms"] = bench(_fwd_bwd(fx, q, k, v, do, dry))
    return row


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
                                                                        BLOCK_SIZE=block, _compile=True), device, reps=3)
        _emit(args, row)


def main(argv=None):
    args = parse_args(argv)
    import sparse_io_attn._triton.runtime  # noqa: F401  (interpreter or compiled, before triton loads)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU (--dry-run runs it on a CPU)")
    device = "cpu" if dry else "cuda"
    if dry:
        args.n, args.meta_n, args.heads, args.kv_heads, args.d, args.dsa_max_n = [16], [128], 2, 1, 16, 16
    dtype = torch.float32 if dry else torch.bfloat16

    def bench(fn):
        return timing.bench(fn, dry=dry)
    print(json.dumps({"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "torch": torch.__version__,
                      "dtype": str(dtype), "timing": timing.label("median", dry),
                      "flex": "torch.compile(flex_attention) at its defaults" + (" (dry run: eager, forward only)"
                                                                                  if dry else ""),
                      "sdpa": {n: str(b) for n, b in timing.sdpa_backends().items()}}), flush=True)
    for part in args.parts:
        try:
            (part_selection if part == "selection" else part_metadata)(args, device, dtype, bench)
        except Exception as exc:  # record and go on: one GPU call runs every part
            _emit(args, {"part": part, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            import traceback
            traceback.print_exc()


if __name__ == "__main__":
    main()
