"""The compiled path, checked on every commit without a GPU: every block-sparse kernel compiled for
sm_90 as a real launch compiles it (JIT specialisation, every autotuning configuration) has its main
loops' K/V (forward, dQ) and Q/dO (dK/dV) loads multi-buffered (cp.async) and spills no registers;
in bf16/fp16 every matrix product whose M is 64 or more runs on Hopper's wgmma (the forward's and
dQ's M is the query tile; every product of dK/dV's direct form, S^T = K Q^T, has the key tile as its
M), and the 128-key dK/dV and 128-query dQ tiles are among the compiled configurations.
Each case runs `sparse-io-attn compile-report` in a fresh process (this one imported Triton in
interpreter mode). Head dims 64 and 128, bf16 and fp16, causal and not; every configuration for
one dtype per head dim, the default configuration for the other combinations; fp32 (exact IEEE
products on CUDA cores) at head dim 64, its default configuration (every fp32 configuration:
benchmarks/results/compile_report_sm90.md)."""

import pytest

from helpers import compile_report

CASES = [  # (dtype, head_dim, causal, configs)
    pytest.param("bf16", 128, True, "all", id="bf16-d128-causal-all", marks=pytest.mark.slow),
    pytest.param("fp16", 128, False, "default", id="fp16-d128-default"),
    pytest.param("bf16", 64, False, "all", id="bf16-d64-all", marks=pytest.mark.slow),
    pytest.param("fp16", 64, True, "default", id="fp16-d64-causal-default"),
    pytest.param("fp32", 64, False, "default", id="fp32-d64-default"),   # every fp32 candidate: the results file
]


@pytest.mark.parametrize("dtype,head_dim,causal,configs", CASES)
def test_kernels_pipeline_and_do_not_spill(tmp_path, dtype, head_dim, causal, configs):
    rows = compile_report(tmp_path, "--dtype", dtype, "--head-dim", str(head_dim), "--block", "128", "--configs",
                          configs, *(["--causal"] if causal else []))["rows"]
    loops = [r for r in rows if r["kernel"] != "attn_bwd_preprocess"]
    assert {r["kernel"] for r in loops} == {"attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"}
    if configs == "all":
        assert len(loops) > 3   # several autotuning candidates per kernel were compiled
    for r in rows:
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r           # fits an H100 block
    for r in loops:
        assert r["pipelined"] and r["cp_async"] > 0, r
        if dtype == "fp32":   # fp32 runs exact IEEE products: no tensor cores by design
            continue
        m = r["BLOCK_N"] if r["scores"] == "direct" else r["BLOCK_M"]   # every product's M
        if m >= 64 and r["scores"] != "exact":   # (exact: the forward's Q K^T transposed, kept candidates)
            assert r["dots"] > 0 and r["wgmma_dots"] == r["dots"], r   # every product on wgmma
        else:
            assert r["wgmma"] > 0 or max(r["BLOCK_M"], r["BLOCK_N"]) < 64, r   # wgmma where a product allows
    if dtype != "fp32":
        assert any(r["kernel"] == "attn_bwd_dkdv" and r["BLOCK_N"] == 128 and r["scores"] == "direct" for r in rows)
        assert any(r["kernel"] == "attn_bwd_dq" and r["BLOCK_M"] == 128 for r in rows)
