"""``sparse-io-attn bounds --pattern`` at a million tokens: exact Z_AXA, one torch thread for the
counting, and running out of memory as one line (exit 2), not a traceback."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sparse_io_attn.cli import bounds as bounds_cli
from sparse_io_attn.cli import main


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_million_token_sliding_window_z_axa_is_the_closed_form(causal, capsys):
    """|q - k| <= w keeps N (2w + 1) - w (w + 1) elements (rows near the ends lose w (w + 1) / 2 each
    side); with --causal, 0 <= q - k <= w keeps N (w + 1) - w (w + 1) / 2."""
    N, w = 1 << 20, 512
    argv = ["bounds", "--seq-len", "1M", "--head-dim", "64", "--pattern", f"sliding_window:{w}", "--json"]
    assert main(argv + (["--causal"] if causal else [])) == 0
    out = json.loads(capsys.readouterr().out)
    expect = N * (w + 1) - w * (w + 1) // 2 if causal else N * (2 * w + 1) - w * (w + 1)
    assert out["sparse"]["params"]["Z_AXA"] == expect
    assert out["sparse_informal"]["params"]["Z_QK"] == expect


def test_pattern_counts_run_on_one_thread_and_restore_it(monkeypatch):
    seen = []
    real = bounds_cli.qk_nnz
    monkeypatch.setattr(bounds_cli, "qk_nnz", lambda layout, causal: seen.append(torch.get_num_threads())
                        or real(layout, causal))
    before = torch.get_num_threads()
    layout, z = bounds_cli.pattern_counts("sliding_window:16", 256, 16, False)
    assert seen == [1] and torch.get_num_threads() == before
    assert z == 256 * 33 - 16 * 17 and layout.seqlen == (256, 256)


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory: you "
                                                             "tried to allocate 35651008 bytes")],
                         ids=["MemoryError", "allocator"])
def test_out_of_memory_is_one_line(exc, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr(bounds_cli.common, "build_layout", fail)
    assert main(["bounds", "--seq-len", "16M", "--head-dim", "64", "--pattern", "sliding_window:512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0] and "--block" in err[0] and "16,777,216" in err[0]


def test_other_runtime_errors_are_not_reported_as_memory(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("something else")
    monkeypatch.setattr(bounds_cli.common, "build_layout", fail)
    with pytest.raises(RuntimeError, match="something else"):
        main(["bounds", "--seq-len", "4k", "--head-dim", "64", "--pattern", "sliding_window:512"])


_UNDER_LIMIT = """
import resource, sys
import sparse_io_attn.cli as cli
import sparse_io_attn.dense.regime
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
cap = vm + (96 << 20)        # what is mapped now, plus less than the 16M-token layout needs
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
sys.exit(cli.main(["bounds", "--seq-len", "16M", "--head-dim", "64", "--pattern", "sliding_window:512"]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_address_space_limit_gives_one_line_not_a_traceback():
    """Under ``ulimit -v`` a little above what the imports map, a 16M-token pattern fails cleanly."""
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMIT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "out of memory" in lines[0] and "ulimit -v" in lines[0]
