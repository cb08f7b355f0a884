"""benchmarks/bench_gpu_selection.py --plans-only on CPU (what the GPU session's call checks beforehand): every
shape at every N asked gets a row with the family each of --families runs, its exact-model bytes per kept
pair and the plan's wall time, and no kernel is launched; and benchmarks/selection_bytes.py's rows."""
import json

from helpers import load_benchmark


def test_gpu_bench_dry_run(monkeypatch, capsys, tmp_path):
    bench = load_benchmark(monkeypatch, "bench_gpu_selection")
    out = tmp_path / "rows.jsonl"
    bench.main(["--plans-only", "--parts", "selection", "metadata", "--n", "256", "512", "--heads", "4", "--kv-heads",
                "2", "--d", "32", "--jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["shape"], r["N"]) for r in rows] == [(s, n) for n in (256, 512) for s in ("moba", "nsa", "dsa")]
    for r in rows:
        assert "error" not in r and r["plan_ms"] > 0 and r["query_family"] == "query"
        assert r["auto_family"] == {"moba": "key", "nsa": "key", "dsa": "masked"}[r["shape"]]
        assert 0 < r["auto_bytes_per_pair"] < r["query_bytes_per_pair"]
        assert not any(k.endswith("_ms") and k != "plan_ms" for k in r)        # nothing timed
    assert "metadata" not in capsys.readouterr().out                             # a dry run skips that part


def test_selection_bytes_rows(monkeypatch, tmp_path):
    script = load_benchmark(monkeypatch, "selection_bytes")
    assert script.main(["--n", "512", "--heads", "4", "--kv-heads", "2", "--d", "32", "--out", str(tmp_path / "b")]) == 0
    text = (tmp_path / "b.md").read_text()
    assert text.startswith("# Bytes per kept pair") and text.count("met (<= 3x)") + text.count("NOT met") == 3
