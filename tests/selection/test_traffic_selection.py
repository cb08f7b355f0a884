"""The selection traffic model predicts exactly the bytes the Triton kernels count (exact integer
equality; the forward of these ``Nq <= 16`` cases runs the decode kernels unless ``decode=False``
asks for the prefill kernel, counted too), its pair count is the reference mask's, and
``accounting.compare`` sets a counted selection call against Theorem 1.2 for that count."""
import math

import pytest
import torch

from sparse_io_attn import selection_attention
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.accounting import IOCounter, compare, selection_bound, traffic
from sparse_io_attn.bounds import sparse_informal
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.plan import plan_selection
from sparse_io_attn.selection.reference import selection_mask
from sparse_io_attn.selection.triton import launch, launch_families

DEVICE = "cpu" if INTERPRET else "cuda"


def make_plan(B, G, Nq, Nk, bs, K, causal, *, shared=False, counts=False):
    nkb = math.ceil(Nk / bs)
    idx = torch.randint(-1, nkb, (G, Nq, K) if shared else (B, G, Nq, K), device=DEVICE)
    if K > 1:
        idx[..., 1] = idx[..., 0]                                  # repeats
    cnt = torch.randint(0, K + 1, idx.shape[:-1], device=DEVICE) if counts else None
    sel = Selection(idx, bs, cnt)
    return sel, plan_selection(sel, Nk, causal_offset=causal_offset(causal, Nq, Nk))


CASES = [  # (B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts, dtype)
    pytest.param(1, 4, 2, 1, 8, 20, 16, 1, 5, True, True, False, torch.float32, id="G1-bs1-top_left"),
    pytest.param(2, 4, 2, 2, 7, 22, 24, 4, 3, False, False, True, torch.bfloat16, id="Ghkv-bs4-ragged-counts-bf16"),
    pytest.param(1, 2, 1, 2, 6, 100, 16, 64, 2, "bottom_right", False, False, torch.float16,
                 id="Ghq-bs64-ragged-bottom_right-fp16"),
    pytest.param(1, 2, 2, 2, 9, 30, 16, 3, 4, True, True, True, torch.float32, id="mha-bs3-lanes-counts"),
    pytest.param(1, 2, 1, 1, 12, 8, 16, 2, 3, "bottom_right", False, False, torch.float32,
                 id="bottom_right-Nq>Nk-empty-rows"),
    pytest.param(1, 2, 2, 2, 5, 150, 16, 48, 3, True, False, False, torch.float32, id="bs48-steps-per-block"),
    pytest.param(1, 2, 1, 1, 4, 230, 16, 100, 2, "bottom_right", True, False, torch.float32, id="bs100-ragged-tiles"),
    pytest.param(1, 32, 1, 1, 4, 12, 16, 4, 2, True, True, False, torch.float32, id="32-heads-rows-past-BLOCK_M"),
]


@pytest.mark.parametrize("B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts, dtype", CASES)
def test_counted_equals_predicted(B, Hq, Hkv, G, Nq, Nk, D, block, K, causal, shared, counts, dtype):
    _, plan = make_plan(B, G, Nq, Nk, block, K, causal, shared=shared, counts=counts)
    q, do = (torch.randn(B, Hq, Nq, D, device=DEVICE, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Nk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    with IOCounter() as fwd_io:
        out, _, stats = launch.forward(q, k, v, plan, sm_scale=D ** -0.5)
    with IOCounter() as bwd_io:
        launch.backward(do, q, k, v, out, stats, plan, sm_scale=D ** -0.5)
    args = (plan, B, Hq, Hkv, D, dtype)
    want_fwd, want_bwd = traffic.selection_forward(*args), traffic.selection_backward(*args)
    assert fwd_io.report == want_fwd, f"{fwd_io.report}\n{want_fwd}"
    assert bwd_io.report == want_bwd, f"{bwd_io.report}\n{want_bwd}"
    assert set(want_fwd.kernels) <= {"selection_decode", "selection_decode_merge"}   # (Nq <= 16: decode kernels)
    with IOCounter() as pre_io:   # the prefill forward
        launch.forward(q, k, v, plan, sm_scale=D ** -0.5, decode=False)
    assert pre_io.report == traffic.selection_forward(*args, decode=False), pre_io.report
    # a training step through the op (inputs requiring a gradient): a 16-bit forward writes its rounding
    # residual (and runs the prefill kernels), the preprocess reads it: traffic.selection's step
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with IOCounter() as step_io:
        out = selection_attention(*leaves, plan, causal=causal, sm_scale=D ** -0.5, backend="triton")
        out.backward(do)
    assert step_io.report == traffic.selection(*args), f"{step_io.report}\n{traffic.selection(*args)}"
    if dtype != torch.float32:
        assert step_io.report.kernels["selection_bwd_preprocess"].reads["residual"] == out.numel() * out.element_size()


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("G, shared, counts", [(1, True, False), (2, False, True), (4, False, False)])
def test_pairs_are_the_reference_mask(causal, G, shared, counts):
    B, Hq, Nq, Nk, bs = 2, 4, 13, 29, 3
    sel, plan = make_plan(B, G, Nq, Nk, bs, 5, causal, shared=shared, counts=counts)
    mask = selection_mask(sel, B, Hq, Nk, causal=causal)
    assert traffic.selection_pairs(plan, B, Hq) == int(mask.sum())
    assert traffic.selection_flops(plan, B, Hq, 64, backward=True) == 10 * 64 * int(mask.sum())


def test_model_closed_form_at_scale():
    """Every token selects every causally alive block (causal dense attention as a selection) at
    N = 8192, G = 1, without running a kernel: the query-major forward reads each allowed key once per
    tile of R = Hq / Hkv heads, k bytes = B * Hkv * N (N + 1) / 2 * D * e; dK/dV reads each key once; the
    key-major forward (what "auto" runs) reads each block once per tile of gathered tokens."""
    B, Hq, Hkv, N, D, bs = 1, 8, 2, 8192, 64, 64
    nkb = N // bs
    idx = torch.arange(nkb).expand(1, N, nkb)
    plan = plan_selection(Selection(idx, bs), N, causal_offset=0)
    fwd = traffic.selection_forward(plan, B, Hq, Hkv, D, torch.bfloat16, family_name="query")
    pairs = N * (N + 1) // 2
    assert traffic.selection_pairs(plan, B, Hq) == B * Hq * pairs
    R = Hq // Hkv
    assert fwd.kernels["selection_fwd"].reads["k"] == B * (Hq // R) * pairs * D * 2
    bwd = traffic.selection_backward(plan, B, Hq, Hkv, D, torch.bfloat16, family_name="query")
    assert bwd.kernels["selection_bwd_dkdv"].reads["k"] == B * Hkv * N * D * 2
    # each (token, block) pair gathers the token's R heads once (one 64-key tile per block)
    token_blocks = sum(t // bs + 1 for t in range(N))
    assert bwd.kernels["selection_bwd_dkdv"].reads["q"] == B * Hkv * R * token_blocks * D * 2
    # key-major ("auto" here): block c is read once per tile of 64 // R tokens of the N - 64 c that chose it;
    # every (token, block) pair writes and the merge reads one fp32 partial (m, l, acc) per head
    key = traffic.selection_forward(plan, B, Hq, Hkv, D, torch.bfloat16)
    tile_tokens = 64 // R
    reads = sum(-(-(N - c * bs) // tile_tokens) for c in range(nkb)) * bs
    assert key.kernels["selection_key_fwd"].reads["k"] == B * (Hq // R) * reads * D * 2
    assert key.kernels["selection_key_merge"].reads["partial"] == B * Hq * token_blocks * (2 + D) * 4
    key_bwd = traffic.selection_backward(plan, B, Hq, Hkv, D, torch.bfloat16)
    assert key_bwd.kernels["selection_key_bwd"].writes["partial"] == B * Hq * token_blocks * D * 4
    assert key_bwd.kernels["selection_key_bwd"].reads["q"] == bwd.kernels["selection_bwd_dkdv"].reads["q"]


def test_compare_against_theorem_1_2():
    B, Hq, Hkv, N, D, bs = 1, 4, 2, 16, 16, 4
    sel, plan = make_plan(B, 2, N, N, bs, 3, True)
    q, do = (torch.randn(B, Hq, N, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, device=DEVICE) for _ in range(2))
    with IOCounter() as io:
        out, _, stats = launch.forward(q, k, v, plan, sm_scale=D ** -0.5)
        launch.backward(do, q, k, v, out, stats, plan, sm_scale=D ** -0.5)
    bound = selection_bound(plan, B, Hq, D, "16KiB", dtype=torch.float32)
    pairs = int(selection_mask(sel, B, Hq, N, causal=True).sum())
    assert bound.params["Z_input"] == N * D and bound.params["Z_QK"] * B * Hq == pairs and bound.heads == B * Hq
    z_qk = bound.params["Z_QK"]
    assert bound.value_words == sparse_informal(N * D, z_qk, "16KiB", dtype=torch.float32, n=N, d=D,
                                                heads=B * Hq).value_words
    c = compare(io.report, bound)
    predicted = traffic.selection(plan, B, Hq, Hkv, D, torch.float32)
    assert c.measured_bytes == io.report.total_bytes == predicted.total_bytes
    assert c.compulsory_bytes == 4 * B * Hq * (N * D + N * D)      # inputs once + the n x d output, per head
    assert c.ratio_to_floor >= 1
    with pytest.raises(TypeError, match="SelectionPlan"):
        selection_bound(sel, B, Hq, D, "16KiB")


def test_model_follows_the_launched_tiles(monkeypatch):
    """Other tiles (what autotuning may pick on CUDA): the model given ``launch.launched_tiles()``
    still predicts the counts exactly (key steps of 16 over 40-key blocks: 3 steps, the last
    ragged; dK/dV row tiles of 16 for 32 gathered rows per token)."""
    from sparse_io_attn.selection.tiles import SelectionConfig

    def configs(kernel, block_size, head_dim, dtype):
        return [SelectionConfig(0, 16, 4, 2)] if kernel != "dkdv" else [SelectionConfig(16, 64, 4, 2)]

    monkeypatch.setattr(launch, "kernel_configs", configs)
    monkeypatch.setattr(launch_families, "kernel_configs", configs)
    B, Hq, Hkv, Nq, Nk, D = 1, 32, 1, 4, 90, 16
    _, plan = make_plan(B, 1, Nq, Nk, 40, 3, "bottom_right", shared=True)
    q, do = (torch.randn(B, Hq, Nq, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Nk, D, device=DEVICE) for _ in range(2))
    with IOCounter() as io:
        out, _, stats = launch.forward(q, k, v, plan, sm_scale=D ** -0.5, decode=False)   # (autotuned: prefill)
        launch.backward(do, q, k, v, out, stats, plan, sm_scale=D ** -0.5)
    tiles = launch.launched_tiles()
    assert tiles.fwd == (32, 16) and tiles.dkdv == (16, 64)
    args = (plan, B, Hq, Hkv, D, torch.float32)
    fwd = traffic.selection_forward(*args, tiles=tiles, decode=False)
    assert io.report == fwd + traffic.selection_backward(*args, tiles=tiles)
    default = traffic.selection_forward(*args, decode=False) + traffic.selection_backward(*args)
    assert io.report != default   # the default tiles differ
