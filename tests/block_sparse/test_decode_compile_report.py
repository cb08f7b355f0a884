"""The decode kernels' compiled path, checked on every commit without a GPU: `attn_decode` (split-K over
the decoded rows' kept blocks) and `attn_decode_merge`, compiled for sm_90 as a real launch compiles
them (one token: BLOCK_M 16; 16 tokens: BLOCK_M 64), spill no registers and multi-buffer their main
loops' loads (cp.async). Each case runs `sparse-io-attn compile-report --op block-sparse-decode` in a
fresh process (this one imported Triton in interpreter mode). The decode kernels have one launch
configuration each (the default is all there is); head dims 64 and 128, bf16 and fp16."""
import json
import os
import subprocess
import sys

import pytest

CASES = [  # (dtype, head_dim)
    pytest.param("bf16", 128, id="bf16-d128"),
    pytest.param("fp16", 64, id="fp16-d64"),
    pytest.param("bf16", 64, id="bf16-d64", marks=pytest.mark.slow),
    pytest.param("fp16", 128, id="fp16-d128", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,head_dim", CASES)
def test_decode_kernels_pipeline_and_do_not_spill(tmp_path, dtype, head_dim):
    cmd = [sys.executable, "-m", "sparse_io_attn.cli", "compile-report", "--op", "block-sparse-decode", "--dtype",
           dtype, "--head-dim", str(head_dim), "--json"]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)["rows"]
    assert {(r["shape"], r["kernel"]) for r in rows} == {(s, k) for s in ("decode", "verify")
                                                         for k in ("attn_decode", "attn_decode_merge")}
    for r in rows:
        assert r["splits"] > 1, r                                 # the example rows are split: both kernels run
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r             # fits an H100 block
        assert r["pipelined"] and r["cp_async"] > 0, r
    verify = next(r for r in rows if r["shape"] == "verify" and r["kernel"] == "attn_decode")
    assert verify["BLOCK_M"] == 64 and verify["wgmma"] > 0, verify   # 4 heads x 16 tokens on tensor cores
