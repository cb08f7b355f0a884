"""Helpers shared by the test modules (importable as ``helpers``: ``pythonpath = ["tests"]``)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, sparse_operands
from sparse_io_attn.block_sparse.reference import masked_attention, rel_err
from sparse_io_attn.layout.causal import causal_offset

FP32_TOL = 1e-5
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
BACKENDS = ("torch", "triton", "cpu")   # every backend of block_sparse_attention: parametrize("backend", BACKENDS)


def make_layout(B, Hq, Nq, Nk, block, *, density=0.5, per_head=False, per_batch=False, empty_rows=(),
                fill=None, diagonal=False) -> BlockSparseLayout:
    """Random block mask ``torch.rand(...) < density`` (``fill`` True/False: all kept/none kept),
    ``diagonal``: block ``(r, r % nkb)`` kept in every row; ``empty_rows``: query-block rows emptied."""
    bq, bk = (block, block) if isinstance(block, int) else block
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    lb, lh = (B if per_batch else 1), (Hq if per_head else 1)
    if fill is None:
        mask = torch.rand(lb, lh, nqb, nkb) < density
    else:
        mask = torch.full((lb, lh, nqb, nkb), fill, dtype=torch.bool)
    if diagonal:
        mask[..., torch.arange(nqb), torch.arange(nqb) % nkb] = True
    for r in empty_rows:
        mask[..., r, :] = False
    return BlockSparseLayout.from_block_mask(mask, (bq, bk), (Nq, Nk))


def make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, device="cpu", Dv=None):
    """Fresh random ``q, k, v, do`` (never zeros); ``v`` and ``do`` of head dim ``Dv`` (default ``D``)."""
    mk = lambda h, n, d=D: torch.randn(B, h, n, d, dtype=dtype, device=device)  # noqa: E731
    return mk(Hq, Nq), mk(Hkv, Nk), mk(Hkv, Nk, Dv or D), mk(Hq, Nq, Dv or D)


def run(q, k, v, do, layout, causal, *, backend, sm_scale=None):
    """Forward + backward through the public API: ``(out, lse, dq, dk, dv)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention(q, k, v, layout, causal=causal, sm_scale=sm_scale,
                                      return_lse=True, backend=backend)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def check_close(got, ref, tol=FP32_TOL):
    """``(out, lse, dq, dk, dv)`` against a reference: no NaN, ``lse = -inf`` exactly on the
    reference's empty rows, relative error <= ``tol`` for every tensor (lse over finite rows)."""
    out, lse = got[0], got[1]
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:3]
    r_lse = ref[1]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)), "lse must be -inf exactly on empty rows"
    fin = torch.isfinite(r_lse)
    errs = {"out": rel_err(out, ref[0]), "lse": rel_err(lse[fin], r_lse[fin]),
            "dq": rel_err(got[2], ref[2]), "dk": rel_err(got[3], ref[3]), "dv": rel_err(got[4], ref[4])}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


def check_within_baseline(got, ref, q, k, v, do, mask):
    """flash-attention's rule for low precision: ``got = (out, lse, dq, dk, dv)`` has no NaN and its error vs
    the float64 ``ref`` is at most 2x (out) / 3x (gradients) the error of plain PyTorch attention with the
    element ``mask``, run in ``q``'s dtype (softmax scale ``D ** -0.5``)."""
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    b_out, _ = masked_attention(qb, kb, vb, mask, q.shape[-1] ** -0.5)
    base = (b_out,) + torch.autograd.grad(b_out, (qb, kb, vb), do)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(x).any(), f"NaN in {name}"
    for name, x, b, r, factor in zip(("out", "dq", "dk", "dv"), (got[0],) + tuple(got[2:]), base,
                                     (ref[0],) + tuple(ref[2:]), (2, 3, 3, 3)):
        assert rel_err(x, r) <= factor * rel_err(b, r) + 1e-6, \
            f"{name}: {rel_err(x, r):.2e} vs baseline {rel_err(b, r):.2e}"


def check_forward_close(out, lse, ref, dtype):
    """A forward's ``(out, lse)`` against the float64 ``ref = (out, lse, ...)``: ``lse = -inf`` exactly on the
    reference's empty rows, relative error <= 2e-5 in fp32, else within twice the rounding of the reference
    to ``dtype`` (+ 1e-3)."""
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(lse), ~fin)
    tol = 2e-5 if dtype == torch.float32 else 2 * rel_err(ref[0].to(dtype), ref[0]) + 1e-3
    assert rel_err(out, ref[0]) <= tol and rel_err(lse[fin], ref[1][fin]) <= max(tol, 2e-5)


def check_within_reference_error(got, ref, base, dtype):
    """Low precision: ``got = (out, lse, dq, dk, dv)`` within 2x (out) / 3x (gradients) of the error of the
    reference run in ``dtype`` (``base``) against the float64 ``ref`` (+ 1e-3)."""
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        lim = (2 if name == "out" else 3) * rel_err(base[i].to(dtype), ref[i]) + 1e-3
        assert rel_err(got[i], ref[i]) <= lim, name


def nan_cache_views(k, v, keep):
    """``k``, ``v`` (``[B, H, Nk, D]``) as views of larger caches, ``[B, H, 4 Nk, D][:, :, :Nk]`` and ``[B, 2 Nk,
    H, D][:, :Nk].transpose(1, 2)``: a list of two ``(k, v)`` pairs, NaN everywhere but where ``keep`` (a bool
    mask broadcast to ``[B, H, Nk, D]``: the keys a kernel may read)."""
    B, H, Nk, D = k.shape
    views = []
    for heads_first, shape in ((True, (B, H, 4 * Nk, D)), (False, (B, 2 * Nk, H, D))):
        pair = []
        for t in (k, v):
            cache = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
            view = cache[:, :, :Nk] if heads_first else cache[:, :Nk].transpose(1, 2)
            view.copy_(torch.where(keep, t, float("nan")))
            pair.append(view)
        views.append(tuple(pair))
    return views


def decode_indices(lead: tuple, Nq: int, Nk: int, K: int, bs: int, causal, *, empty_rows=(), device="cpu"):
    """int64 ``[*lead, Nq, K]``: slot 0 the token's own (diagonal) block, the others random earlier
    or later blocks (later ones are dropped by causality), some empty slots and repeats."""
    nkb = math.ceil(Nk / bs)
    delta = causal_offset(causal, Nq, Nk) or 0
    idx = torch.randint(0, nkb, (*lead, Nq, K))
    idx[..., 0] = (torch.arange(Nq) + delta).clamp(0, Nk - 1) // bs
    idx = torch.where(torch.rand(idx.shape) < 0.15, -1, idx)
    if K > 2:
        idx[..., 2] = idx[..., 1]
    for t in empty_rows:
        idx[..., t, :] = -1
    return idx.to(device)


def compile_report(tmp_path, *args: str, timeout: float = 900) -> dict:
    """``sparse-io-attn compile-report ARGS --json`` (sm_90 compiles, no GPU) in a fresh process (this one imported
    Triton in interpreter mode; its own Triton cache under ``tmp_path``): the parsed report."""
    cmd = [sys.executable, "-m", "sparse_io_attn.cli", "compile-report", *args, "--json"]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def check_decode_report(rows, kernel: str) -> dict:
    """A decode compile report's rows: ``kernel`` and ``kernel + "_merge"`` at both example shapes (one token,
    ``"decode"``; 16 tokens, ``"verify"``), split, unspilled, in an H100 block's shared memory, their main loops
    multi-buffered (cp.async). Returns the ``verify`` row of ``kernel``."""
    assert {(r["shape"], r["kernel"]) for r in rows} == {(s, k) for s in ("decode", "verify")
                                                         for k in (kernel, kernel + "_merge")}
    for r in rows:
        assert r["splits"] > 1, r                                 # the example rows are split: both kernels run
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r             # fits an H100 block
        assert r["pipelined"] and r["cp_async"] > 0, r
    return next(r for r in rows if r["shape"] == "verify" and r["kernel"] == kernel)


def load_benchmark(monkeypatch, name: str):
    """``benchmarks/<name>.py`` imported as a module, with ``benchmarks/`` on ``sys.path`` for this test (the
    scripts import their siblings)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def skip_cpu_backend_if_unbuilt(request) -> None:
    """For an autouse fixture: skip a test parametrized with ``backend="cpu"`` where the C++ kernels cannot be
    built (no C++ compiler)."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "cpu":
        from sparse_io_attn._cpu import build
        if not build.is_available():
            pytest.skip(f"the C++ kernels cannot be built here: {build.unavailable_reason()}")


def check_repeatable(step):
    """``step()`` (a forward and backward: a tuple of tensors) run twice gives bitwise the same tensors. Returns
    the first run's."""
    first, second = step(), step()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    return first


def check_bad_operands(over: dict, err, match: str, *, n: int, seed: int, **kw) -> None:
    """``sparse_operands.attention`` (backend ``"torch"`` unless ``kw`` says) on random dense operands (``A1``,
    ``A2``, ``A3`` ``[2, n, 16]``, ``X`` ``[4, 16, 16]``, ``Y`` ``[4, 16, 8]``) with the entries of ``over``
    replaced raises ``err`` matching ``match``."""
    g = torch.Generator().manual_seed(seed)
    d = dict(A1=torch.randn(2, n, 16, generator=g), A2=torch.randn(2, n, 16, generator=g),
             A3=torch.randn(2, n, 16, generator=g), X=torch.randn(4, 16, 16, generator=g),
             Y=torch.randn(4, 16, 8, generator=g))
    d.update(over)
    with pytest.raises(err, match=match):
        sparse_operands.attention(d["A1"], d["A2"], d["A3"], d["X"], d["Y"], **{"backend": "torch", **kw})


def tiny_llama(spec, seed: int = 0, *, gates: bool = True):
    """A random 2-layer Llama (vocab 97, hidden 64, 4 query and 2 KV heads of 16) with
    ``config.sparse_attention = {"pattern": spec, "backend": "torch"}`` under ``attn_implementation=
    "sparse_io_attn"``, in eval mode; an ``"nsa:..."`` spec gets NSA's gates (``add_nsa_gates``, random
    weights, so not every gate is 1/2) unless ``gates=False``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparse_io_attn.integrations import transformers as sia_hf

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.sparse_attention = {"pattern": spec, "backend": "torch"}
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sia_hf.register()).eval()
    if gates and isinstance(spec, str) and spec.startswith("nsa:"):
        sia_hf.add_nsa_gates(model)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.g_proj.weight.normal_(0, 0.5)
    return model


@torch.no_grad()
def greedy_by_prefill(model, ids: torch.Tensor, steps: int):
    """Greedy decoding without a cache, a full forward over the whole sequence per new token:
    ``(sequences, raw logits of each new token [B, steps, V])``. Like ``generate(min_new_tokens=steps)``
    it never picks the model's end-of-sequence token (if it has one)."""
    logits, eos = [], model.generation_config.eos_token_id
    for _ in range(steps):
        last = model(ids, use_cache=False).logits[:, -1]
        logits.append(last)
        pick = last if eos is None else last.index_fill(-1, torch.tensor(eos).flatten(), -torch.inf)
        ids = torch.cat([ids, pick.argmax(-1, keepdim=True)], 1)
    return ids, torch.stack(logits, 1)


def init_state_calls(owner):
    """``(calls, patch)``: under ``patch``, each ``owner.init_state(...)`` call (a selector or
    ``NSAAttention``) appends whether it absorbed cached tensors (a decode state rebuilt, O(Nk x D))."""
    from unittest import mock

    calls = []
    real = owner.init_state

    def counting(self, *cached):
        calls.append(bool(cached))
        return real(self, *cached)
    return calls, mock.patch.object(owner, "init_state", counting)


class _NoHostSync(torch.overrides.TorchFunctionMode):
    """Raises on every tensor operation that reads data back to the host (a synchronisation on CUDA):
    ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()`` of a tensor, ``nonzero``, boolean-mask
    indexing, ``unique``, ``bincount``, ``masked_select``, copies to the CPU."""
    FORBIDDEN = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
                 "unique_consecutive", "bincount", "masked_select", "cpu", "numpy", "argwhere"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.FORBIDDEN:
            raise AssertionError(f"host synchronisation: {name}")
        if name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                         for a in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            raise AssertionError("host synchronisation: boolean-mask indexing")
        return func(*args, **(kwargs or {}))


def no_host_sync() -> _NoHostSync:
    """``with no_host_sync(): ...`` fails the test on any operation that would synchronise a CUDA
    device with the host (checked on CPU tensors by the operation's name)."""
    return _NoHostSync()


#: seconds a spawned group of processes may run: a hung rank fails its test instead of blocking the suite
SPAWN_TIMEOUT_S = 120


def free_port() -> int:
    """A free TCP port on localhost (for ``init_method=f"tcp://127.0.0.1:{port}"``)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, args: tuple, nprocs: int, what: str, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """``torch.multiprocessing.spawn(worker, args, nprocs)``, killing every process and failing with
    an ``AssertionError`` naming ``what`` if they do not all finish within ``timeout_s`` (a worker's
    exception is re-raised)."""
    import time
    import torch.multiprocessing as mp
    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"{what} did not finish within {timeout_s} s")


def force_triton_configs(monkeypatch, configs) -> None:
    """The block-sparse Triton launcher takes its candidates from ``configs(kernel, block_size, head_dim,
    dtype)`` for the rest of the test: past the launcher's cached candidate lists and the launches an
    earlier test kept (``run_calls``)."""
    from sparse_io_attn._attention.triton import launch as kit_launch
    from sparse_io_attn.block_sparse.triton import launch

    monkeypatch.setattr(launch, "kernel_configs", configs)
    monkeypatch.setattr(launch, "_configs", launch._configs.__wrapped__)
    monkeypatch.setattr(kit_launch, "_PREPARED", {})
