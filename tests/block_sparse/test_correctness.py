"""Every backend against the float64 reference with the *element* mask: outputs, lse and all three
gradients on fresh random inputs, block-level and element-exact layouts (partial blocks), causal in
both alignments, GQA, per-head/per-batch masks, ragged lengths, rectangular blocks, empty rows,
low precision against a same-precision baseline, determinism. One matrix, parametrised over the
backends (``triton`` runs through Triton's interpreter on CPU: cases stay at a few hundred tiles)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from sparse_io_attn import BlockSparseLayout, patterns
from sparse_io_attn._triton.runtime import INTERPRET
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask

from helpers import BACKENDS, check_close, check_repeatable, check_within_baseline, make_inputs, make_layout, run

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def _cpu_kernel_present(request):
    """The C++ backend runs on CPU tensors, and only where it could be built (a C++ compiler)."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "cpu":
        from sparse_io_attn.block_sparse import cpu
        if DEVICE != "cpu":
            pytest.skip("backend 'cpu' takes CPU tensors; this run uses CUDA tensors")
        if not cpu.is_available():
            pytest.skip(f"the C++ kernel cannot be built here: {cpu.unavailable_reason()}")


def elem_layout(B, Hq, Nq, Nk, block, *, p=0.5, per_head=False, per_batch=False, empty_rows=(),
                partial_only_rows=()):
    """A random element mask with structure (whole blocks kept, dropped, or thinned) as an exact
    layout; ``empty_rows``: query positions with nothing allowed; ``partial_only_rows``: query
    positions whose only allowed keys sit in partial blocks (every other element of their blocks
    removed)."""
    bq, bk = (block, block) if isinstance(block, int) else block
    lead = ((B,) if per_batch else ()) + ((Hq,) if per_head else ())
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    blocks = torch.rand(*lead, nqb, nkb) < p
    thin = torch.rand(*lead, nqb, nkb) < 0.5
    expand = lambda m: m.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :Nq, :Nk]  # noqa: E731
    elem = expand(blocks) & (~expand(thin) | (torch.rand(*lead, Nq, Nk) < 0.4))
    for i in empty_rows:
        elem[..., i, :] = False
    for i in partial_only_rows:
        elem[..., i, :] = False
        elem[..., i, (i * 7) % Nk] = True   # one key, in a block that other rows keep partly
    if per_batch and not per_head:
        elem = elem[:, None]
    return BlockSparseLayout.from_dense_mask(elem, block)


def check_backend(backend, layout, B, Hq, Hkv, D, causal, tol=1e-5, sm_scale=None):
    Nq, Nk = layout.seqlen
    q, k, v, do = make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE if backend == "triton" else "cpu")
    got = run(q, k, v, do, layout, causal, backend=backend, sm_scale=sm_scale)
    ref = attention_reference(q, k, v, layout, causal=causal, do=do, sm_scale=sm_scale)
    check_close(got, ref, tol)
    return got


# (B, Hq, Hkv, Nq, Nk, D, block, causal, layout options): block-level layouts
BLOCK_CASES = [
    pytest.param(2, 2, 2, 128, 128, 64, 64, False, {}, id="B2-H2-N128-D64-b64"),
    pytest.param(1, 2, 2, 203, 203, 48, 32, True, {}, id="N203-D48-causal-ragged"),
    pytest.param(1, 2, 1, 100, 170, 80, 32, False, {}, id="Nq100-Nk170-D80-gqa"),
    pytest.param(1, 2, 2, 170, 100, 32, 32, True, {}, id="Nq170-Nk100-causal"),
    pytest.param(1, 2, 2, 96, 160, 32, (16, 32), True, {}, id="rect-block16x32-causal"),
    pytest.param(1, 2, 2, 130, 96, 32, (32, 16), False, {}, id="rect-block32x16-ragged"),
    pytest.param(1, 1, 1, 256, 250, 32, 128, True, {"density": 0.8}, id="block128-larger-than-tile-causal"),
    pytest.param(2, 4, 4, 96, 96, 32, 16, False, {"per_head": True}, id="per-head"),
    pytest.param(3, 2, 2, 96, 96, 32, 16, True, {"per_batch": True}, id="per-batch-causal"),
    pytest.param(2, 3, 1, 80, 80, 32, 16, True, {"per_batch": True, "per_head": True}, id="mqa-per-batch-head"),
    pytest.param(2, 8, 2, 128, 128, 32, 32, False, {}, id="gqa8-2"),
    pytest.param(1, 4, 2, 96, 112, 16, 16, True, {"per_head": True}, id="gqa4-2-per-head-causal"),
    pytest.param(2, 4, 1, 100, 100, 32, 32, True, {}, id="mqa4-1-causal-ragged"),
    pytest.param(1, 2, 2, 128, 128, 32, 32, True, {"fill": True}, id="all-dense-causal"),
    pytest.param(1, 2, 2, 128, 128, 32, 32, False, {"empty_rows": (0, 2)}, id="empty-rows"),
    pytest.param(1, 2, 1, 128, 96, 32, 32, True, {"empty_rows": (1,)}, id="empty-rows-gqa-causal"),
    pytest.param(1, 2, 2, 100, 90, 32, 128, True, {"fill": True}, id="block128-longer-than-seqlen-causal"),
    pytest.param(1, 2, 2, 100, 100, 32, 32, False, {"fill": True}, id="all-dense-ragged"),
    pytest.param(2, 2, 1, 64, 96, 32, 32, False, {"fill": False}, id="all-empty"),
    pytest.param(1, 1, 1, 64, 64, 200, 32, True, {"fill": True}, id="D200-dense-causal"),
    pytest.param(1, 1, 1, 48, 48, 16, 16, False, {"fill": True}, id="D16-block16-dense"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,block,causal,opts", BLOCK_CASES)
def test_block_layouts(backend, B, Hq, Hkv, Nq, Nk, D, block, causal, opts):
    check_backend(backend, make_layout(B, Hq, Nq, Nk, block, **opts), B, Hq, Hkv, D, causal)


# element-exact layouts: partial blocks everywhere
ELEM_CASES = [
    pytest.param(lambda: patterns.document([0, 100, 300, 512], 64), False, id="document-unaligned"),
    pytest.param(lambda: patterns.document([0, 100, 300, 512], 64, causal=True), False, id="document-causal"),
    pytest.param(lambda: patterns.document([0, 37, 37, 90, 150], (32, 16), causal=True), True,
                 id="document-causal-rect-block-empty-doc+causal"),
    pytest.param(lambda: patterns.sliding_window(300, 64, 45), False, id="window-w45"),
    pytest.param(lambda: patterns.sliding_window(300, 32, 45, causal=True), False, id="window-w45-causal"),
    pytest.param(lambda: patterns.sliding_window((90, 230), 32, 20), "bottom_right", id="window-bottom-right-Nq<Nk"),
    pytest.param(lambda: patterns.prefix_lm(200, 32, 45), False, id="prefix-lm"),
    pytest.param(lambda: patterns.longformer(256, 64, 20, [3, 100]), False, id="longformer-global-tokens"),
    pytest.param(lambda: patterns.dense((60, 150), 32), "bottom_right", id="bottom-right-Nq<Nk"),
    pytest.param(lambda: patterns.dense((150, 60), 32), "bottom_right", id="bottom-right-Nq>Nk-empty-rows"),
    pytest.param(lambda: patterns.dense((150, 60), 32), True, id="top-left-Nq>Nk"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,causal", ELEM_CASES)
def test_element_exact_patterns(backend, make, causal):
    layout = make()
    assert layout.num_partial_blocks > 0 or causal
    check_backend(backend, layout, 1, 2, 2, 32, causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,block,causal,opts", [
    pytest.param(1, 2, 2, 96, 96, 32, False, {}, id="square"),
    pytest.param(1, 2, 1, 80, 130, (16, 32), "bottom_right", {}, id="Nq<Nk-rect-block-bottom-right"),
    pytest.param(1, 2, 2, 130, 80, (32, 16), True, {}, id="Nq>Nk-causal"),
    pytest.param(2, 4, 2, 64, 64, 16, False, {"per_head": True, "per_batch": True}, id="per-batch-head-gqa"),
    pytest.param(3, 2, 2, 64, 80, 32, True, {"per_batch": True}, id="per-batch-causal"),
    pytest.param(1, 2, 2, 96, 96, 32, False, {"empty_rows": (5, 40), "partial_only_rows": (7, 50, 51)},
                 id="empty-and-partial-only-rows"),
    pytest.param(1, 1, 1, 100, 100, 64, True, {"p": 1.0, "empty_rows": (0,)}, id="dense-thinned-causal"),
])
def test_random_element_masks(backend, B, Hq, Hkv, Nq, Nk, block, causal, opts):
    layout = elem_layout(B, Hq, Nq, Nk, block, **opts)
    assert layout.num_partial_blocks > 0
    got = check_backend(backend, layout, B, Hq, Hkv, 32, causal)
    mask = element_mask(layout, B, Hq, Nq, Nk, causal=causal)
    empty = ~mask.any(-1)
    assert torch.isneginf(got[1][empty]).all() and (got[0][empty] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_flex_mask_mod_through_from_flex_block_mask(backend):
    """An element-level mask_mod (documents + sliding window) through FlexAttention's own
    create_block_mask: our layout computes exactly the mask_mod's elements."""
    doc = torch.tensor([0] * 50 + [1] * 77 + [2] * 65)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & ((q_idx - kv_idx).abs() <= 40)

    bm = create_block_mask(mask_mod, None, None, 192, 192, device="cpu", BLOCK_SIZE=32)
    layout = BlockSparseLayout.from_flex_block_mask(bm)
    q_idx, kv_idx = torch.arange(192)[:, None], torch.arange(192)[None, :]
    assert torch.equal(layout.to_dense_mask()[0, 0], mask_mod(0, 0, q_idx, kv_idx))
    check_backend(backend, layout, 1, 2, 2, 32, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [16, 48, 64, 80, 128, 256])
def test_head_dims(backend, D):
    layout = make_layout(1, 2, 96, 96, 32, density=0.6)
    check_backend(backend, layout, 1, 2, 2, D, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_inputs_and_sm_scale(backend):
    layout = elem_layout(2, 4, 96, 96, 32)
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v, do = (torch.randn(2, 96, h, 32, device=dev).transpose(1, 2) for h in (4, 2, 2, 4))
    got = run(q, k, v, do, layout, True, backend=backend, sm_scale=0.3)
    check_close(got, attention_reference(q, k, v, layout, causal=True, sm_scale=0.3, do=do))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_deterministic(backend):
    layout = elem_layout(1, 4, 128, 128, 32, per_head=True)
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v, do = make_inputs(1, 4, 1, 128, 128, 32, device=dev)
    check_repeatable(lambda: run(q, k, v, do, layout, True, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_vs_same_precision_baseline(backend, dtype, causal):
    """flash-attention's rule: error vs float64 at most 2x (outputs) / 3x (gradients) the error of
    plain PyTorch attention with the same element mask, run in the same dtype."""
    B, Hq, Hkv, N, D = 1, 4, 2, 150, 64
    layout = elem_layout(B, Hq, N, N, 32, per_head=True)
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v, do = make_inputs(B, Hq, Hkv, N, N, D, dtype=dtype, device=dev)
    out, lse, dq, dk, dv = run(q, k, v, do, layout, causal, backend=backend)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    ref = attention_reference(q, k, v, layout, causal=causal, do=do)
    mask = element_mask(layout, B, Hq, N, N, causal=causal, device=q.device)
    check_within_baseline((out, lse, dq, dk, dv), ref, q, k, v, do, mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_out_blocks_never_read(backend):
    """Blocks the layout does not keep are never read: NaN there reaches no output or gradient."""
    layout = patterns.document([0, 70, 128], 32, causal=True)
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v, do = make_inputs(1, 2, 2, 128, 128, 32, device=dev)
    k[:, :, 100:] = float("nan")      # keys 100.. sit in block 3, which block rows 0-1 do not keep
    v[:, :, 100:] = float("nan")
    out, lse, dq, dk, dv = run(q, k, v, do, layout, False, backend=backend)
    assert torch.isfinite(out[:, :, :64]).all() and torch.isfinite(dq[:, :, :64]).all()
    assert torch.isfinite(dk[:, :, :64]).all() and torch.isfinite(dv[:, :, :64]).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_random_element_masks(data):
    """Random element masks and shapes: the torch backend equals the float64 reference, and the
    layout round-trips to exactly the mask."""
    bq, bk = data.draw(st.sampled_from([4, 8, 16])), data.draw(st.sampled_from([4, 8, 16, 32]))
    nq, nk = data.draw(st.integers(1, 70)), data.draw(st.integers(1, 70))
    p = data.draw(st.floats(0.0, 1.0))
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, nq, nk, generator=g) < p
    layout = BlockSparseLayout.from_dense_mask(mask, (bq, bk))
    assert torch.equal(layout.to_dense_mask()[0], mask)
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    check_backend("torch", layout, 1, 2, 1, 8, causal)


EXTREME = [pytest.param(1e5, None, id="logits-1e10"), pytest.param(1.0, 1e30, id="sm_scale-1e30"),
           pytest.param(1e5, 1e30, id="past-fp32-range")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sm_scale", [1e6, 1e9, 1e12])
@pytest.mark.parametrize("layout_name,D", [("window-causal", 24), ("bigbird", 32)])
def test_finite_gradients_at_any_sm_scale(backend, layout_name, D, sm_scale):
    """``sm_scale`` alone up to 1e12 (logits ~1e12, not past the fp32 range): finite outputs, lse and
    gradients on every backend (at such logits an ulp of a score is ~1e5, so a backward that recomputes
    a score with another tile's rounding may land above the forward's row maximum: its probability is
    capped at 1, not 2^ulp). Each output row stays a convex combination of value rows."""
    q, k, v, do = make_inputs(1, 4, 2, 70, 70, D, device=DEVICE if backend == "triton" else "cpu")
    causal = layout_name == "window-causal"
    layout = patterns.sliding_window(70, 16, 24, causal=True) if causal else patterns.bigbird(70, 16)
    got = run(q, k, v, do, layout, causal, backend=backend, sm_scale=sm_scale)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert torch.isfinite(x).all(), f"non-finite {name} on {backend} at sm_scale {sm_scale:g}"
    assert got[0].abs().max() <= v.abs().max() * (1 + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout_name", ["dense", "window-causal"])
@pytest.mark.parametrize("scale,sm_scale", EXTREME)
def test_finite_inputs_give_finite_results_at_extreme_logits(backend, layout_name, scale, sm_scale):
    """Finite inputs give finite outputs, lse and gradients on every backend, whatever the logits'
    size: scores past the fp32 range saturate, and the row maximum is subtracted exactly as the
    forward formed it. Each output row stays a convex combination of value rows."""
    q, k, v, do = make_inputs(1, 2, 1, 40, 40, 16, device=DEVICE if backend == "triton" else "cpu")
    q, k = q * scale, k * scale
    causal = layout_name == "window-causal"
    layout = patterns.dense(40, 16) if not causal else patterns.sliding_window(40, 16, 20, causal=True)
    got = run(q, k, v, do, layout, causal, backend=backend, sm_scale=sm_scale)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert torch.isfinite(x).all(), f"non-finite {name} on {backend}"
    assert got[0].abs().max() <= v.abs().max() * (1 + 1e-6)
