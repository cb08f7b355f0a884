"""The dK/dV kernel takes a kept query block in slices of ``BLOCK_M_SUB`` rows above head dim 64
(:func:`~sparse_io_attn.sparse_operands.triton.configs.dkv_query_slice`): outputs and gradients
still match the float64 reference, counted traffic equals the model (each slice reads its block's row
id and Q block-map row once more, nothing else), and the multiply-adds executed equal the model.
Cases: 64-row query blocks at head dim 96 (3 d-tiles, 2 slices), a last query block whose second
slice lies wholly past the end, block-sparse operands with absent d-tiles, a QK layout with an empty
row, batched with per-head X."""
import pytest
import torch

from sparse_io_attn import sparse_operands
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.sparse_operands.reference import OPERANDS
from sparse_io_attn.sparse_operands.triton.configs import dkv_query_slice

from test_sparse_operands_attention import count_dot_macs, make_case, reference, run
from test_sparse_operands_batched import assert_grads_close, make_batched
from test_sparse_operands_batched import run as run_batched


@pytest.mark.parametrize("nq,nk,dens,qk_d,empty", [
    pytest.param(80, 48, (None, None, None), None, 0, id="dense-last-slice-past-end"),
    pytest.param(128, 64, (0.6, 0.5, 0.7), 0.7, 1, id="sparse-absent-d-tiles-empty-row"),
])
def test_sliced_dkv_matches_reference_and_models(nq, nk, dens, qk_d, empty):
    from sparse_io_attn.sparse_operands.flops import ATTENTION_KERNELS, predict_dot_macs

    d = 96
    assert 64 // dkv_query_slice(64, d) == 2
    ops, qk, do = make_case(nq, nk, d, d, 32, 32, 64, 16, 32, dens, qk_d, seed=nq + nk, empty_rows=empty)
    with count_dot_macs() as macs:
        o, lse, grads, counted = run(ops, qk, 0.3, do, "triton")
    ref_o, ref_lse, ref_g = reference(ops, qk, 0.3, do)
    assert not torch.isnan(o).any() and rel_err(o, ref_o) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) < 1e-5
    for name in OPERANDS:
        assert not torch.isnan(grads[name]).any(), name
        assert rel_err(grads[name], ref_g[name]) < 1e-5, (name, rel_err(grads[name], ref_g[name]))
    A1, A2, A3, X, Y = ops
    predicted = sparse_operands.predict_traffic(A1, A2, A3, X, Y, qk_layout=qk)
    assert counted == predicted, f"\n{counted}\n{predicted}"
    if INTERPRET:
        model = predict_dot_macs(A1, A2, A3, X, Y, qk_layout=qk)
        for k in ATTENTION_KERNELS:
            assert macs.get(k, 0) == model[k], (k, dict(macs), model)


def test_sliced_dkv_batched_per_head_x():
    """B = 2, H = 2, per-head block-sparse X at head dim 96 with 64-row blocks: one launch per kernel,
    reference and model."""
    from sparse_io_attn.accounting import IOCounter
    from sparse_io_attn.sparse_operands.reference import attention_reference
    from sparse_io_attn.sparse_operands.traffic import predict_traffic

    ops, qk, do = make_batched(2, 2, 72, 64, 96, 16, 64, x="list", y="dense", qk=None, seed=11)
    with IOCounter() as io:
        o, lse, grads = run_batched(ops, qk, 0.3, do, "triton")
    ref_o, _, ref_g = attention_reference(*ops, qk_layout=qk, scale=0.3, do=do)
    assert rel_err(o, ref_o) < 1e-5
    assert_grads_close(grads, ref_g, 1e-4)
    assert io.report == predict_traffic(*ops, qk_layout=qk)
