"""One small forward+backward of each op on CUDA, and one decode step of each (one query token: the
split-K decode kernels and their merge), for ``compute-sanitizer --tool memcheck`` (issues 33, 43):
``block_sparse_attention`` with a per-head random layout, ragged length (300 tokens, blocks of 64),
GQA, causal bottom-right with Nq < Nk, bf16; ``selection_attention`` with ragged blocks, empty slots
and an empty row. Each output is checked against the float64 reference, so a wrong read shows as a
failure even where the sanitizer stays silent.

    compute-sanitizer --tool memcheck python benchmarks/gpu_sanitize_case.py
"""
import torch

import sparse_io_attn._triton.runtime  # noqa: F401
from sparse_io_attn import BlockSparseLayout, block_sparse_attention
from sparse_io_attn.block_sparse.reference import attention_reference, rel_err
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.api import selection_attention
from sparse_io_attn.selection.reference import selection_reference


def run(op, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = op(q, k, v)
    out.backward(do)
    return out.detach(), None, q.grad, k.grad, v.grad


def check(name, got, ref, tol=2e-2):
    for part, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if a is None:
            continue
        err = rel_err(a, r)
        print(f"{name} {part}: rel err {err:.2e}")
        assert torch.isfinite(a).all() and err < tol, (name, part, err)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: the interpreter (a dry run)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    B, Hq, Hkv, Nq, Nk, D, bs = 1, 4, 2, 237, 300, 64, 64
    if dev == "cpu":   # a dry run: the same cases, smaller (the interpreter)
        Nq, Nk, D, bs = 45, 70, 16, 16
    mask = torch.rand(Hq, -(-Nq // bs), -(-Nk // bs)) < 0.5   # per-head layouts, ragged last blocks
    layout = BlockSparseLayout.from_block_mask(mask, bs, (Nq, Nk))
    q, do = (torch.randn(B, Hq, Nq, D, device=dev, dtype=dt) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Nk, D, device=dev, dtype=dt) for _ in range(2))
    layout = layout.to(dev)
    got = run(lambda q, k, v: block_sparse_attention(q, k, v, layout, causal="bottom_right", backend="triton"),
              q, k, v, do)
    ref = attention_reference(q, k, v, layout, causal="bottom_right", do=do)
    check("block_sparse", got, (ref[0], None) + tuple(ref[2:]))

    idx = torch.randint(-1, -(-Nk // 20), (B, Hkv, Nq, 5), device=dev)
    idx[:, :, 7] = -1
    sel = Selection(idx, 20)
    got = run(lambda q, k, v: selection_attention(q, k, v, sel, causal="bottom_right", backend="triton"), q, k, v, do)
    ref = selection_reference(q, k, v, sel, causal="bottom_right", do=do)
    check("selection", got, (ref[0], None) + tuple(ref[2:]))

    # one decode step of each op: the last query token against every key (split-K kernels + merge)
    q1 = q[:, :, -1:].contiguous()
    row = BlockSparseLayout.from_block_mask(mask[:, -1:], bs, (1, Nk)).to(dev)
    out = block_sparse_attention(q1, k, v, row, causal="bottom_right", backend="triton")
    check("block_sparse decode", (out,), attention_reference(q1, k, v, row, causal="bottom_right")[:1])
    sel1 = Selection(idx[:, :, -1:].contiguous(), 20)
    out = selection_attention(q1, k, v, sel1, causal="bottom_right", backend="triton")
    check("selection decode", (out,), selection_reference(q1, k, v, sel1, causal="bottom_right")[:1])
    if dev == "cuda":
        torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
