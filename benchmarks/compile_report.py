"""The compiled path of every kernel family for sm_90 (Hopper), without a GPU: registers, spill
bytes, shared memory, asynchronous copies (cp.async / TMA) and tensor-core MMAs (wgmma), read from
Triton's sm_90 compile and its bundled ptxas.

* Block-sparse attention: `sparse-io-attn compile-report` (every autotuning configuration, compiled
  with the JIT's launch specialisation) at head dims 64 and 128 (bf16, causal and not), fp16 and
  fp32 at head dim 64.
* The paper's dense form (Algorithms 6 and 9): the kernels with the tiles their launchers derive
  from M = 227 KiB (an H100's shared memory per block) in bf16 words, head dim 128.
* Block-sparse operands: every launch of one batched forward + backward of ``sparse_operands.attention``
  (`sparse-io-attn compile-report --op sparse-operands`), 64-row blocks, 32-wide head-dim tiles,
  head dims 64 and 128, bf16 and fp16.

    TRITON_INTERPRET=0 python benchmarks/compile_report.py     # writes benchmarks/results/compile_report_sm90.{md,json}
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from sparse_io_attn._triton.aot import compile_for_cuda, ptx_report  # noqa: E402
from sparse_io_attn._triton.shapes import padded_dim  # noqa: E402
from sparse_io_attn.block_sparse.triton.report import COLUMNS, compile_report  # noqa: E402
from sparse_io_attn.cli._common import format_header, format_table, machine_header, write_json  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "compile_report_sm90"
BLOCK_SPARSE = [(torch.bfloat16, 128, False), (torch.bfloat16, 128, True), (torch.bfloat16, 64, False),
                (torch.bfloat16, 64, True), (torch.float16, 64, False), (torch.float32, 64, False)]


def dense_rows(d: int = 128) -> list[dict]:
    from sparse_io_attn.dense import tiles
    from sparse_io_attn.dense.triton.bwd_large_cache import _col_kernel, _row_kernel
    from sparse_io_attn.dense.triton.bwd_small_cache import _phase3_kernel, _softmax_kernel, _tile_matmul_kernel
    from sparse_io_attn.dense.triton.common import _atb_kernel, _delta_kernel, _proj_kernel
    from sparse_io_attn.dense.triton.fwd import _dense_fwd_kernel

    M, D, BF = 227 * 1024 // 2, padded_dim(d), tl.bfloat16
    B = tiles.small_cache_block(M)
    pl, ps = tiles.large_cache_blocks("large.phase1", M, d)
    al, as_ = tiles.large_cache_blocks("large.atb", M, d)
    _, dls = tiles.large_cache_blocks("large.delta", M, d)
    fl, fs = tiles.forward_blocks("fwd.attn", M, d)
    p2l, p2s = tiles.large_cache_blocks("large.phase2", M, d)
    ql, qs = tiles.large_cache_blocks("large.dq", M, d)
    kl, ks = tiles.large_cache_blocks("large.dkdh", M, d)
    jobs = {
        "proj (Alg 7)": (_proj_kernel, dict(BLOCK_M=ps, BLOCK_C=pl, HEAD_DIM=D, DOT_DTYPE=BF), ("c_ptr",)),
        "atb": (_atb_kernel, dict(BLOCK_M=as_, BLOCK_C=al, HEAD_DIM=D, DOT_DTYPE=BF), ("b_ptr", "c_ptr")),
        "delta": (_delta_kernel, dict(BLOCK_M=dls, HEAD_DIM=D), ("v_ptr",)),
        "forward": (_dense_fwd_kernel, dict(BLOCK_M=fs, BLOCK_N=fl, HEAD_DIM=D, DOT_DTYPE=BF), ("s_ptr", "h_ptr", "lse_ptr")),
        "small: tile matmul (Alg 2-5)": (_tile_matmul_kernel, dict(BLOCK=B, DOT_DTYPE=BF), ("c_ptr",)),
        "small: softmax (Alg 6)": (_softmax_kernel, dict(BLOCK=B, DOT_DTYPE=BF), ("s_ptr", "f_ptr")),
        "small: phase 3": (_phase3_kernel, dict(BLOCK=B), ("f_ptr", "q_ptr", "p_ptr")),
        "large: row (Alg 8, faithful)": (_row_kernel, dict(BLOCK_M=p2s, BLOCK_N=p2l, HEAD_DIM=D, FAITHFUL=True,
                                                          DOT_DTYPE=BF), ("s_ptr", "h_ptr", "lse_ptr", "ds_ptr", "g_ptr")),
        "large: row (FA2 order)": (_row_kernel, dict(BLOCK_M=ql, BLOCK_N=qs, HEAD_DIM=D, FAITHFUL=False, DOT_DTYPE=BF),
                                   ("s_ptr", "h_ptr", "lse_ptr", "ov_ptr", "ds_ptr", "g_ptr")),
        "large: col (Alg 9)": (_col_kernel, dict(BLOCK_M=ks, BLOCK_N=kl, HEAD_DIM=D, DOT_DTYPE=BF),
                               ("s_ptr", "h_ptr", "lse_ptr", "v_ptr", "dh_ptr")),
    }
    rows = []
    for name, (kernel, consts, fp32) in jobs.items():
        c = compile_for_cuda(kernel, dict(consts, COUNT_IO=False), torch.bfloat16, fp32_ptrs=fp32, num_warps=8,
                             num_stages=3)
        tiles = {k: v for k, v in consts.items() if k.startswith("BLOCK")}
        rows.append({"kernel": name, "tiles": str(tiles), **ptx_report(c)})
    return rows


SPARSE_OPERANDS = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128)]


def sparse_operand_rows(dtype: torch.dtype, d: int) -> list[dict]:
    """Every launch of one batched forward + backward, as launched (``compile-report --op sparse-operands``)."""
    from sparse_io_attn.sparse_operands.triton.report import compile_report as operand_report

    return operand_report(dtype, d)


def start_report() -> tuple[list[str], dict]:
    """A compile report's markdown parts and JSON data, started with the machine header and the sm_90a target
    (this report's and :mod:`compile_report_selection`'s)."""
    header = machine_header(torch.bfloat16)
    header["target"] = "sm_90a (compiled with Triton, read with its bundled ptxas-blackwell; no GPU)"
    return [format_header(header) + "\n# " + header["target"]], {"header": header}


def write_report(out: Path, parts: list[str], data: dict) -> int:
    """``out.md`` (the parts) and ``out.json`` (the data); 0, the script's exit status."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n\n".join(parts) + "\n")
    write_json(out.with_suffix(".json"), data)
    return 0


def main() -> int:
    parts, data = start_report()
    for dtype, d, causal in BLOCK_SPARSE:
        rows = compile_report(dtype, d, 128, causal=causal)
        key = f"block_sparse_{str(dtype).split('.')[-1]}_d{d}{'_causal' if causal else ''}"
        data[key] = rows
        parts.append(f"## block-sparse, {str(dtype).split('.')[-1]}, head dim {d}, block 128"
                     f"{', causal' if causal else ''}\n\n```\n{format_table(rows, [(c, c) for c in COLUMNS])}\n```")
        print(parts[-1], flush=True)
    cols = ["registers", "spill_stores", "spill_loads", "shared_bytes", "cp_async", "tma", "wgmma"]
    data["dense"] = dense_rows()
    parts.append("## dense form (the paper's Algorithms 6 and 9), bf16, head dim 128, tiles from M = 227 KiB, "
                 "8 warps, 3 stages\n\n```\n" + format_table(data["dense"], [(c, c) for c in ["kernel", "tiles"] + cols])
                 + "\n```")
    print(parts[-1], flush=True)
    from sparse_io_attn.sparse_operands.triton.report import COLUMNS as OPERAND_COLUMNS

    for dtype, d in SPARSE_OPERANDS:
        name = str(dtype).split(".")[-1]
        rows = sparse_operand_rows(dtype, d)
        data[f"sparse_operands_{name}_d{d}"] = rows
        parts.append(f"## block-sparse operands (sparse_operands.attention, batched), {name}, head dim {d}, 64-row blocks, "
                     f"32-wide head-dim tiles, as launched\n\n```\n"
                     + format_table(rows, [(c, c) for c in OPERAND_COLUMNS]) + "\n```")
        print(parts[-1], flush=True)
    return write_report(OUT, parts, data)


if __name__ == "__main__":
    sys.exit(main())
