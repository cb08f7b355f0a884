"""The paper kernels compile for sm_90 (Hopper) without a GPU, with the per-tile products behind
runtime branches (absent head-dim / column tiles: no FLOPs on the compiled path either)."""
import ast
import os
import subprocess
import sys

import pytest


def test_paper_attention_kernels_compile_for_sm90(tmp_path):
    """Run in a fresh process: this one imported Triton in interpreter mode. head_dim 80 with 32-wide
    d-tiles: 3 tiles, the last one partly out of bounds."""
    code = ("import torch\nfrom sparse_io_attn.sparse_operands.triton.report import aot_compile\n"
            "print(aot_compile(torch.bfloat16, 80, 48, block_m=64, block_n=64, block_d=32))\n")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    out = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "matmul"}
    assert all(0 < r["shared"] <= 227 * 1024 for r in out.values()), out  # fits an H100 block
    assert all(r["mma"] > 0 for r in out.values()), out  # tensor-core products
    # one runtime branch per d-tile per product over the head dimension: S (all three kernels),
    # dA2 += dS^T Q (dkv) and dQ += dS A2 (dq); one per column tile in the row-panel product
    n_tiles = 3
    assert out["paper_attn_fwd"]["scf_if"] == n_tiles, out
    assert out["paper_attn_bwd_dkv"]["scf_if"] == 2 * n_tiles, out
    assert out["paper_attn_bwd_dq"]["scf_if"] == 2 * n_tiles, out
    assert out["matmul"]["scf_if"] == n_tiles, out


@pytest.mark.slow
def test_launch_configurations_do_not_spill_at_head_dim_64(tmp_path):
    """Compiled for sm_90 with the launcher's (num_warps, num_stages) (configs.LAUNCH), bf16, 64 x 64
    tiles, 32-wide d-tiles, head dim 64: no kernel spills registers (with 4 warps dK/dV does)."""
    code = ("import torch\nfrom sparse_io_attn._triton.aot import ptx_report\n"
            "from sparse_io_attn.sparse_operands.triton.configs import LAUNCH\n"
            "from sparse_io_attn.sparse_operands.triton.report import compile_kernel, kernel_jobs\n"
            "jobs = kernel_jobs(torch.bfloat16, 64, 64, count_io=False)\n"
            "out = {}\nfor name, (k, cx) in jobs.items():\n"
            "    for w, s in {LAUNCH[name], (4, 2)}:\n"
            "        r = ptx_report(compile_kernel(k, cx, torch.bfloat16, num_warps=w, num_stages=s))\n"
            "        out[(name, w, s)] = r['spill_stores'] + r['spill_loads']\n"
            "print(out)\n")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    out = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    from sparse_io_attn.sparse_operands.triton.configs import LAUNCH
    for name in ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "matmul"):
        assert out[(name, *LAUNCH[name])] == 0, out
    assert out[("paper_attn_bwd_dkv", 4, 2)] > 0, out  # what the configuration avoids
