"""The compiled path of the per-token selection kernels for sm_90 (Hopper), without a GPU:
registers, spill bytes, shared memory, asynchronous copies (cp.async, of which ``tile_async`` are
the gathered 2-D K/V or Q/dO tiles of the main loops) and tensor-core MMAs (wgmma), read from
Triton's sm_90 compile and its bundled ptxas (`sparse-io-attn compile-report --op selection`).

Every autotuning configuration of every kernel, compiled with the JIT's launch specialisation, for
two head layouts (a selection per GQA group: 8 heads per tile; one shared by 64 heads), at head
dims 64 and 128 in bf16 (causal) and fp16 (not causal), blocks of 1, 4, 32, 64 and 100 keys (one
token; 16 blocks gathered per key step; a 32-key dK/dV tile; one 64-key step per block; two steps
of a block that is no multiple of the step), and fp32 at head dim 64.

    TRITON_INTERPRET=0 python benchmarks/compile_report_selection.py
    # writes benchmarks/results/compile_report_selection_sm90.{md,json}
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_json  # noqa: E402
from sparse_io_attn.selection.triton.report import COLUMNS, LOOPLESS, compile_report  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "compile_report_selection_sm90"
BLOCKS = (1, 4, 32, 64, 100)
CASES = ([(torch.bfloat16, d, b, True) for d in (64, 128) for b in BLOCKS]
         + [(torch.float16, d, b, False) for d in (64, 128) for b in BLOCKS]
         + [(torch.float32, 64, 4, False), (torch.float32, 64, 64, True)])


def main() -> int:
    header = machine_header(torch.bfloat16)
    header["target"] = "sm_90a (compiled with Triton, read with its bundled ptxas-blackwell; no GPU)"
    parts, data = [format_header(header) + "\n# " + header["target"]], {"header": header}
    totals = {"rows": 0, "spilled": 0, "unpipelined": 0}
    for dtype, d, block, causal in CASES:
        name = str(dtype).split(".")[-1]
        rows = compile_report(dtype, d, block, causal=causal)
        data[f"selection_{name}_d{d}_block{block}{'_causal' if causal else ''}"] = rows
        spilled = sum(1 for r in rows if r["spill_stores"] or r["spill_loads"])
        unpiped = sum(1 for r in rows if not r["pipelined"] and r["kernel"] != LOOPLESS)
        totals["rows"] += len(rows)
        totals["spilled"] += spilled
        totals["unpipelined"] += unpiped
        parts.append(f"## selection, {name}, head dim {d}, block {block}{', causal' if causal else ''}: "
                     f"{len(rows)} configurations, {spilled} with spills, {unpiped} loops without asynchronous "
                     f"tile loads\n\n```\n{format_table(rows, [(c, c) for c in COLUMNS])}\n```")
        print(parts[-1], flush=True)
    parts.insert(1, f"{totals['rows']} kernel configurations in all: {totals['spilled']} with register spills, "
                    f"{totals['unpipelined']} main loops without asynchronous tile loads (the preprocess kernel "
                    f"has no loop). shape gqa: Hq 16, Hkv 2, G 2 (8 heads per forward/dQ tile, BLOCK_M = "
                    f"BLOCK_H 16); mqa: Hq 64, Hkv 1, G 1 (BLOCK_H 64, or the dtype's cap); dK/dV BLOCK_M = "
                    f"gathered (token, head) rows.")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".md").write_text("\n\n".join(parts) + "\n")
    write_json(OUT.with_suffix(".json"), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
