"""backend="triton"'s host path (issue 46 point 2): after the first call of a key the launches run
from their cached, prepared form (:func:`sparse_io_attn._attention.triton.launch.run_calls`). They must
be the launches the call description makes (same kernel, grid, arguments; this call's tensors, never
an earlier call's), read nothing back from the device, keep counting and recording on the counted
path, and compute the same results whatever changes between calls (scale, strides, layout, causal).
The kernels are stubbed by ``benchmarks/host_overhead.py``'s ``stubbed_launches`` (the benchmark's own
stub) where only the launches are checked."""
import importlib.util
import pathlib

import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns, plan
from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn._attention.triton import launch as kit
from sparse_io_attn._triton import runtime
from sparse_io_attn._triton.runtime import INTERPRET

from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.block_sparse.triton import launch

import helpers

DEVICE = "cpu" if INTERPRET else "cuda"
BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def stubbed_launches():
    spec = importlib.util.spec_from_file_location("host_overhead", BENCHMARKS / "host_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.stubbed_launches


def _step(q, k, v, do, layout, causal, sm_scale=None):
    """One forward+backward through the public API: ``(out, dq, dk, dv)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, causal=causal, sm_scale=sm_scale, backend="triton")
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _named(record) -> list:
    """``(kernel name, grid, {argument: value})`` per recorded launch, tensors as (shape, stride, dtype)."""
    def plain(v):
        return (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v
    return [(kernel.__name__, tuple(grid), {n: plain(v) for n, v in args.items() if n != "io_ptr"})
            for kernel, grid, args in record]


def test_cached_launches_are_the_described_calls_with_this_calls_tensors(stubbed_launches):
    B, Hq, Hkv, N, D = 1, 4, 2, 96, 32
    layout = helpers.make_layout(B, Hq, N, N, 32, per_head=True, diagonal=True).to(DEVICE)
    q, k, v, do = helpers.make_inputs(B, Hq, Hkv, N, N, D, device=DEVICE)
    record: list = []
    with stubbed_launches(record):
        _step(q, k, v, do, layout, True)        # builds, tunes (stubbed timer) and keeps the launches
        record.clear()
        p = plan(layout, causal=True)           # the plan the call found (cached on the layout)
        qq, kk, vv = (t.clone() for t in (q, k, v))
        out, _, stats = launch.forward(qq, kk, vv, p, sm_scale=D ** -0.5)
        dq_, dk_, dv_ = launch.backward(do, qq, kk, vv, out, stats, p, sm_scale=D ** -0.5)
        with runtime.recording() as recorded:   # recording still sees every launch, on the counted path
            _step(q, k, v, do, layout, True)
    assert len(record) == 4 and [r.name for r in recorded] == ["attn_fwd", "attn_bwd_preprocess",
                                                                "attn_bwd_dkdv", "attn_bwd_dq"]
    # what the call descriptions say, with the configuration autotuning picked (the stubbed timer
    # times every configuration alike: the first)
    fwd_call, o, _, s = launch.forward_calls(q, k, v, p, D ** -0.5)
    described = [fwd_call] + launch.backward_calls(do, q, k, v, o, s, p, D ** -0.5)[0]
    for (kernel, grid, args), call in zip(record, described):
        config = call.configs[0]
        want = dict(call.kwargs, **config.all_kwargs())
        assert kernel is call.kernel and tuple(grid) == tuple(call.grid(want) if callable(call.grid) else call.grid)
        got = _named([(kernel, grid, args)])[0][2]
        assert {n: got[n] for n in want} == _named([(kernel, grid, want)])[0][2], call.name
    fwd, pre, dkdv, dq = (args for _, _, args in record)
    # this call's tensors, not the first call's: the inputs, and the outputs the call returned
    assert fwd["q_ptr"] is qq and fwd["k_ptr"] is kk and fwd["v_ptr"] is vv and fwd["o_ptr"] is out
    assert fwd["stats_ptr"] is stats and pre["o_ptr"] is out and dkdv["q_ptr"] is dq["q_ptr"] is qq
    assert dq["dq_ptr"] is dq_ and dkdv["dk_ptr"] is dk_ and dkdv["dv_ptr"] is dv_
    assert pre["delta_ptr"] is dkdv["delta_ptr"] is dq["delta_ptr"]
    assert all(a["COUNT_IO"] is False for a in (fwd, pre, dkdv, dq))


def test_no_host_synchronisation_in_a_cached_forward_backward(stubbed_launches):
    """What a CUDA graph needs of the host path: no device read, sizes from shapes only."""
    B, Hq, Hkv, N, D = 2, 4, 2, 128, 64
    layout = patterns.sliding_window(N, 32, 40).to(DEVICE)
    q, k, v, do = helpers.make_inputs(B, Hq, Hkv, N, N, D, device=DEVICE)
    with stubbed_launches() as count:
        _step(q, k, v, do, layout, "bottom_right")
        before = count["launches"]
        with helpers.no_host_sync():
            _step(q, k, v, do, layout, "bottom_right")
    assert count["launches"] - before == 4


def test_cached_launches_follow_every_change_between_calls(monkeypatch):
    """One plan, then the same key's pieces changed one at a time (scale, a non-contiguous k, a layout
    of the same shapes with other blocks, the other causal alignment): each call exact against float64."""
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 48, 64, 16
    q, k, v, do = helpers.make_inputs(B, Hq, Hkv, Nq, Nk, D, device=DEVICE)
    mask = torch.rand(1, Hq, 3, 4) < 0.6
    first, other = (BlockSparseLayout.from_block_mask(m, 16, (Nq, Nk)).to(DEVICE) for m in (mask, mask.roll(1, -1)))
    k_strided = torch.randn(B, Hkv, D, Nk, device=DEVICE).transpose(2, 3)
    cases = [(first, True, None, k), (first, True, 0.5, k), (first, True, None, k_strided),
             (other, True, None, k), (first, "bottom_right", None, k), (first, True, None, k)]
    monkeypatch.setattr(kit, "_PREPARED", {})
    launched = []
    real = kit.Prepared.__call__
    monkeypatch.setattr(kit.Prepared, "__call__", lambda self, t: (launched.append(self.name), real(self, t)))
    for layout, causal, scale, kk in cases:
        got = _step(q, kk, v, do, layout, causal, scale)
        ref = attention_reference(q, kk, v, layout, causal=causal, sm_scale=scale, do=do)
        for name, a, r in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + tuple(ref[2:])):
            assert rel_err(a, r) <= 1e-5, f"{name} {causal} {scale}: {rel_err(a, r):.1e}"
    assert len(launched) == 4 * 2   # `other` (same shapes) and the last call (the first key again) were cached


def test_counting_after_cached_calls_takes_the_counted_path():
    B, H, N, D = 1, 2, 64, 16
    layout = patterns.causal(N, 16).to(DEVICE)
    q, k, v, do = helpers.make_inputs(B, H, H, N, N, D, device=DEVICE)
    _step(q, k, v, do, layout, True)
    _step(q, k, v, do, layout, True)
    with IOCounter() as io:
        _step(q, k, v, do, layout, True)
    assert io.report == traffic.block_sparse(layout, B, H, H, D, torch.float32, causal=True)


def test_density_buckets_tune_apart(stubbed_launches, monkeypatch):
    """Plans of the same shapes at kept fractions in different powers of two get their own autotuner."""
    assert [runtime.density_bucket(f) for f in (1.0, 0.51, 0.5, 0.26, 0.05, 1 / 256, 1e-9, 0.0)] == \
        [0, 0, 1, 1, 4, 8, 8, 8]
    B, H, N, D = 1, 2, 256, 32
    q, k, v, do = helpers.make_inputs(B, H, H, N, N, D, device=DEVICE)
    dense, sparse = patterns.dense(N, 32), patterns.sliding_window(N, 32, 0)
    assert plan(dense).kept_fraction == 1.0 and plan(sparse).kept_fraction == 1 / 8
    monkeypatch.setattr(runtime, "_TUNED", {})
    with stubbed_launches():
        for layout in (dense, sparse):
            _step(q, k, v, do, layout.to(DEVICE), False)
    buckets = {key[-1] for key in runtime._TUNED}
    assert buckets == {0, 3}


def test_the_cache_stays_bounded(stubbed_launches, monkeypatch):
    """Lengths varying from call to call (a new key each) never grow the cache past ``PREPARED_MAX``."""
    monkeypatch.setattr(kit, "_PREPARED", {})
    monkeypatch.setattr(kit, "PREPARED_MAX", 2)
    sizes = []
    with stubbed_launches():
        for N in (32, 48, 64, 80, 96):
            q, k, v, _ = helpers.make_inputs(1, 2, 2, N, N, 16, device=DEVICE)
            with torch.no_grad():
                block_sparse_attention(q, k, v, patterns.causal(N, 16).to(DEVICE), causal=True, backend="triton")
            sizes.append(len(kit._PREPARED))
    assert max(sizes) <= 2 and sizes[0] == 1
