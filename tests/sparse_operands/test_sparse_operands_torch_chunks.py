"""The torch path runs large batched score tensors in chunks of ``(batch, head)`` groups
(``torch_path.SCORE_CHUNK_BYTES``): with the budget forced down to one group, to a few heads, and to
whole batch elements, outputs, lse and gradients equal the float64 reference (masks per batch and
head, empty rows, no mask) and the unchunked call."""
import pytest
import torch

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.sparse_operands import torch_path
from sparse_io_attn.sparse_operands.reference import attention_reference

from test_sparse_operands_batched import assert_grads_close, make_batched, run


@pytest.mark.parametrize("groups", [1, 2, 4, 6])  # B = 2, H = 3: one group, parts of heads, whole elements
@pytest.mark.parametrize("qk", [None, "per-batch-head", "per-head"])
def test_chunked_torch_path_matches_reference(monkeypatch, groups, qk):
    ops, layout, do = make_batched(2, 3, 37, 29, 16, 8, 8, x="list", y="dense", qk=qk, empty_rows=1, seed=groups)
    whole = run(ops, layout, 0.5, do, "torch")
    monkeypatch.setattr(torch_path, "SCORE_CHUNK_BYTES", groups * 37 * 29 * 4)
    parts = torch_path._chunks(torch_path.Batch(2, 3, True), groups)
    assert len(parts) == (1 if groups >= 6 else -(-2 // (groups // 3)) if groups >= 3 else 2 * -(-3 // groups))
    o, lse, grads = run(ops, layout, 0.5, do, "torch")
    ref_o, ref_lse, ref_g = attention_reference(*ops, qk_layout=layout, scale=0.5, do=do)
    assert o.shape == (2, 3, 37, 8) and not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    assert_grads_close(grads, ref_g, 1e-4)
    assert torch.allclose(o, whole[0], atol=1e-6) and torch.equal(torch.isfinite(lse), torch.isfinite(whole[1]))
