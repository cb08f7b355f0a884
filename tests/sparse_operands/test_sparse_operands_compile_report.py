"""The sparse-operand kernels compiled for sm_90 (Hopper) without a GPU, as the launchers launch them
(``compile-report --op sparse-operands``): no register spills, every main loop's operand tiles
copied asynchronously (software-pipelined), tensor-core products, shared memory within an H100
block, and each per-tile product behind its own runtime branch (absent tiles: no FLOPs on the
compiled path either). Each report runs the command in a fresh process: this one imported Triton in
interpreter mode."""

import pytest

from helpers import compile_report

LOOPED = ("paper_q", "paper_h", "paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "paper_da1",
          "paper_dx", "paper_da3", "paper_dy")


def _report(tmp_path, cases) -> dict:
    """``{(dtype, head_dim): rows}`` of ``sparse-io-attn compile-report --op sparse-operands --json``
    for ``cases`` (dtype name, head dim), each in a fresh process."""
    out = {}
    for dtype, head_dim in cases:
        report = compile_report(tmp_path, "--op", "sparse-operands", "--dtype", dtype, "--head-dim", str(head_dim),
                                timeout=500)
        assert (report["op"], report["head_dim"], report["block"]) == ("sparse-operands", head_dim, 64)
        out[(dtype, head_dim)] = report["rows"]
    return out


@pytest.mark.slow
def test_kernels_pipelined_without_spills_at_head_dims_64_and_128(tmp_path):
    # bf16 at 64 and fp16 at 128 (the two dtypes compile alike: benchmarks/results/compile_report_sm90.md
    # has all four combinations)
    out = _report(tmp_path, [("bf16", 64), ("fp16", 128)])
    for (dtype, head_dim), rows in out.items():
        by_name = {r["kernel"]: r for r in rows}
        assert set(by_name) == set(LOOPED) | {"paper_attn_bwd_preprocess"}, by_name
        for r in rows:
            where = (dtype, head_dim, r["kernel"])
            assert r["spill_stores"] == r["spill_loads"] == 0, (where, r)
            assert 0 < r["shared_bytes"] <= 227 * 1024, (where, r)  # fits an H100 block
            if r["kernel"] in LOOPED:
                assert r["pipelined"] and r["tile_async"] > 0, (where, r)
        n_tiles = head_dim // 32
        for name in ("paper_attn_fwd", "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "paper_q", "paper_da1"):
            assert by_name[name]["wgmma"] > 0, (dtype, head_dim, by_name[name])  # Hopper tensor-core MMAs
        # one runtime branch per d-tile per product over the head dimension: S (all three attention
        # kernels), dA2 += dS^T Q (dkv) and dQ += dS A2 (dq); one per column tile of C in a product
        assert by_name["paper_attn_fwd"]["scf_if"] == n_tiles, by_name
        assert by_name["paper_attn_bwd_dkv"]["scf_if"] == 2 * n_tiles, by_name
        assert by_name["paper_attn_bwd_dq"]["scf_if"] == 2 * n_tiles, by_name
        assert by_name["paper_q"]["scf_if"] == n_tiles, by_name
        # the dK/dV kernel takes the query block in 32-row slices above head dim 64
        assert by_name["paper_attn_bwd_dkv"]["BLOCK_M"] == 64


def test_recorded_launches_cover_one_forward_and_backward():
    """The report compiles what the launchers launch: driving them under ``recording()`` on CPU
    tensors records every kernel of a forward + backward once, with the launch configuration and
    nothing run (the interpreter is not entered)."""
    from sparse_io_attn.sparse_operands.triton.configs import LAUNCH
    from sparse_io_attn.sparse_operands.triton.report import KERNELS, example_calls

    import torch

    calls = example_calls(torch.bfloat16, 96)
    assert [c.name for c in calls] == ["paper_q", "paper_h", "paper_attn_fwd", "paper_attn_bwd_preprocess",
                                      "paper_attn_bwd_dkv", "paper_attn_bwd_dq", "paper_da1", "paper_dx",
                                      "paper_da3", "paper_dy"]
    assert set(c.name for c in calls) == set(KERNELS)
    for c in calls:
        key = c.name if c.name in LAUNCH else "matmul"
        assert (c.kwargs["num_warps"], c.kwargs["num_stages"]) == LAUNCH[key], c.name
        assert c.kwargs["COUNT_IO"] is False
    dkv = next(c for c in calls if c.name == "paper_attn_bwd_dkv")
    assert dkv.kwargs["BLOCK_M"] == 64 and dkv.kwargs["BLOCK_M_SUB"] == 32  # head dim 96: 32-row slices
    assert dkv.kwargs["NUM_D_TILES"] == 3 and dkv.kwargs["LOOP_STAGES"] == LAUNCH["paper_attn_bwd_dkv"][1]
