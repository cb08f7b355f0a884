"""The compiled path of the per-token selection kernels for sm_90 (Hopper), without a GPU:
registers, spill bytes, shared memory, asynchronous copies (cp.async, of which ``tile_async`` are
the 2-D K/V, Q/dO or partial-row tiles of the main loops) and tensor-core MMAs (``wgmma``; ``mma_sync``
counts the products Triton did not lower to wgmma), read from Triton's sm_90 compile and its bundled
ptxas (`sparse-io-attn compile-report --op selection`).

Every autotuning configuration of every kernel, compiled with the JIT's launch specialisation, for
four head layouts (report.SHAPES: a selection per GQA group, per query head (MoBA), one per 16 heads over
4 KV heads (DSA with few heads), one shared by 64 heads), each in the family ``"auto"`` runs and in the
query-major family kept as a candidate: bf16 causal at head dim 128 with blocks of 1, 4, 16, 64, 100 and
512 keys and at head dim 64 with blocks of 1 and 64, fp16 (not causal) at head dim 128 with 32-key
blocks, fp32 at head dim 64.

    TRITON_INTERPRET=0 python benchmarks/compile_report_selection.py
    # writes benchmarks/results/compile_report_selection_sm90.{md,json}
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from compile_report import start_report, write_report  # noqa: E402  (benchmarks/ on sys.path)
from sparse_io_attn.cli._common import format_table  # noqa: E402
from sparse_io_attn.selection.triton.report import COLUMNS, LOOPLESS, compile_report  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "compile_report_selection_sm90"
CASES = ([(torch.bfloat16, 128, b, True) for b in (1, 4, 16, 64, 100, 512)]
         + [(torch.bfloat16, 64, b, True) for b in (1, 64)]
         + [(torch.float16, 128, 32, False), (torch.float32, 64, 4, False), (torch.float32, 64, 64, True)])
#: the issue-47 kernels with products (wgmma expected in every one at bf16/fp16: blocks of 64+ keys or masked)
FAMILY_PRODUCTS = ("selection_key_fwd", "selection_key_bwd", "selection_masked_fwd", "selection_masked_dkdv",
                   "selection_masked_dq")


def main() -> int:
    parts, data = start_report()
    totals = {"rows": 0, "spilled": 0, "unpipelined": 0, "new": 0, "mma_sync": 0}
    for dtype, d, block, causal in CASES:
        name = str(dtype).split(".")[-1]
        rows = compile_report(dtype, d, block, causal=causal)
        data[f"selection_{name}_d{d}_block{block}{'_causal' if causal else ''}"] = rows
        spilled = sum(1 for r in rows if r["spill_stores"] or r["spill_loads"])
        unpiped = sum(1 for r in rows if not r["pipelined"] and r["kernel"] != LOOPLESS)
        new = [r for r in rows if r["kernel"] in FAMILY_PRODUCTS]
        synced = sum(1 for r in new if r["mma_sync"] or not r["wgmma"])
        for key, n in (("rows", len(rows)), ("spilled", spilled), ("unpipelined", unpiped), ("new", len(new)),
                       ("mma_sync", synced if dtype != torch.float32 else 0)):
            totals[key] += n
        parts.append(f"## selection, {name}, head dim {d}, block {block}{', causal' if causal else ''}: "
                     f"{len(rows)} configurations, {spilled} with spills, {unpiped} loops without asynchronous "
                     f"tile loads, {synced} of the {len(new)} new-family configurations with a product off wgmma"
                     f"\n\n```\n{format_table(rows, [(c, c) for c in COLUMNS])}\n```")
        print(parts[-1], flush=True)
    parts.insert(1, f"{totals['rows']} kernel configurations in all: {totals['spilled']} with register spills, "
                    f"{totals['unpipelined']} main loops without asynchronous tile loads (the preprocess kernel "
                    f"has no loop); of the {totals['new']} configurations of the issue-47 kernels with products "
                    f"(key_fwd, key_bwd, masked_*), {totals['mma_sync']} at bf16/fp16 with a product off wgmma "
                    f"(mma_sync > 0: the key-major dK/dV of blocks under 64 keys, whose key tile is every "
                    f"product's M; fp32 runs IEEE products on CUDA cores). Shapes (report.SHAPES): gqa Hq 16, Hkv "
                    f"2, G 2; mqa Hq 64, Hkv 1, G 1 (query-major, BLOCK_H 64 or the dtype's cap); moba Hq 16, Hkv "
                    f"4, G 16; dsa Hq 16, Hkv 4, G 1. BLOCK_M: the query-major forward/dQ head rows, the gathered "
                    f"(token, head) rows of a tile (key-major, masked), the rows per dK/dV product, a merge's rows.")
    return write_report(OUT, parts, data)


if __name__ == "__main__":
    sys.exit(main())
