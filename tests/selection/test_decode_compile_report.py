"""The selection decode kernels' compiled path, checked on every commit without a GPU: `selection_decode`
(split-K over each token's selected blocks) and `selection_decode_merge`, compiled for sm_90 as a real
launch compiles them (one token, a selection per GQA group: BLOCK_H 16; 16 tokens sharing one
selection over 64 heads: BLOCK_H 64), spill no registers, fit an H100 block's shared memory and copy
their main loops' 2-D tiles asynchronously (the gathered K/V tiles; the merge's partial rows). Each
case runs `sparse-io-attn compile-report --op selection-decode` in a fresh process (this one imported
Triton in interpreter mode): bf16 at head dim 128 with 64-key blocks (one block per key step) and
fp16 at head dim 64 with 1-key blocks (DSA-shaped: 64 single keys gathered per step, slow)."""

import pytest

from helpers import check_decode_report, compile_report

CASES = [  # (dtype, head_dim, block)
    pytest.param("bf16", 128, 64, id="bf16-d128-block64"),
    pytest.param("fp16", 64, 1, id="fp16-d64-block1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype, head_dim, block", CASES)
def test_decode_kernels_pipeline_and_do_not_spill(tmp_path, dtype, head_dim, block):
    report = compile_report(tmp_path, "--op", "selection-decode", "--dtype", dtype, "--head-dim", str(head_dim),
                            "--block", str(block))
    assert (report["op"], report["head_dim"], report["block"]) == ("selection-decode", head_dim, block)
    verify = check_decode_report(report["rows"], "selection_decode")
    assert verify["BLOCK_M"] == 64, verify                        # 64 heads sharing one selection: one tile
