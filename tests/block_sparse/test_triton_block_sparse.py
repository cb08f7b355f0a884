"""backend="triton" specifics (the shared correctness matrix is in test_correctness.py): clear
errors for unsupported shapes, agreement with the torch backend, every autotuning candidate of the
backward kernels against float64 and the traffic model."""
import pytest
import torch

from sparse_io_attn import block_sparse_attention, patterns
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask, rel_err
from sparse_io_attn.block_sparse.tiles import kernel_configs
from sparse_io_attn.block_sparse.triton import launch

import helpers
from helpers import check_close, check_repeatable, check_within_baseline, force_triton_configs, make_inputs, run

DEVICE = "cpu" if INTERPRET else "cuda"  # the same tests run compiled where CUDA is in use
# The bf16/fp16 candidates forced below run in fp32 under the interpreter (its 16-bit dot is wrong) and
# in bf16 compiled: a bf16 configuration's tiles in fp32 can exceed a Hopper block's shared memory.
CANDIDATE_DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def make_layout(*args, density=0.6, empty_row=False, **kw):
    """Random layouts with the diagonal kept in every row (and the middle row emptied)."""
    nqb = -(-args[2] // (args[4] if isinstance(args[4], int) else args[4][0]))
    return helpers.make_layout(*args, density=density, diagonal=True,
                               empty_rows=(nqb // 2,) if empty_row else (), **kw)


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, Dv=None):
    return make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device=DEVICE, Dv=Dv)


def run_triton(q, k, v, do, layout, causal):
    return run(q, k, v, do, layout, causal, backend="triton")


def test_unsupported_shapes_raise_clear_errors():
    q, k, v, _ = inputs(1, 1, 1, 64, 64, 32)
    layout8 = make_layout(1, 1, 64, 64, 8)
    with pytest.raises(NotImplementedError, match="power-of-two divisor"):
        block_sparse_attention(q, k, v, layout8, backend="triton")
    q, k, v, _ = inputs(1, 1, 1, 32, 32, 580)
    with pytest.raises(NotImplementedError, match="head_dim"):
        block_sparse_attention(q, k, v, make_layout(1, 1, 32, 32, 32), backend="triton")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_agrees_with_torch_backend(causal):
    B, Hq, Hkv, N, D = 2, 4, 2, 140, 48
    layout = make_layout(B, Hq, N, N, 32, per_head=True, empty_row=True)
    q, k, v, do = inputs(B, Hq, Hkv, N, N, D)
    tri = run_triton(q, k, v, do, layout, causal)
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(qt, kt, vt, layout, causal=causal, return_lse=True, backend="torch")
    out.backward(do)
    tor = (out.detach(), lse, qt.grad, kt.grad, vt.grad)
    assert torch.equal(torch.isneginf(tri[1]), torch.isneginf(tor[1]))
    fin = torch.isfinite(tor[1])
    tri, tor = (tri[0], tri[1][fin]) + tri[2:], (tor[0], tor[1][fin]) + tor[2:]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tri, tor):
        assert rel_err(a, b) <= 2e-5, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits_stay_finite(causal):
    """Scores past the fp32 range (|q.k| * sm_scale ~ 1e40) saturate instead of becoming inf, so the
    row maximum's subtraction never gives inf - inf = NaN: outputs, lse and gradients are finite and
    each output row is a convex combination of v rows (full and partial tiles, forward and backward)."""
    q, k, v, do = make_inputs(1, 1, 1, 40, 40, 16, device=DEVICE)
    q, k = q * 1e5, k * 1e5
    out, lse, dq, dk, dv = run(q, k, v, do, patterns.dense(40, 16), causal, backend="triton", sm_scale=1e30)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"non-finite {name}"
    assert out.abs().max() <= v.abs().max()


def _candidate(kind, config, D, Dv):
    form = {None: "", False: "-direct", True: "-exact"}[config.exact_scores]
    dims = f"d{D}" if Dv == D else f"d{D}-dv{Dv}"
    return pytest.param(kind, config, D, Dv, id=f"{kind}-{dims}-{config.block_m}x{config.block_n}-w{config.num_warps}"
                                               f"s{config.num_stages}{form}")


# every candidate of the bf16/fp16 tables, layout blocks of 128: dK/dV (128-key tiles in both score
# forms) at head dims 64 (EVEN_D) and 80 (padded to 128) with V's head dim 48 (its own, padded to 64:
# the tiles of the larger), dQ (128-query tiles) at 64
CANDIDATES = [_candidate(kind, c, D, Dv) for kind, dims in (("dkdv", ((64, 64), (80, 48))), ("dq", ((64, 64),)))
              for D, Dv in dims for c in kernel_configs(kind, (128, 128), max(D, Dv), torch.bfloat16)]


def check_candidate(got, q, k, v, do, layout, causal):
    """fp32: against float64 at 1e-5; bf16 (compiled): flash-attention's low-precision rule."""
    ref = attention_reference(q, k, v, layout, causal=causal, do=do)
    if q.dtype == torch.float32:
        check_close(got, ref, 1e-5)
    else:
        B, Hq, Nq, _ = q.shape
        mask = element_mask(layout, B, Hq, Nq, k.shape[2], causal=causal, device=q.device)
        check_within_baseline(got, ref, q, k, v, do, mask)


def force_configs(monkeypatch, **chosen):
    """The launcher runs ``chosen[kernel]`` for each kernel named, the bf16 default for the others."""
    def configs(kernel, block_size, head_dim, dtype):
        return [chosen[kernel] if kernel in chosen else kernel_configs(kernel, block_size, head_dim, torch.bfloat16)[0]]
    force_triton_configs(monkeypatch, configs)


@pytest.mark.parametrize("kind,config,D,Dv", CANDIDATES)
def test_every_backward_candidate(monkeypatch, kind, config, D, Dv):
    """Each autotuning candidate forced (fp32 inputs under the interpreter, bf16 compiled; the other
    kernels at their bf16 defaults): gradients against float64, and the counted bytes equal the model at
    the launched tiles. A causal sliding window over 200 tokens in blocks of 128 (ragged last block, full blocks,
    element-masked partial blocks), two query heads on one KV head; dK/dV runs its partial blocks at
    PART_M query rows."""
    force_configs(monkeypatch, **{kind: config})
    layout = patterns.sliding_window(200, 128, 150)
    assert layout.num_partial_blocks > 0 and layout.nnz_blocks > layout.num_partial_blocks
    B, Hq, Hkv = 1, 2, 1
    q, k, v, do = inputs(B, Hq, Hkv, 200, 200, D, CANDIDATE_DTYPE, Dv)
    with IOCounter() as io:
        got = run_triton(q, k, v, do, layout, True)
    check_candidate(got, q, k, v, do, layout, True)
    tiles = launch.launched_tiles()
    assert getattr(tiles, kind) == (config.block_m, config.block_n)
    assert io.report == traffic.block_sparse(layout, B, Hq, Hkv, D, CANDIDATE_DTYPE, causal=True, tiles=tiles,
                                             head_dim_v=Dv)


@pytest.mark.parametrize("causal", [True, "bottom_right"], ids=["top-left", "bottom-right"])
def test_default_backward_at_128_key_tiles_is_deterministic(monkeypatch, causal):
    """The default dK/dV and dQ configurations at head dim 64 (64 x 128 direct-form dK/dV tiles, 128 x
    64 dQ tiles), rectangular and ragged: backward twice gives equal bits, and agrees with float64."""
    dkdv, dq = (kernel_configs(kind, (128, 128), 64, torch.bfloat16)[0] for kind in ("dkdv", "dq"))
    assert (dkdv.block_m, dkdv.block_n, dkdv.exact_scores, dkdv.part_m, dq.block_m) == (64, 128, False, 32, 128)
    force_configs(monkeypatch)
    layout = make_layout(1, 2, 200, 330, 128, per_head=True)
    q, k, v, do = inputs(1, 2, 1, 200, 330, 64, CANDIDATE_DTYPE)
    first = check_repeatable(lambda: run_triton(q, k, v, do, layout, causal))
    check_candidate(first, q, k, v, do, layout, causal)
