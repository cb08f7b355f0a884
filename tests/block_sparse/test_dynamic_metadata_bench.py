"""benchmarks/dynamic_metadata.py at a tiny size: the rows are well formed, FlexAttention's two
constructors select exactly the layout's blocks, and the files are written where --out says."""
import math

import pytest
import torch

from helpers import load_benchmark
from sparse_io_attn import patterns


@pytest.fixture
def dm(monkeypatch):
    return load_benchmark(monkeypatch, "dynamic_metadata")


def test_rows_at_a_tiny_size(dm):
    threads = torch.get_num_threads()
    header, rows = dm.bench([(256, 1, 2, 2)], repeats=1, meta_calls=1, threads=1, log=lambda s: None)
    assert torch.get_num_threads() == threads                  # restored
    assert header["threads"] == 1 and header["nproc"] >= 1
    assert header["load_avg_at_start"] and header["load_avg_at_end"]
    (row,) = rows
    assert (row["N"], row["B"], row["H"], row["BH"], row["k"]) == (256, 1, 2, 2, 2)
    # 4 query blocks, causal: row 0 has one eligible block, rows 1..3 keep k = 2 each
    assert row["kept_blocks"] == 2 * (1 + 3 * 2)
    times = ["selection_ms", "schedule_ms", "metadata_ms", "fwd_ms", "fwdbwd_ms", "ours_kv_sched_ms",
             "flex_kv_ms", "flex_create_ms", "metadata_1t_ms", "ours_kv_sched_1t_ms", "flex_kv_1t_ms"]
    for key in times:
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["metadata_ms"] == pytest.approx(row["selection_ms"] + row["schedule_ms"])
    assert row["meta_pct_fwd"] == pytest.approx(100 * row["metadata_ms"] / row["fwd_ms"])
    assert row["meta_pct_fwdbwd"] == pytest.approx(100 * row["metadata_ms"] / row["fwdbwd_ms"])
    assert row["metadata_1t_ms"] == pytest.approx(row["selection_1t_ms"] + row["schedule_1t_ms"])
    assert row["target"] == row["target_1t"] == "-"          # the target applies from N = 8192 on
    assert row["flex_checked"] is True and row["rounds"] == 1 and row["meta_samples"] == 1


@pytest.mark.parametrize("B,H,N,k", [(1, 2, 256, 2), (2, 3, 200, 3), (1, 1, 130, 3)],
                         ids=["B1-H2-N256-k2", "B2-H3-N200-k3", "B1-H1-N130-k3-all"])
def test_flex_masks_select_the_layouts_blocks(dm, B, H, N, k):
    M = math.ceil(N / dm.BLOCK)
    layout = patterns.topk(torch.randn(B, H, M, M), k, dm.BLOCK, N, causal=True)
    idx = dm.kv_lists(layout, k)
    assert idx.shape == (B, H, M, k) and idx.dtype == torch.int32
    ref = layout.to_block_mask()
    listed = torch.zeros(B, H, M, M + 1, dtype=torch.bool)
    listed.scatter_(-1, torch.where(idx >= 0, idx, M).long(), True)
    assert torch.equal(listed[..., :M], ref)
    assert torch.equal(dm.flex_from_kv_blocks(idx, N).to_dense().bool(), ref)
    assert torch.equal(dm.flex_create_block_mask(idx, N).to_dense().bool(), ref)


def test_main_writes_the_results_where_out_says(dm, tmp_path):
    stem = tmp_path / "dm"
    assert dm.main(["--grid", "256:1:2:2", "--repeats", "1", "--meta-calls", "1", "--no-flex", "--threads", "1",
                    "--out", str(stem)]) == 0
    md, csv = stem.with_suffix(".md").read_text(), stem.with_suffix(".csv").read_text()
    assert "load average" in md and "metadata ms" in md and "nproc" in md
    columns = next(ln for ln in csv.splitlines() if not ln.startswith("#")).split(",")
    assert "# load_avg_at_end:" in csv and {"selection_ms", "schedule_ms", "fwdbwd_ms"} <= set(columns)


def test_target_note(dm):
    assert dm.target_note(4096, 50.0) == "-"
    assert dm.target_note(8192, 5.0) == "met" and dm.target_note(8192, 5.01) == "NOT met"


def test_bad_grid_point(dm):
    with pytest.raises(SystemExit):
        dm.parse_args(["--grid", "256:1:2:9"])   # 9 > the 4 key blocks of N=256
