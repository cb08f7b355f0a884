"""The selection kernels compiled for sm_90 (Hopper) without a GPU, as the launcher launches them
(``compile-report --op selection``): every autotuning configuration of the family each head layout runs
(key-major gathered tiles for a selection per query head or per GQA group with blocks of 16 keys and
more, element-masked tiles below, query-major for a selection shared by 64 heads) and of the query-major
family kept as a candidate (at the head layouts it was built for: a selection per GQA group, one shared by 64
heads; at one head per selection some of its candidates spill a few bytes, listed in the results file) spills
no registers, copies the main loop's tiles (K/V in the forward and dQ,
Q/dO in dK/dV, partial rows in the merges) asynchronously (software-pipelined, multi-buffered
``cp.async``), fits an H100 block's shared memory, and the new families run every product on wgmma (no
mma.sync). The quick suite compiles the default configurations at fp16, head dim 128; the slow cases and
the results file (benchmarks/results/compile_report_selection_sm90.md) every configuration. Each report
runs the command in a fresh process: this one imported Triton in interpreter mode."""

import pytest
import torch

from helpers import compile_report

QUERY_LOOPED = ("selection_fwd", "selection_bwd_dq", "selection_bwd_dkdv")
#: the issue-47 kernels with products: every one on Hopper's wgmma (mma.sync would mean a product Triton did
#: not lower to it) at bf16/fp16 with blocks of 64 keys and more (key-major) or any block (masked)
FAMILY_PRODUCTS = ("selection_key_fwd", "selection_key_bwd", "selection_masked_fwd", "selection_masked_dkdv",
                   "selection_masked_dq")
MERGES = ("selection_key_merge", "selection_key_dq_merge")

CASES = [  # (dtype, head_dim, block, causal, configs, shapes)
    pytest.param("bf16", 128, 64, True, "all", ("gqa",), id="bf16-d128-block64-causal-all",
                 marks=pytest.mark.slow),
    pytest.param("bf16", 64, 1, True, "all", ("dsa",), id="bf16-d64-block1-causal-all", marks=pytest.mark.slow),
    pytest.param("fp16", 128, 4, False, "default", ("dsa", "mqa"), id="fp16-d128-block4-default"),
    pytest.param("fp16", 128, 64, False, "default", ("moba",), id="fp16-d128-block64-default"),
]


@pytest.mark.parametrize("dtype, head_dim, block, causal, configs, shapes", CASES)
def test_kernels_pipelined_without_spills(tmp_path, dtype, head_dim, block, causal, configs, shapes):
    report = compile_report(tmp_path, "--op", "selection", "--dtype", dtype, "--head-dim", str(head_dim), "--block",
                            str(block), "--configs", configs, "--shapes", *shapes, *(["--causal"] if causal else []))
    assert (report["op"], report["head_dim"], report["block"], report["causal"]) == ("selection", head_dim, block,
                                                                                      causal)
    rows = report["rows"]
    # each head layout: the family "auto" picks and the query-major one (kept as a candidate)
    auto = {"mqa": "query", "moba": "key" if block >= 16 else "masked", "gqa": "key" if block >= 16 else "masked",
            "dsa": "key" if block >= 16 else "masked"}
    assert {(r["shape"], r["family"]) for r in rows} == {(s, f) for s in shapes for f in {auto[s], "query"}}
    if configs == "all":
        assert len(rows) > 8                   # several autotuning candidates per kernel were compiled
    for r in rows:
        if r["family"] != "query" or r["shape"] in ("gqa", "mqa"):   # (the query-major kernels' own layouts)
            assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r          # fits an H100 block
        if r["kernel"] in QUERY_LOOPED + FAMILY_PRODUCTS + MERGES:
            assert r["pipelined"] and r["tile_async"] > 0 and r["cp_async"] > 0, r
        if r["kernel"] in FAMILY_PRODUCTS:
            assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # the 64-head query-major tiles run on tensor cores (wgmma); 16-row head tiles use mma.sync
    assert all(r["wgmma"] > 0 for r in rows if r["kernel"] == "selection_fwd" and r["BLOCK_M"] == 64)


def test_report_compiles_the_launchers_calls():
    """The report compiles what the launcher launches: one forward + backward's calls per family, with the
    configurations of ``selection.tiles`` (tiles fitted to the block size), nothing run."""
    from sparse_io_attn.selection.tiles import family_tiles, head_rows, kernel_configs, sel_heads
    from sparse_io_attn.selection.triton.report import KERNELS, SHAPES, example_calls, families

    for shape, (Hq, Hkv, G) in SHAPES.items():
        calls = example_calls(torch.bfloat16, 96, 4, True, shape, "query")
        assert [c.name for c in calls] == ["selection_fwd", "selection_bwd_preprocess", "selection_bwd_dkdv",
                                           "selection_bwd_dq"]
        assert set(c.name for c in calls) <= set(KERNELS)
        fwd, _, dkdv, dq = calls
        assert fwd.kwargs["SEL_HEADS"] == sel_heads(Hq, Hkv, G) == min(Hq // Hkv, Hq // G)
        block_h = head_rows(sel_heads(Hq, Hkv, G), 96, torch.bfloat16)
        assert fwd.kwargs["BLOCK_H"] == block_h == {"gqa": 16, "mqa": 64, "moba": 16, "dsa": 16}[shape]
        assert [c.kwargs["BLOCK_N"] for c in fwd.configs] == [c.block_n for c in kernel_configs("fwd", 4, 96)]
        assert all(c.kwargs["SLOTS"] * 4 == c.kwargs["BLOCK_N"] for c in fwd.configs + dq.configs)  # gathered blocks
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in dkdv.configs] == \
            [(c.block_m, c.block_n) for c in kernel_configs("dkdv", 4, 96)]
        assert all(c.kwargs["BLOCK_N"] == 16 and c.kwargs["KEY_TILES"] == 1 for c in dkdv.configs)  # block padded to 16
        assert families(torch.bfloat16, 96, 4, True, shape) == (["query"] if shape == "mqa" else ["masked", "query"])
    key = example_calls(torch.bfloat16, 96, 64, True, "moba", "key")
    assert [c.name for c in key] == ["selection_key_fwd", "selection_key_merge", "selection_bwd_preprocess",
                                     "selection_key_bwd", "selection_key_dq_merge"]
    t = family_tiles("key", 64, 96, torch.bfloat16, 1)
    assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in key[0].configs} == {(t.block_m, t.block_n)}
    assert {(c.kwargs["BLOCK_M"], c.kwargs["KEY_TILES"]) for c in key[3].configs} == {(t.dkdv_m, t.key_tiles)}
