"""``nn.NativeSparseAttention`` with a KV cache (``nn/nsa_cache.py``): a prompt of ``N`` tokens, then
tokens ``N .. N + m - 1`` one at a time (or a few at a time, speculative verification), gives every row
of one forward over the ``N + m`` tokens: against our own fp32 prefill and against the transcription
of fla's layer in float64, with the decoded rows' selection equal to the prefill's. Cases cross block
boundaries (fla's compression stride is the block size: a decoded token completes a block and the
next one starts a block), start decoding on a block boundary and inside a block, with GQA. A step
reads only its selected blocks and window (the rest of the cached keys and values are NaN) and no
square layout or whole-cache selection is built."""
from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch

from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.nn import NativeSparseAttention, selectors
from sparse_io_attn.nn.nsa import NSAAttention

from .selector_checks import chosen_mask, with_backends
from .test_correctness import SELECTION_BACKENDS, _cpu_kernel_present, device_of  # noqa: F401 (autouse fixture)
from .transcribed import nsa as fla

CASES = [   # T = N + m tokens; decode chunk sizes cycle (the first case also runs on "triton")
    pytest.param(1, 32, 4, 2, 8, 4, 3, 7, 6, 30, (3, 16, 1), id="gqa-speculative-chunks-3-16-1"),
    pytest.param(2, 32, 4, 2, 8, 4, 3, 6, 8, 14, (1,), id="gqa-decode-starts-a-block-bs4-S3-w6"),
    pytest.param(1, 32, 4, 1, 8, 4, 4, 5, 9, 12, (1,), id="mqa-decode-inside-a-block"),
    pytest.param(2, 32, 2, 2, 8, 5, 2, 0, 3, 15, (1,), id="mha-prompt-before-the-first-block-no-window"),
]


def _layer(E, HQ, H, D, BS, S, window, backend):
    return NativeSparseAttention(E, HQ, H, head_dim=D, block_size=BS, num_blocks=S, window=window, backend=backend,
                                 layout_block_size=16)


def _decode(layer, x, N, chunks):
    """Prompt ``x[:, :N]`` through a fresh cache, then the rest in ``chunks`` (cycled): the outputs and
    the selections of every call, concatenated along the tokens."""
    cache = layer.init_cache()
    outs, sels = [], []
    t, i = 0, 0
    while t < x.shape[1]:
        n = N if t == 0 else min(chunks[i % len(chunks)], x.shape[1] - t)
        i += t > 0
        out, sel = layer(x[:, t:t + n], cache=cache, return_selection=True)
        outs.append(out)
        sels.append(sel.indices)
        t += n
    assert cache.length == cache.state.length == x.shape[1]
    return torch.cat(outs, 1), torch.cat(sels, 2), cache


@pytest.mark.parametrize("backend,B,E,HQ,H,D,BS,S,window,N,m,chunks",
                         with_backends(CASES, SELECTION_BACKENDS))
def test_decoded_rows_equal_the_prefill(backend, B, E, HQ, H, D, BS, S, window, N, m, chunks):
    dev = device_of(backend)
    layer = _layer(E, HQ, H, D, BS, S, window, backend).to(dev)
    x = torch.randn(B, N + m, E, device=dev)
    with torch.no_grad():
        full, full_sel = layer(x, return_selection=True)
        got, sel, cache = _decode(layer, x, N, chunks)
        sd = {n: p.detach().cpu().double() for n, p in layer.state_dict().items()}
        ref = fla.nsa_layer_reference_from_state_dict(
            x.cpu().double(), sd, num_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS, block_counts=S,
            window_size=window, compute_dtype=torch.float64, check_group_size=False)
    assert rel_err(got[:, N:], full[:, N:]) < 1e-5, rel_err(got[:, N:], full[:, N:])
    assert rel_err(got[:, N:].cpu(), ref[:, N:]) < 1e-5, rel_err(got[:, N:].cpu(), ref[:, N:])
    TC = math.ceil((N + m) / BS)
    assert torch.equal(chosen_mask(sel, TC), chosen_mask(full_sel.indices, TC))
    state = cache.state
    assert state.keys.num_blocks == (N + m) // BS and state.tail.shape[2] == (N + m) % BS
    assert state.numel() == 2 * B * H * ((N + m) // BS + (N + m) % BS) * D


def test_a_step_reads_only_its_blocks_and_window():
    """The cached keys and values outside the step's selected blocks and window are NaN: the step's
    output is unchanged (bitwise) and finite; no prefill layout and no whole-cache selection is made."""
    B, E, HQ, H, D, BS, window, N = 1, 32, 4, 1, 8, 4, 5, 81
    layer = _layer(E, HQ, H, D, BS, 4, window, "torch")
    x = torch.randn(B, N + 3, E)
    with torch.no_grad():
        cache = layer.init_cache()
        layer(x[:, :N], cache=cache)
        for t in (N, N + 1):                                          # one token, then two
            n = t - N + 1
            clean = copy.deepcopy(cache)
            want, sel = layer(x[:, t:t + n], cache=clean, return_selection=True)
            L = t + n
            read = torch.zeros(L, dtype=torch.bool)
            read[max(0, t - window + 1):] = True                      # the window of the step's rows
            for block in sel.indices.unique().tolist():
                if block >= 0:
                    read[block * BS:(block + 1) * BS] = True
            assert read.sum() < L // 2
            poisoned = copy.deepcopy(cache)
            for buf in (poisoned._k, poisoned._v):
                buf[:, :, :cache.length][:, :, ~read[:cache.length]] = float("nan")
            refuse = mock.patch.object(NSAAttention, "_build_layouts", side_effect=AssertionError("square layout"))
            rescan = mock.patch.object(selectors.NSASelector, "__call__", side_effect=AssertionError("whole cache"))
            with refuse, rescan:
                got = layer(x[:, t:t + n], cache=poisoned)
            assert torch.isfinite(got).all() and torch.equal(got, want), t
            layer(x[:, t:t + n], cache=cache)


def test_a_state_from_cached_keys_continues_as_one_built_by_steps():
    attn = NSAAttention(4, 3, 6, backend="torch", layout_block_size=16)
    q, k, v = torch.randn(2, 4, 23, 8), torch.randn(2, 2, 23, 8), torch.randn(2, 2, 23, 8)
    g = torch.rand(2, 23, 4, 3)
    stepped = attn.init_state()
    attn(q[:, :, :17], k[:, :, :17], v[:, :, :17], g[:, :17], state=stepped)
    rebuilt = attn.init_state(k[:, :, :17], v[:, :, :17])
    for state in (stepped, rebuilt):
        out = attn(q[:, :, 17:19], k[:, :, :19], v[:, :, :19], g[:, 17:19], state=state)
        assert torch.equal(out, attn(q[:, :, 17:19], k[:, :, :19], v[:, :, :19], g[:, 17:19]))
    assert torch.equal(stepped.keys.summaries, rebuilt.keys.summaries)
    assert torch.equal(stepped.values.tail, rebuilt.values.tail)


def test_cache_batch_map_and_growth():
    """``map_batch`` (beam search's reorder) moves the cached rows and the state; buffers grow by
    doubling (or are allocated for ``capacity``) and keep the cached tokens."""
    layer = _layer(32, 4, 2, 8, 4, 3, 6, "torch")
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        cache = layer.init_cache()
        layer(x[:, :9], cache=cache)
        assert cache._k.shape[2] == 9
        layer(x[:, 9:10], cache=cache)
        assert cache._k.shape[2] == 18 and cache.k.shape[2] == 10
        cache.map_batch(lambda t: t.flip(0))
        got = layer(x[:, 10:12].flip(0), cache=cache)
        want = layer(x[:, :12].flip(0))[:, 10:]
        assert rel_err(got, want) < 1e-5
        sized = layer.init_cache(capacity=64)
        layer(x[:, :3], cache=sized)
        assert sized._k.shape[2] == 64 and sized.numel() == 2 * 2 * 2 * 3 * 8 + sized.state.numel()
        sized.reset()
        assert sized.length == 0 and sized.k is None and sized.state.length == 0


def test_cache_errors():
    layer = _layer(32, 4, 2, 8, 4, 3, 6, "torch")
    x = torch.randn(2, 6, 32)
    with pytest.raises(NotImplementedError, match="inference only"):
        layer(x, cache=layer.init_cache())
    with torch.no_grad():
        with pytest.raises(TypeError, match="NSACache"):
            layer(x, cache={})
        cache = layer.init_cache()
        layer(x, cache=cache)
        with pytest.raises(ValueError, match="do not continue the cache"):
            layer(x[:1], cache=cache)
        other = _layer(32, 4, 2, 8, 8, 3, 6, "torch")
        with pytest.raises(ValueError, match=r"made by nsa\(block_size=8"):
            other(x, cache=cache)
    attn = NSAAttention(4, 3, 6, backend="torch")
    q, k, g = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 9, 8), torch.rand(1, 3, 4, 3)
    with pytest.raises(ValueError, match=r"gates must be \[B, Nq, Hq, 3\]"):
        attn(q, k, k, g[:, :2])
    with pytest.raises(ValueError, match="1 <= Nq <= Nk"):
        attn(torch.randn(1, 4, 10, 8), k, k, torch.rand(1, 10, 4, 3))
    with pytest.raises(ValueError, match="the state holds 0 tokens"):
        attn(q, k, k, g, state=attn.init_state())
    with pytest.raises(TypeError, match="NSAState"):
        attn(q, k, k, g, state=attn.init_state().keys)
    with pytest.raises(ValueError, match="both the cached keys and values"):
        attn.init_state(k)
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        NSAAttention(4, 3, -1)
    for bad, match in (("nsa:4,3", "misses"), ("nsa:block=4,num_blocks=3,window=x", "must be an int"),
                       ("moba:4,3", "not an NSA spec")):
        with pytest.raises(ValueError, match=match):
            NSAAttention.from_spec(bad)
    spec = NSAAttention.from_spec(" nsa : block=4, top_k=3, window=0")
    assert (spec.block_size, spec.num_blocks, spec.window) == (4, 3, 0)
    layer.backend = "cpu"                                             # the branches' backend, settable
    assert layer.attention.backend == "cpu" and layer.window == 6
    with pytest.raises(ValueError, match="backend must be one of"):
        layer.backend = "cuda"
