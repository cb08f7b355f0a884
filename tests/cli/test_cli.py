"""The ``sparse-io-attn`` command end to end, in subprocesses, on tiny sizes: JSON output parses and
carries the right numbers, files appear, and bad input gives one line on stderr with exit code 2 and
no traceback."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sparse_io_attn import patterns
from sparse_io_attn.accounting import traffic
from sparse_io_attn.cli import SUBCOMMANDS, main

CLI = [sys.executable, "-m", "sparse_io_attn.cli"]


def run_cli(*args, env=None, cwd=None):
    full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=300)


def assert_clean_error(proc, code=2, words=()):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for w in words:
        assert w in lines[0], lines[0]


# ------------------------------------------------------------------------------ help and errors
@pytest.mark.parametrize("cmd", [c for c in SUBCOMMANDS if c != "demo"] + ["sweep cache", "sweep seq-len"])
def test_help_has_examples(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd.split() + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"sparse-io-attn {cmd.split()[0]}" in out


@pytest.mark.parametrize("argv, words", [
    (["bench", "--backends", "torch,cuda-magic"], ["cuda-magic", "cpu, torch, triton, sdpa, flex"]),
    (["bench", "--pass", "bwd-only"], ["--pass"]),
    (["bench", "--heads", "3", "--kv-heads", "2"], ["multiple"]),
    (["bench", "--dtype", "fp8"], ["--dtype"]),
    (["bench", "--seq-len", "-5"], ["-5"]),
    (["bench", "--json", "--csv"], ["stdout"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--cache", "1KiB", "--z-a", "5"], ["--z-x"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--pattern", "causal", "--z-a", "1", "--z-x", "1",
      "--z-ax", "1", "--z-axa", "1"], ["either"]),
    (["bounds", "--seq-len", "64", "--head-dim", "8", "--cache", "64", "--z-a", "1", "--z-x", "1",
      "--z-ax", "1", "--z-axa", "99999"], ["Z_AXA"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--device", "abacus"], ["abacus", "h100"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--z-input", "5"], ["--z-qk"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--z-input", "5", "--z-qk", "5", "--pattern", "causal"],
     ["--z-input"]),
    (["bounds", "--seq-len", "4096", "--head-dim", "64", "--cache", "12 parsecs"], ["12 parsecs"]),
    (["bounds", "--head-dim", "64"], ["--seq-len"]),
    (["layout", "no_such_pattern", "--seq-len", "256"], ["no_such_pattern"]),
    (["layout", "causal", "--seq-len", "many"], ["many"]),
    (["sweep", "seq-len", "--min-seq-len", "4k", "--max-seq-len", "1k"], ["--min-seq-len"]),
    (["sweep", "cache", "--m-min", "4096", "--m-max", "1024"], ["--m-min"]),
    (["sweep", "dim", "--dims", "64,abc"], ["--dims"]),
    (["sweep", "frobnicate"], ["frobnicate"]),
], ids=lambda v: "-".join(v) if isinstance(v, list) and v and isinstance(v[0], str) and v[0].startswith(
    ("bench", "bounds", "layout", "sweep")) else None)
def test_bad_input_is_one_line_exit_2(argv, words, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "Traceback" not in err[0], err
    for w in words:
        assert w in err[0], err[0]


def test_errors_in_a_subprocess_are_clean():
    assert_clean_error(run_cli("bounds", "--seq-len", "1k", "--head-dim", "64", "--causal"), words=["--causal"])


def test_missing_matplotlib_is_reported(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib blocked by the test')\n")
    proc = run_cli("layout", "causal", "--seq-len", "256", "--block", "64", "--png", tmp_path / "x.png",
                   env={"PYTHONPATH": str(tmp_path / "fake")})
    assert_clean_error(proc, code=3, words=["matplotlib", "plot"])
    assert not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------ bounds / layout
def test_bounds_json_numbers(capsys):
    n, d = 8192, 128
    assert main(["bounds", "--seq-len", "8k", "--head-dim", str(d), "--cache", "228KiB", "--dtype", "bf16",
                 "--pattern", "sliding_window:512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    M = 228 * 1024 // 2
    assert out["M_words"] == M and out["regime"].startswith("large")
    assert out["kernel_choice"].startswith("paper regime: large; kernel chosen: large-cache")
    assert out["kernels"]["backward"]["kernel"] == "large-fa2" and out["kernels"]["forward"]["kernel"] == "large"
    db = out["dense_backward"]
    assert db["terms"]["large_cache"] == pytest.approx((n * n * d * d + n * d ** 3) / M, rel=1e-12)
    assert db["terms"]["small_cache"] == pytest.approx((n * n * d + n * d * d) / M ** 0.5, rel=1e-12)
    lay = patterns.from_spec("sliding_window:512", seqlen=n, block_size=64)
    assert out["sparse"]["params"]["Z_AXA"] == traffic.kept_elements(lay, 1, 1)
    assert out["sparse"]["params"]["Z_A"] == n * d
    # a QK pattern's kept scores are outside Theorem 4.5's hypotheses: the record says so
    assert "not a proven lower bound" in out["sparse"]["note"]


def test_bounds_small_cache_regime_text(capsys):
    assert main(["bounds", "--seq-len", "8192", "--head-dim", "256", "--device", "a100", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "M = 41,728 words" in out and "small cache" in out
    # M = 0.64 d^2: here the small-cache backward is also the one that moves fewer bytes
    assert "backward: paper regime: small; kernel chosen: small-cache (Algorithm 6), 1.1x fewer bytes than " \
           "large-cache FA2 order" in out


def test_bounds_paper_regime_vs_kernel_chosen(capsys):
    """H100 fp32, d = 256: the paper's small-cache regime (M = 0.89 d^2), but auto runs the FA2-order
    large-cache backward, which moves 1.7x fewer bytes over all five gradients (2.0x on the dX path).
    The explicit-constant QK^T-product bounds appear only with --verbose, labelled as such."""
    assert main(["bounds", "--seq-len", "8192", "--head-dim", "256", "--device", "h100", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "backward: paper regime: small; kernel chosen: large-cache FA2 order, 1.7x fewer bytes than small-cache" in out
    assert "dX path alone: small-cache / best large-cache = 1.98" in out
    assert "Kwasniewski" not in out and "materialising" not in out and "E.10" not in out.split("arXiv")[-1]
    assert main(["bounds", "--seq-len", "8192", "--head-dim", "128", "--cache", "228KiB", "--dtype", "bf16",
                 "--verbose"]) == 0
    out = capsys.readouterr().out
    assert out.count("bound for materialising QK^T, not for attention [Kwasniewski 2019]: 1.174e+08 words") == 2
    assert "reduction" not in out                       # 0 words at M >= 4d^2: no line


def test_bounds_theorem_1_2(capsys):
    """Theorem 1.2 (Table 1's informal sparse bound) beside Theorem 4.5, and on its own."""
    assert main(["bounds", "--seq-len", "4096", "--head-dim", "64", "--cache", "116224", "--z-a", "262144",
                 "--z-x", "4096", "--z-ax", "262144", "--z-axa", "1048576", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    inf = out["sparse_informal"]
    assert inf["params"]["Z_input"] == 262144 and inf["params"]["Z_QK"] == 1048576
    assert inf["terms"]["large_cache"] == pytest.approx(262144 ** 2 / 116224)
    assert inf["crossover_M"] == pytest.approx(262144 ** 2 / 1048576) and "Theorem 1.2" in inf["theorem"]
    assert all(inf["terms"][k] <= out["sparse"]["terms"][k] for k in inf["terms"])
    assert main(["bounds", "--seq-len", "4096", "--head-dim", "64", "--cache", "116224", "--z-input", "262144",
                 "--z-qk", "1048576"]) == 0
    text = capsys.readouterr().out
    assert "Theorem 1.2" in text and "dividing point M = 65,536.0 words" in text and "Theorem 4.5 (= F.3" not in text


def test_layout_json_and_png(tmp_path):
    png = tmp_path / "bb.png"
    proc = run_cli("layout", "bigbird", "--seq-len", "1000", "--block", "64", "--png", png, "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    lay = patterns.from_spec("bigbird", seqlen=1000, block_size=64)
    assert stats["nnz_blocks"] == lay.nnz_blocks and stats["blocks"] == [16, 16]
    assert stats["kept_elements"] == traffic.kept_elements(lay, 1, 1)
    assert png.stat().st_size > 1000


def test_layout_picture(capsys):
    """█ full, ▒ partial (the window's edge cuts the block), ░ skipped."""
    assert main(["layout", "sliding_window:128", "--seq-len", "512", "--block", "64"]) == 0
    pic = [ln for ln in capsys.readouterr().out.splitlines() if ln and set(ln) <= {"█", "▒", "░"}]
    assert len(pic) == 8 and pic[0] == "██▒░░░░░" and pic[-1] == "░░░░░▒██"


def test_parser_does_not_import_the_kernels():
    """``--help`` and the parser stay light: Triton, the dense kernels and matplotlib load on use."""
    code = ("import sys; from sparse_io_attn.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('triton', 'matplotlib', 'sparse_io_attn.dense.triton', "
            "'sparse_io_attn.dense.api') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ bench
def test_bench_json_counted_traffic_and_skips(tmp_path):
    csv_path = tmp_path / "b.csv"
    proc = run_cli("bench", "--pattern", "sliding_window:32", "--seq-len", "96", "--heads", "2", "--kv-heads", "1",
                   "--head-dim", "16", "--block", "32", "--backends", "cpu,torch,triton,sdpa", "--repeats", "1",
                   "--warmup", "0", "--count", "--json", "--csv", csv_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["header"]["torch"] == torch.__version__ and out["header"]["dtype"] == "fp32"
    rows = {(r["backend"], r["pass"]): r for r in out["rows"]}
    assert set(rows) == {(b, p) for b in ("cpu", "torch", "triton", "sdpa") for p in ("fwd", "fwd+bwd")}
    from sparse_io_attn.block_sparse import cpu
    assert {rows[("cpu", p)]["status"] for p in ("fwd", "fwd+bwd")} == {"ok" if cpu.is_available() else "skipped"}
    lay = patterns.from_spec("sliding_window:32", seqlen=96, block_size=32)
    for p, predict in (("fwd", traffic.block_sparse_forward), ("fwd+bwd", traffic.block_sparse)):
        r = rows[("triton", p)]
        assert r["status"] == "ok" and r["traffic_source"] == "counted"
        assert r["traffic_bytes"] == predict(lay, 1, 2, 1, 16, torch.float32).total_bytes
        assert r["traffic_over_bound"] == pytest.approx(r["traffic_bytes"] / r["bound_bytes"])
        assert r["traffic_bytes"] >= r["bound_bytes"]
    for r in out["rows"]:
        assert r["median_ms"] > 0 and r["tflops"] > 0
    fl = traffic.block_sparse_flops(lay, 1, 2, 16)
    assert rows[("torch", "fwd")]["gflop"] == pytest.approx(fl / 1e9)
    assert csv_path.read_text().startswith("# device:")


def test_bench_skips_large_interpreter_runs(capsys):
    assert main(["bench", "--pattern", "dense", "--seq-len", "2048", "--heads", "8", "--head-dim", "64",
                 "--backends", "triton", "--pass", "fwd", "--json", "--no-progress"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["status"] == "skipped" and "--allow-interpreter" in row["reason"]


# ------------------------------------------------------------------------------ sweeps
def test_sweep_seq_len_files_and_refusal(tmp_path):
    proc = run_cli("sweep", "seq-len", "--min-seq-len", "384", "--max-seq-len", "384", "--heads", "2",
                   "--head-dim", "32", "--pattern", "sliding_window:64", "--repeats", "1",
                   "--device-memory", "2MiB", "--out-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (row,) = out["rows"]
    assert row["n"] == 384 and row["status"] == "ok" and row["fwd_bwd_s"] > 0 and row["peak_rss_mib"] > 0
    need = 2 * (3 * 384 * 384 + 32 * 384) * 4  # 2 heads x fp32 f, q, p (n x n) and T (d x n)
    assert row["small_cache"] == f"refused: needs {need:,} B > {2 * 2 ** 20:,} B"
    assert any("refused from n = 384" in note for note in out["notes"])
    for ext in ("csv", "png", "md"):
        assert (tmp_path / f"sweep_seq_len.{ext}").stat().st_size > 0


def test_sweep_cache_counted_equals_model(tmp_path):
    proc = run_cli("sweep", "cache", "--seq-len", "256", "--head-dim", "32", "--count-n", "32",
                   "--out-dir", tmp_path, "--json", "--no-plot")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["rows"]
    d = 32
    assert any(r["M"] == d * d for r in rows)
    counted = [(r[f"kernel_{k}_counted_at_count_n"], r[f"kernel_{k}_predicted_at_count_n"]) for r in rows
               for k in ("small", "large_fa2") if r.get(f"kernel_{k}_counted_at_count_n") is not None]
    assert counted and all(c == p for c, p in counted)
    fwd = [(r["kernel_fwd_small_counted_at_count_n"], r["kernel_fwd_small_predicted_at_count_n"]) for r in rows
           if r.get("kernel_fwd_small_counted_at_count_n") is not None]
    assert fwd and all(c == p for c, p in fwd)             # the small-cache forward kernel: counted == model
    assert any(note.startswith("forward: executor small-cache forward") for note in out["notes"])
    assert any("bisection" in note for note in out["notes"])
    runs = [(r[f"executor_{k}_run_at_count_n"], r[f"executor_{k}_closed_form_at_count_n"]) for r in rows
            for k in ("small", "large_faithful", "large_fa2") if r.get(f"executor_{k}_run_at_count_n") is not None]
    assert len(runs) >= len(rows) and all(a == b for a, b in runs)
    from sparse_io_attn.experiments import pebble
    for r in rows:
        assert r["bound"] == pytest.approx(min(r["bound_large_cache"], r["bound_small_cache"]))
        assert r["executor_small"] == pebble.small_cache_io(256, d, r["M"])
        assert r["executor_fwd_small"] == pebble.small_forward_io(256, d, r["M"])
    assert (tmp_path / "sweep_cache.csv").exists() and not (tmp_path / "sweep_cache.png").exists()


def test_sweep_dim(tmp_path):
    proc = run_cli("sweep", "dim", "--dims", "32,64", "--seq-len", "256", "--out-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    dev = [r for r in rows if r["at_device_M"]]
    assert [r["d"] for r in dev] == [32, 64] and all(r["regime"] == "large" for r in dev)
    from sparse_io_attn import dense
    for r in rows:   # the kernel auto runs at every point: choose_backward's argmin
        if r["auto_kernel"] is not None:
            assert r["auto_kernel"] == dense.choose_backward(256, r["d"], r["M"]).kernel
    assert (tmp_path / "sweep_dim.png").stat().st_size > 1000


def test_sweep_sparsity_passes_the_stress_rows_through(tmp_path):
    from sparse_io_attn.experiments import sparsity_stress
    proc = run_cli("sweep", "sparsity", "--seq-len", "256", "--head-dim", "32", "--densities", "0.25,1",
                   "--axes", "QK", "--out-dir", tmp_path, "--json", "--no-plot")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    want = sparsity_stress.sparsity_sweep(256, 32, densities=(0.25, 1.0), axes=("QK",))
    assert [(r["axis"], r["density"], r["Z_AXA"], r["bwd_words"]) for r in rows] == \
        [(r["axis"], r["density"], r["Z_AXA"], r["bwd_words"]) for r in want]
    assert all(r["bwd_ratio"] == pytest.approx(r["bwd_words"] / r["bound_words"]) for r in rows)
    assert (tmp_path / "sweep_sparsity.csv").exists()
