"""The selection kernels compiled for sm_90 (Hopper) without a GPU, as the launcher launches them
(``compile-report --op selection``): every autotuning configuration, for a selection per GQA group
and one shared by 64 heads, spills no registers, copies the main loop's gathered tiles (K/V in the
forward and dQ, Q/dO in dK/dV) asynchronously (software-pipelined, multi-buffered ``cp.async``) and
fits an H100 block's shared memory. bf16 at head dim 64 with 64-key blocks (one block per key step,
causal) and fp16 at head dim 128 with 4-key blocks (16 blocks gathered per key step); the results
file (benchmarks/results/compile_report_selection_sm90.md) has both dtypes at both head dims and
blocks 1, 4, 32, 64, 100 (the default configuration of fp16 at head dim 128 runs in the quick suite
too). Each report runs the command in a fresh process: this one imported Triton in
interpreter mode."""
import json
import os
import subprocess
import sys

import pytest
import torch

LOOPED = ("selection_fwd", "selection_bwd_dq", "selection_bwd_dkdv")

CASES = [  # (dtype, head_dim, block, causal, configs)
    pytest.param("bf16", 64, 64, True, "all", id="bf16-d64-block64-causal-all", marks=pytest.mark.slow),
    pytest.param("fp16", 128, 4, False, "default", id="fp16-d128-block4-default"),
    pytest.param("fp16", 128, 64, False, "default", id="fp16-d128-block64-default"),
]


@pytest.mark.parametrize("dtype, head_dim, block, causal, configs", CASES)
def test_kernels_pipelined_without_spills(tmp_path, dtype, head_dim, block, causal, configs):
    cmd = [sys.executable, "-m", "sparse_io_attn.cli", "compile-report", "--op", "selection", "--dtype", dtype,
           "--head-dim", str(head_dim), "--block", str(block), "--configs", configs, "--json"] \
        + (["--causal"] if causal else [])
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert (report["op"], report["head_dim"], report["block"], report["causal"]) == ("selection", head_dim, block,
                                                                                      causal)
    rows = report["rows"]
    assert {(r["shape"], r["kernel"]) for r in rows} == {(s, k) for s in ("gqa", "mqa")
                                                         for k in LOOPED + ("selection_bwd_preprocess",)}
    if configs == "all":
        assert len(rows) > 8                   # several autotuning candidates per kernel were compiled
    for r in rows:
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r          # fits an H100 block
        if r["kernel"] in LOOPED:
            assert r["pipelined"] and r["tile_async"] > 0 and r["cp_async"] > 0, r
    # the 64-head tiles run on tensor cores (wgmma); 16-row head tiles use mma.sync
    assert all(r["wgmma"] > 0 for r in rows if r["kernel"] == "selection_fwd" and r["BLOCK_M"] == 64)


def test_report_compiles_the_launchers_calls():
    """The report compiles what the launcher launches: one forward + backward's calls, with the
    configurations of ``selection.tiles`` (tiles fitted to the block size), nothing run."""
    from sparse_io_attn.selection.tiles import head_rows, kernel_configs, sel_heads
    from sparse_io_attn.selection.triton.report import KERNELS, SHAPES, example_calls

    for shape, (Hq, Hkv, G) in SHAPES.items():
        calls = example_calls(torch.bfloat16, 96, 4, True, shape)
        assert [c.name for c in calls] == ["selection_fwd", "selection_bwd_preprocess", "selection_bwd_dkdv",
                                           "selection_bwd_dq"]
        assert set(c.name for c in calls) == set(KERNELS)
        fwd, _, dkdv, dq = calls
        assert fwd.kwargs["SEL_HEADS"] == sel_heads(Hq, Hkv, G) == min(Hq // Hkv, Hq // G)
        block_h = head_rows(sel_heads(Hq, Hkv, G), 96, torch.bfloat16)
        assert fwd.kwargs["BLOCK_H"] == block_h == {"gqa": 16, "mqa": 64}[shape]
        assert [c.kwargs["BLOCK_N"] for c in fwd.configs] == [c.block_n for c in kernel_configs("fwd", 4, 96)]
        assert all(c.kwargs["SLOTS"] * 4 == c.kwargs["BLOCK_N"] for c in fwd.configs + dq.configs)  # gathered blocks
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in dkdv.configs] == \
            [(c.block_m, c.block_n) for c in kernel_configs("dkdv", 4, 96)]
        assert all(c.kwargs["BLOCK_N"] == 16 and c.kwargs["KEY_TILES"] == 1 for c in dkdv.configs)  # block padded to 16
