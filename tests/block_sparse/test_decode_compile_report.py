"""The decode kernels' compiled path, checked on every commit without a GPU: `attn_decode` (split-K over
the decoded rows' kept blocks) and `attn_decode_merge`, compiled for sm_90 as a real launch compiles
them (one token: BLOCK_M 16; 16 tokens: BLOCK_M 64), spill no registers and multi-buffer their main
loops' loads (cp.async). Each case runs `sparse-io-attn compile-report --op block-sparse-decode` in a
fresh process (this one imported Triton in interpreter mode). The decode kernels have one launch
configuration each (the default is all there is); head dims 64 and 128, bf16 and fp16."""

import pytest

from helpers import check_decode_report, compile_report

CASES = [  # (dtype, head_dim)
    pytest.param("bf16", 128, id="bf16-d128"),
    pytest.param("fp16", 64, id="fp16-d64"),
    pytest.param("bf16", 64, id="bf16-d64", marks=pytest.mark.slow),
    pytest.param("fp16", 128, id="fp16-d128", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,head_dim", CASES)
def test_decode_kernels_pipeline_and_do_not_spill(tmp_path, dtype, head_dim):
    report = compile_report(tmp_path, "--op", "block-sparse-decode", "--dtype", dtype, "--head-dim", str(head_dim))
    verify = check_decode_report(report["rows"], "attn_decode")
    assert verify["BLOCK_M"] == 64 and verify["wgmma"] > 0, verify   # 4 heads x 16 tokens on tensor cores
