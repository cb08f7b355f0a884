"""benchmarks/bench_selection.py --quick in-process (about a second): every shape and kv-head count
gives a finite row, the block-sparse baselines keep exactly the selections' (query, key) pairs,
and the files land where --out says."""
import json
import math

import pytest
import torch

from helpers import load_benchmark
from sparse_io_attn.selection import cpu


pytestmark = pytest.mark.skipif(not cpu.is_available(), reason=f"CPU kernel unavailable: {cpu.unavailable_reason()}")


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_selection")


def test_quick_run(bench, tmp_path):
    threads = torch.get_num_threads()
    assert bench.main(["--quick", "--threads", "1", "--out", str(tmp_path / "sel")]) == 0
    assert torch.get_num_threads() == threads                  # restored
    data = json.loads((tmp_path / "sel.json").read_text())
    assert (tmp_path / "sel.md").read_text().startswith("# selection_attention")
    header, rows = data["header"], data["rows"]
    assert header["load_avg_at_start"] and header["load_avg_at_end"] and header["sgemm_gflops"] > 0
    assert [(r["shape"], r["Hkv"]) for r in rows] == [(s, h) for s in ("moba", "nsa", "dsa") for h in (2, 8)]
    for r in rows:
        for key in ("plan_ms", "ours_fwd_ms", "ours_fwdbwd_ms", "sdpa_fwdbwd_ms", "x_sdpa", "gflops"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["shape"], key, r[key])
        if r["shape"] != "dsa":
            assert r["pairs_M"] == pytest.approx(r["block_sparse_pairs_M"], abs=0)
            assert math.isfinite(r["x_block_sparse"])
        assert "SDPA" in r["targets"]


def test_selections_follow_their_recipes(bench):
    g = torch.Generator().manual_seed(0)
    moba = bench.moba_indices(g, 2, 256, 64, 3)                 # [G, N, top_k]
    t = torch.arange(256)
    assert torch.equal(moba[:, :, 0], (t // 64).expand(2, 256))
    rest = moba[:, :, 1:]
    assert ((rest < (t // 64)[None, :, None]) | (rest == -1)).all()
    nsa = bench.nsa_indices(g, 1, 256, 64, 4)
    assert (nsa[..., 0] == 0).all() and torch.equal(nsa[0, :, 1], t // 64)
    dsa = bench.dsa_indices(g, 300, 64, local=16)[0]
    for row in (0, 63, 64, 299):
        picked = dsa[row][dsa[row] >= 0]
        assert len(set(picked.tolist())) == picked.numel() == min(row + 1, 64)
        assert (picked <= row).all() and row in picked.tolist()
