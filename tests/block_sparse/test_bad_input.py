"""The reliability table: every bad input, edge case or numerical stress an outside audit found
ends as a correct result or a clear error naming what was expected, what was got and the fix
(never a silent wrong answer, a crash or a raw traceback)."""
import functools
import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.cli import main as cli
from sparse_io_attn import plan
from sparse_io_attn.block_sparse import op

from helpers import BACKENDS, force_triton_configs, make_inputs, run


def _qkv(D=16, Hq=2, Hkv=2, N=64, B=1):
    return tuple(torch.randn(B, h, N, D, requires_grad=True) for h in (Hq, Hkv, Hkv))


def _layout(N=64):
    return patterns.sliding_window(N, 16, 16)


def _bad_index_layout():
    crow = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
    col = torch.tensor([0, -1, 2, 3], dtype=torch.int32)   # column -1: reads before k's storage
    return BlockSparseLayout(crow, col, block_size=16, seqlen=64, validate=False)


def _double_backward(backend):
    q, k, v = _qkv()
    out = block_sparse_attention(q, k, v, _layout(), backend=backend)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    return g


def _op_with_bad_indices():
    """A direct op call with a corrupted plan index that does not claim to be checked."""
    q, k, v = (t.detach() for t in _qkv())
    p = plan(_layout())
    index = p.index.clone()
    index[p.rows.full_idx.storage_offset() - p.index.storage_offset()] = 99   # key block 99 of 4
    meta = list(p.meta)
    meta[-1] = 0                                                               # checked: no
    return op.block_sparse_attn_fwd(q, k, v, index, meta, None, 0.25, "triton")


# every backend: the prologue refuses before any backend runs
ENTRIES = {backend: functools.partial(block_sparse_attention, backend=backend) for backend in BACKENDS}


def _with_sm_scale(entry, sm_scale):
    return entry(*_qkv(), _layout(), sm_scale=sm_scale)


def _with_sparse_q(entry, to_layout):
    q, k, v = (t.detach() for t in _qkv())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "sparse CSR support is in beta"
        q = to_layout(q)
    return entry(q, k, v, _layout())


BAD_SM_SCALES = [  # (value, exception, message, id)
    (1j, TypeError, r"sm_scale must be a real number .* got complex", "complex"),
    (np.complex64(0.3), TypeError, r"sm_scale must be a real number .* got complex64", "numpy-complex"),
    (True, TypeError, r"sm_scale must be a real number .* got bool", "bool"),
    (np.bool_(True), TypeError, r"sm_scale must be a real number .* got bool", "numpy-bool"),
    ("0.3", TypeError, r"sm_scale must be a real number .* got str", "string"),
    (torch.tensor([0.3]), TypeError, r"sm_scale as a tensor must be 0-d and real, got shape \(1,\)", "1d-tensor"),
    (torch.tensor(True), TypeError, r"sm_scale as a tensor must be 0-d and real, .* dtype torch.bool", "bool-tensor"),
    (torch.tensor(0.3j), TypeError, r"sm_scale as a tensor must be 0-d and real", "complex-tensor"),
    (np.float32("nan"), ValueError, r"sm_scale must be a finite number, got nan", "numpy-nan"),
    (torch.tensor(float("inf")), ValueError, r"sm_scale must be a finite number, got inf", "inf-tensor"),
]
SPARSE_LAYOUTS = [  # (conversion, layout name)
    (lambda t: t.to_sparse(), "sparse_coo"),
    (lambda t: t.to_sparse_csr(), "sparse_csr"),
    (lambda t: t.to_sparse_bsr((16, 16)), "sparse_bsr"),
]


def _flex(indices, nums):
    return BlockMask.from_kv_blocks(torch.tensor([[nums]], dtype=torch.int32),
                                    torch.tensor([[indices]], dtype=torch.int32), BLOCK_SIZE=16,
                                    seq_lengths=(32, 32), compute_q_blocks=False)


def _torch_bsr_bad_crow():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.sparse_bsr_tensor(torch.tensor([0, 1, 5]), torch.tensor([0, 1]), torch.ones(2, 4, 4),
                                    size=(8, 8), check_invariants=False)
    return BlockSparseLayout.from_torch_bsr(t)


BAD = [
    pytest.param(lambda: block_sparse_attention(*_qkv(), _layout(), sm_scale=float("nan")), ValueError,
                 "sm_scale must be a finite number", id="sm_scale-nan"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _layout(), sm_scale=float("inf"), backend="triton"),
                 ValueError, "sm_scale must be a finite number", id="sm_scale-inf-triton"),
    pytest.param(lambda: _double_backward("triton"), NotImplementedError, "double backward", id="double-backward-triton"),
    pytest.param(lambda: _double_backward("torch"), NotImplementedError, "double backward", id="double-backward-torch"),
    pytest.param(lambda: _double_backward("cpu"), NotImplementedError, "double backward", id="double-backward-cpu"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _layout(), sm_scale=float("-inf"), backend="cpu"),
                 ValueError, "sm_scale must be a finite number", id="sm_scale-minus-inf-cpu"),
    pytest.param(lambda: BlockSparseLayout.from_flex_block_mask(_flex([[0, -1], [1, 0]], [2, 1])), ValueError,
                 r"kv_indices\[0, 0, 0, 1\] = -1 is one of the 2 blocks", id="flex-counted-minus-one"),
    pytest.param(lambda: BlockSparseLayout.from_flex_block_mask(_flex([[0, 9], [1, 0]], [2, 1])), ValueError,
                 r"= 9 .* outside \[0, 2\)", id="flex-index-past-last-block"),
    pytest.param(lambda: patterns.from_spec("longformer:g=5000", 128, 16), ValueError,
                 "global_tokens = 5000 exceeds the sequence length 128", id="longformer-too-many-globals"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _bad_index_layout(), backend="triton"), ValueError,
                 r"col_indices must lie in \[0, 4\)", id="negative-column-validate-false"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _bad_index_layout(), backend="torch"), ValueError,
                 r"col_indices must lie in \[0, 4\)", id="negative-column-torch"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _bad_index_layout(), backend="cpu"), ValueError,
                 r"col_indices must lie in \[0, 4\)", id="negative-column-cpu"),
    pytest.param(_op_with_bad_indices, ValueError, r"block indices must lie in \[0, 4\)", id="custom-op-bad-indices"),
    pytest.param(lambda: patterns.sliding_window(2 ** 21, 1, window=2 ** 20), ValueError,
                 "GiB is available", id="pattern-too-large-for-memory"),
    pytest.param(lambda: block_sparse_attention(*_qkv(D=0), _layout()), ValueError, "head_dim 0", id="head-dim-0"),
    pytest.param(lambda: block_sparse_attention(*_qkv(Hq=0, Hkv=1), _layout(), backend="torch"), ValueError,
                 "num_heads_q 0", id="zero-query-heads"),
    pytest.param(lambda: block_sparse_attention(*_qkv(B=0), _layout()), ValueError, "batch 0", id="zero-batch"),
    pytest.param(lambda: _layout().to("meta"), ValueError, "cannot live on the 'meta' device", id="layout-to-meta"),
    pytest.param(_torch_bsr_bad_crow, ValueError, "crow_indices", id="torch-bsr-inconsistent-crow"),
    pytest.param(lambda: block_sparse_attention(*_qkv(), _layout(), causal="diagonal"), ValueError,
                 "causal must be one of", id="causal-unknown-mode"),
    pytest.param(lambda: _layout().rows(10, 5), ValueError, r"0 <= start < stop <= seqlen_q", id="rows-empty-range"),
]


BAD += [pytest.param(functools.partial(_with_sm_scale, entry, value), exc, match, id=f"sm_scale-{name}-{where}")
        for value, exc, match, name in BAD_SM_SCALES for where, entry in ENTRIES.items()]
BAD += [pytest.param(functools.partial(_with_sparse_q, entry, to_layout), TypeError,
                     rf"q has layout torch.{name}; .* pass q.to_dense\(\)", id=f"q-{name}-{where}")
        for to_layout, name in SPARSE_LAYOUTS for where, entry in ENTRIES.items()]


@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_raises_clearly(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("argv,message", [
    pytest.param(["bench", "--seq-len", "256", "--backends", "torch", "--pass", "fwd", "--json", "/proc/x/a.json"],
                 "--json /proc/x/a.json cannot be written", id="bench-json-unwritable"),
    pytest.param(["bench", "--seq-len", "256", "--backends", "torch", "--pass", "fwd", "--csv", "/proc/x/a.csv"],
                 "--csv /proc/x/a.csv cannot be written", id="bench-csv-unwritable"),
    pytest.param(["layout", "dense", "--seq-len", "64", "--block", "16", "--png", "/proc/x/a.png"],
                 "--png /proc/x/a.png cannot be written", id="layout-png-unwritable"),
    pytest.param(["bench", "--seq-len", "10000000", "--backends", "torch"], "GiB is available",
                 id="bench-huge-seq-len"),
    pytest.param(["layout", "sliding_window", "--seq-len", "1M", "--block", "1"], "GiB is available",
                 id="layout-huge-grid"),
    pytest.param(["demo", "--seq-len", "1M"], "dense float64 reference", id="demo-huge-seq-len"),
    pytest.param(["sweep", "cache", "--out-dir", "/proc/x/y", "--no-plot"], "--out-dir /proc/x/y cannot be written",
                 id="sweep-out-dir-unwritable"),
])
def test_cli_refuses_up_front(capsys, argv, message):
    """One line on stderr, exit code 2, before any work is done (the checks run first)."""
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-2), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "fp16", "bf16"])
def test_dv_exact_at_large_logits(monkeypatch, backend, dtype, tol):
    """Logits ~1e6 (q, k scaled by 1e3): backward recomputes P exactly as the forward did (row
    maximum and log2 row sum kept apart), so dV stays accurate (was 7e-2 in fp32 on the torch path).
    Triton's dK/dV in its EXACT score form (the forward's ``q @ k^T`` transposed: the fp32 default; in
    bf16/fp16 an autotuning candidate beside the direct ``k @ q^T``, whose bound is
    benchmarks/results/extreme_logits.md)."""
    if backend == "triton":
        from sparse_io_attn.block_sparse import tiles

        def exact_first(kernel, *args):
            found = tiles.kernel_configs(kernel, *args)
            return [c for c in found if c.exact_scores] if kernel == "dkdv" else found
        force_triton_configs(monkeypatch, exact_first)
    layout = patterns.sliding_window(64, 16, window=16)
    q, k, v, do = make_inputs(1, 2, 2, 64, 64, 16)
    q, k = q * 1e3, k * 1e3
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    got = run(q, k, v, do, layout, False, backend=backend)
    ref = attention_reference(q, k, v, layout, do=do)
    assert rel_err(got[0], ref[0]) <= tol and rel_err(got[4], ref[4]) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sm_scale", [pytest.param(np.float32(0.3), id="numpy-float32"),
                                      pytest.param(np.float64(0.3), id="numpy-float64"),
                                      pytest.param(np.int64(1), id="numpy-int64"),
                                      pytest.param(1, id="python-int"),
                                      pytest.param(torch.tensor(0.3), id="tensor-0d-float32"),
                                      pytest.param(torch.tensor(1, dtype=torch.int32), id="tensor-0d-int32")])
def test_real_scalar_sm_scale_accepted(backend, sm_scale):
    """Any finite real scalar is a softmax scale: the result is the float64 reference's at float(sm_scale)."""
    layout = patterns.sliding_window(48, 16, window=16)
    q, k, v, do = make_inputs(1, 2, 1, 48, 48, 16)
    got = run(q, k, v, do, layout, True, backend=backend, sm_scale=sm_scale)
    ref = attention_reference(q, k, v, layout, causal=True, sm_scale=float(sm_scale), do=do)
    for g, r in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert rel_err(g, r) <= 1e-5
