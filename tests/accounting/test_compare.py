"""compare(): measured or predicted traffic against max(compulsory, bound)."""
import pytest
import torch

import sparse_io_attn.bounds as B
from sparse_io_attn.accounting import TrafficReport
from sparse_io_attn.accounting.compare import Comparison, compare


def _report(source="counted"):
    r = TrafficReport(source)
    r.add("attn_bwd_dkdv", {"q": 3_000_000, "k": 1_000_000, "do": 2_500_000}, {"dk": 1_000_000})
    r.add("attn_bwd_dq", {"q": 1_000_000}, {"dq": 1_250_000})
    return r


def test_compare_counted_report_bound_binds():
    b = B.dense_backward(1024, 64, 1024, dtype=torch.float16)          # small cache (M < d^2)
    c = compare(_report(), b)
    assert isinstance(c, Comparison)
    assert (c.source, c.dtype, c.measured_bytes) == ("counted", "float16", 9_750_000)
    assert (c.bytes_read, c.bytes_written) == (7_500_000, 2_250_000)
    assert c.bound_bytes == 2 * b.value_words and c.compulsory_bytes == 2 * b.compulsory_words
    assert c.binds == "bound" and c.floor_bytes == c.bound_bytes
    assert c.ratio_to_bound == 9_750_000 / c.bound_bytes
    assert c.ratio_to_compulsory == 9_750_000 / c.compulsory_bytes
    assert c.ratio_to_floor == c.ratio_to_bound


def test_compare_predicted_and_plain_bytes_compulsory_binds():
    b = B.dense_backward(4096, 128, 116224)                             # REFERENCES.md case
    c = compare(_report("predicted"), b, dtype=torch.bfloat16)
    assert c.source == "predicted" and c.binds == "compulsory"
    assert c.floor_bytes == 2 * (8 * 4096 * 128 + 4096)
    plain = compare(12_345_678, b, dtype="fp32")
    assert plain.source == "given" and plain.bytes_read is None and plain.compulsory_bytes == 4 * b.compulsory_words
    assert plain.ratio_to_floor == 12_345_678 / plain.floor_bytes


def test_compare_table_and_dict():
    b = B.dense_backward(2048, 64, "100KiB", dtype=torch.bfloat16)
    c = compare(_report(), b)
    text = str(c)
    for needle in ("measured (counted)", "compulsory", "large_cache term", "floor", "binds"):
        assert needle in text
    assert "Kwasniewski" not in text                       # product bounds only on request, with their scope
    assert "Kwasniewski" in c.table(verbose=True) and "not for attention" in c.table(verbose=True)
    d = c.to_dict()
    assert d["measured_bytes"] == 9_750_000 and d["binds"] == c.binds and d["bound"]["regime"] == "large"
    sp = compare(5000, B.sparse(100, 10, 80, 900, 64, n=100, d=10), dtype="fp32")
    assert "explicit" not in str(sp) and sp.compulsory_bytes == 4 * (200 + 10 + 1000)


def test_compare_errors():
    b = B.dense_backward(64, 8, 64)
    with pytest.raises(ValueError, match="dtype"):
        compare(100, b)
    with pytest.raises(TypeError, match="TrafficReport"):
        compare(1.5, b, dtype="fp32")
    with pytest.raises(ValueError, match="negative"):
        compare(-1, b, dtype="fp32")
    with pytest.raises(TypeError, match="Bound"):
        compare(100, {"value": 1}, dtype="fp32")
