"""``sparse-io-attn compile-report``: compile the Triton kernels of an op for a CUDA architecture as
a real launch would (same specialisation; for the block-sparse op every autotuning configuration),
without a GPU, and print per kernel and configuration: registers, spill bytes, shared memory and
whether the main loops' loads are asynchronous. ``--op block-sparse`` (default): the block-sparse
attention kernels (pipelined = ``cp.async`` or TMA in the PTX). ``--op sparse-operands``: every
launch of one batched forward + backward of ``sparse_operands.attention`` (pipelined = the loop's 2-D operand
tiles copied asynchronously, not only its indices). ``--op selection``: the per-token selection kernels
(:func:`~sparse_io_attn.selection.api.selection_attention`'s ``"triton"`` backend: the family each head
layout runs (key-major, element-masked or query-major) and the query-major one kept as a candidate) for four
head layouts (a selection per GQA group, per query head, one shared by 16 heads over 4 KV heads, one shared by
64 heads; ``--shapes`` picks some), every autotuning configuration, with wgmma and mma.sync counts (pipelined = the
loop's gathered K/V or Q/dO tiles copied asynchronously). ``--op block-sparse-decode``: the block-sparse
decode kernels (split-K over the decoded rows' kept blocks, and the merge) for one token and for 16.
``--op selection-decode``: the selection decode kernels (split-K over each token's selected blocks, and
the merge) for one token (a selection per GQA group) and for 16 (one shared by 64 heads)."""
from __future__ import annotations

import argparse
import os
import sys

from sparse_io_attn.cli._common import format_table, parse_dtype, to_json

EXAMPLES = """examples:
  sparse-io-attn compile-report --dtype bf16 --head-dim 128 --block 128
  sparse-io-attn compile-report --dtype fp16 --head-dim 64 --causal --json
  sparse-io-attn compile-report --dtype bf16 --head-dim 128 --ptx-dir /tmp/ptx --configs default
  sparse-io-attn compile-report --op sparse-operands --dtype fp16 --head-dim 128
  sparse-io-attn compile-report --op selection --dtype bf16 --head-dim 64 --block 4 --causal
  sparse-io-attn compile-report --op block-sparse-decode --dtype bf16 --head-dim 128
  sparse-io-attn compile-report --op selection-decode --dtype bf16 --head-dim 128 --block 1

Triton's bundled ptxas reads the PTX (registers, spills); no GPU is used. Runs Triton without its
interpreter, so it must be the first use of Triton in the process."""


def add_parser(sub) -> None:
    p = sub.add_parser("compile-report", help="registers, spills and pipelining of the compiled kernels",
                       epilog=EXAMPLES, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("block-sparse", "block-sparse-decode", "sparse-operands", "selection",
                                    "selection-decode"),
                   default="block-sparse",
                   help="which op's kernels (default block-sparse)")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32 (default bf16)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--block", type=int, default=None,
                   help="layout block size (default 128); sparse-operands: row block size (default 64); "
                        "selection, selection-decode: keys per selected block (default 64)")
    p.add_argument("--block-d", type=int, default=32,
                   help="sparse-operands only: head-dim (column) block size of X, Y (default 32)")
    p.add_argument("--causal", action="store_true", help="compile the causal variants (block-sparse, selection)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: Hopper)")
    p.add_argument("--configs", choices=("all", "default"), default="all",
                   help="every autotuning configuration (default) or only the default one")
    p.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="selection only: head layouts to compile (gqa, mqa, moba, dsa; default all)")
    p.add_argument("--ptx-dir", metavar="DIR", help="write each kernel's PTX into DIR")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    dtype = parse_dtype(args.dtype)
    sparse_operands = args.op == "sparse-operands"
    block = args.block if args.block is not None else (128 if args.op.startswith("block-sparse") else 64)
    if args.head_dim < 1 or block < 1 or args.block_d < 1:
        raise ValueError(f"--head-dim, --block and --block-d must be positive, got {args.head_dim}, {block} "
                         f"and {args.block_d}")
    if sparse_operands and args.causal:
        raise ValueError("--causal applies to --op block-sparse and selection (the sparse-operand kernels keep "
                         "whole QK blocks)")
    if args.ptx_dir is not None:
        os.makedirs(args.ptx_dir, exist_ok=True)
        if not os.access(args.ptx_dir, os.W_OK):
            raise ValueError(f"--ptx-dir {args.ptx_dir} is not writable")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("Triton was already imported with its interpreter in this process; run "
                         "compile-report in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"
    from sparse_io_attn.cli._compile_reports import REPORTS

    report = REPORTS[args.op]
    if sparse_operands:
        rows = report.compile_report(dtype, args.head_dim, block=block, block_d=args.block_d, arch=args.arch,
                                     ptx_dir=args.ptx_dir)
        what = (f"sparse operands, {args.dtype}, head_dim {args.head_dim}, blocks {block} x {args.block_d}); "
                f"pipelined = the loop's operand tiles copied asynchronously")
        loopless = "paper_attn_bwd_preprocess"
    elif args.op == "selection":
        shapes = tuple(args.shapes or report.SHAPES)
        unknown = sorted(set(shapes) - set(report.SHAPES))
        if unknown:
            raise ValueError(f"--shapes {unknown} unknown; choose from {tuple(report.SHAPES)}")
        rows = report.compile_report(dtype, args.head_dim, block, causal=args.causal, arch=args.arch,
                                     configs=args.configs, shapes=shapes, ptx_dir=args.ptx_dir)
        what = (f"per-token selection, {args.dtype}, head_dim {args.head_dim}, block {block}"
                f"{', causal' if args.causal else ''}); pipelined = the loop's gathered tiles copied asynchronously")
        loopless = report.LOOPLESS
    elif args.op == "selection-decode":
        rows = report.compile_report(dtype, args.head_dim, block, arch=args.arch, ptx_dir=args.ptx_dir)
        what = (f"selection decode, {args.dtype}, head_dim {args.head_dim}, block {block}, bottom-right causal); "
                f"pipelined = the loop's 2-D tiles copied asynchronously")
        loopless = report.LOOPLESS
    elif args.op == "block-sparse-decode":
        rows = report.compile_report(dtype, args.head_dim, block, arch=args.arch, ptx_dir=args.ptx_dir)
        what = (f"block-sparse decode, {args.dtype}, head_dim {args.head_dim}, block {block}, bottom-right causal); "
                f"pipelined = cp.async or TMA loads in the PTX")
        loopless = report.LOOPLESS
    else:
        rows = report.compile_report(dtype, args.head_dim, block, causal=args.causal, arch=args.arch,
                                     configs=args.configs, ptx_dir=args.ptx_dir)
        what = (f"{args.dtype}, head_dim {args.head_dim}, block {block}{', causal' if args.causal else ''}); "
                f"pipelined = cp.async or TMA loads in the PTX")
        loopless = "attn_bwd_preprocess"
    if args.json:
        print(to_json({"op": args.op, "dtype": args.dtype, "head_dim": args.head_dim, "block": block,
                       "causal": args.causal, "arch": args.arch, "rows": rows}))
        return 0
    print(f"compiled for sm_{args.arch} ({what}")
    print(format_table(rows, [(c, c) for c in report.COLUMNS]))
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    unpiped = [r for r in rows if not r["pipelined"] and r["kernel"] != loopless]
    print(f"{len(rows)} kernel configurations; {len(spilled)} with register spills; "
          f"{len(unpiped)} main loops without asynchronous loads")
    return 0
