"""``sparse-io-attn demo``: build a pattern, draw it, check block-sparse attention forward and backward
against the float64 reference, time it against dense ``scaled_dot_product_attention``, and set the
Triton kernels' memory traffic (predicted, and counted on a cut-down copy) against the lower bound.

The demo is a list of sections (``SECTIONS``), each a function taking the shared :class:`DemoContext`
and printing one part of the story; later parts of the library append their own (memory traffic,
I/O lower bounds) with ``SECTIONS.append(fn)`` or :func:`add_section`.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse.api import block_sparse_attention
from sparse_io_attn.block_sparse.reference import attention_reference, element_mask, masked_attention, rel_err
from sparse_io_attn.cli.bounds import attention_bound, default_cache_words
from sparse_io_attn.layout.patterns import parse_spec
from sparse_io_attn.cli._common import (DTYPES, build_layout, check_memory, format_header, machine_header, parse_count,
                                        parse_dtype, time_fn)

EXAMPLES = """examples:
  sparse-io-attn demo                                  # BigBird, N=2048, block 64, H=4, D=64, fp32
  sparse-io-attn demo --pattern sliding_window:256 --seq-len 4096
  sparse-io-attn demo --pattern causal --heads 8 --head-dim 128 --dtype bf16
  sparse-io-attn demo --pattern bigbird:random=2,causal --kv-heads 2     # GQA

Exit status 1 when a correctness check fails."""


@dataclass
class DemoContext:
    """What the sections share: parsed flags, the layout, inputs, and results sections record."""
    args: argparse.Namespace
    layout: object
    causal: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    results: dict = field(default_factory=dict)
    passed: bool = True


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="draw a pattern, check attention against float64, time it vs SDPA",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pattern", default="bigbird",
                   help="pattern spec (sparse_io_attn.layout.patterns.from_spec), e.g. bigbird, causal, "
                        "sliding_window:256, random:0.1 (default bigbird)")
    p.add_argument("--seq-len", type=parse_count, default=2048, help="sequence length (default 2048)")
    p.add_argument("--block", type=parse_count, default=64, help="block size (default 64)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA (default = --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="input dtype (default fp32)")
    p.add_argument("--causal", action="store_true",
                   help="element-level causal masking (implied by the causal pattern or a ',causal' spec)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="block_sparse_attention backend (default auto: the C++ kernel on CPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs (default 0)")
    p.set_defaults(func=run)


def make_context(args) -> DemoContext:
    for flag in ("batch", "heads", "head_dim", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if kv_heads < 1 or args.heads % kv_heads:
        raise ValueError(f"--kv-heads must divide --heads ({args.heads}), got {kv_heads}")
    # the float64 reference and the SDPA baselines build dense [B, H, N, N] scores and masks
    dense = args.batch * args.heads * args.seq_len ** 2 * (4 * 8 + 2)
    check_memory(dense, f"the demo's dense float64 reference at --seq-len {args.seq_len}",
                 fix="use a smaller --seq-len (the demo checks against dense attention; `sparse-io-attn bench` "
                     "times long sequences without it)")
    name, spec_kwargs = parse_spec(args.pattern)
    causal = bool(args.causal or name == "causal" or spec_kwargs.get("causal", False))
    layout = build_layout(args.pattern, args.seq_len, args.block, num_heads=1)
    dtype = parse_dtype(args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    shape = lambda h: (args.batch, h, args.seq_len, args.head_dim)  # noqa: E731
    q, do = (torch.randn(shape(args.heads), generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(shape(kv_heads), generator=gen).to(dtype) for _ in range(2))
    return DemoContext(args, layout, causal, q, k, v, do)


# ------------------------------------------------------------------------------------------ sections
def section_layout(ctx: DemoContext) -> None:
    a = ctx.args
    print(format_header(machine_header(parse_dtype(a.dtype), ctx.q.device)))
    print(f"# B={a.batch} Hq={ctx.q.shape[1]} Hkv={ctx.k.shape[1]} N={a.seq_len} D={a.head_dim} "
          f"causal={ctx.causal} backend={a.backend}\n")
    print(ctx.layout)
    print()


def _run_ours(ctx: DemoContext, *, backward: bool):
    q, k, v = (t.detach().clone().requires_grad_(backward) for t in (ctx.q, ctx.k, ctx.v))
    out, lse = block_sparse_attention(q, k, v, ctx.layout, causal=ctx.causal, return_lse=True,
                                      backend=ctx.args.backend)
    if not backward:
        return out, lse
    out.backward(ctx.do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def section_correctness(ctx: DemoContext) -> None:
    """Relative errors ||x - ref|| / ||ref|| against the float64 reference; fp32 passes at 1e-5,
    fp16/bf16 at 2x (output) / 3x (gradients) the error of dense PyTorch attention in that dtype."""
    got = _run_ours(ctx, backward=True)
    ref = attention_reference(ctx.q, ctx.k, ctx.v, ctx.layout, causal=ctx.causal, do=ctx.do)
    names = ("out", "lse", "dq", "dk", "dv")
    fin = torch.isfinite(ref[1])
    errs = {n: rel_err(g[fin], r[fin]) if n == "lse" else rel_err(g, r) for n, g, r in zip(names, got, ref)}
    nan = any(torch.isnan(g).any().item() for g in got)
    if ctx.q.dtype == torch.float32:
        limits = {n: 1e-5 for n in names}
        rule = "fp32: relative error <= 1e-5"
    else:
        B, Hq, N, D = ctx.q.shape
        mask = element_mask(ctx.layout, B, Hq, N, N, causal=ctx.causal)
        qb, kb, vb = (t.detach().clone().requires_grad_() for t in (ctx.q, ctx.k, ctx.v))
        b_out, _ = masked_attention(qb, kb, vb, mask, D ** -0.5)
        base = dict(zip(("out", "dq", "dk", "dv"),
                        (b_out.detach(), *torch.autograd.grad(b_out, (qb, kb, vb), ctx.do))))
        limits = {n: (2 if n == "out" else 3) * rel_err(base[n], r) for n, r in zip(names, ref) if n in base}
        limits["lse"] = 1e-4
        rule = f"{ctx.args.dtype}: <= 2x (out) / 3x (grads) the error of dense PyTorch attention in {ctx.args.dtype}"
    ok = not nan and all(errs[n] <= limits[n] for n in names)
    print(f"correctness vs float64 reference ({rule}):")
    for n in names:
        print(f"  {n:4s} rel err {errs[n]:.2e}  (limit {limits[n]:.1e})  {'ok' if errs[n] <= limits[n] else 'FAIL'}")
    print(f"  NaN: {'FOUND' if nan else 'none'}")
    print(f"  => {'PASS' if ok else 'FAIL'}\n")
    ctx.results["rel_err"] = errs
    ctx.passed &= ok


def section_timing(ctx: DemoContext) -> None:
    """Median wall time of ours vs dense SDPA (equivalent boolean mask / is_causal, and no mask)."""
    q, k, v = ctx.q, ctx.k, ctx.v
    group = q.shape[1] // k.shape[1]
    ke, ve = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if group > 1 else (k, v)
    if ctx.causal and ctx.layout.density == 1.0:
        masked = lambda q_, k_, v_: scaled_dot_product_attention(q_, k_, v_, is_causal=True)  # noqa: E731
    else:
        mask = ctx.layout.expand_dense_mask(q.shape[0], q.shape[1])
        if ctx.causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
        masked = lambda q_, k_, v_: scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)  # noqa: E731

    def fwd_bwd(fn, args):
        leaves = [t.detach().clone().requires_grad_() for t in args]
        return lambda: fn(*leaves).backward(ctx.do)

    ours = lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, ctx.layout, causal=ctx.causal,  # noqa: E731
                                                     backend=ctx.args.backend)
    methods = {
        "block_sparse_attention": (lambda: ours(q, k, v), fwd_bwd(ours, (q, k, v))),
        "SDPA, same mask": (lambda: masked(q, ke, ve), fwd_bwd(masked, (q, ke, ve))),
        "SDPA, no mask (dense)": (lambda: scaled_dot_product_attention(q, ke, ve),
                                  fwd_bwd(scaled_dot_product_attention, (q, ke, ve))),
    }
    reps = ctx.args.repeats
    times = {name: (time_fn(f, repeats=reps)["median_s"], time_fn(fb, repeats=reps)["median_s"])
             for name, (f, fb) in methods.items()}
    t_f, t_fb = times["block_sparse_attention"]
    print(f"timing (median of {reps} warm runs, {torch.get_num_threads()} threads, device {q.device}):")
    print(f"  {'method':24s} {'forward':>12s} {'fwd+bwd':>12s}")
    for name, (f, fb) in times.items():
        speed = "" if name == "block_sparse_attention" else f"   ours is {f / t_f:.2f}x / {fb / t_fb:.2f}x faster"
        print(f"  {name:24s} {f * 1e3:9.1f} ms {fb * 1e3:9.1f} ms{speed}")
    print()
    ctx.results["timing_s"] = times


COUNTED_SEQ_LEN = 256  # the counted run goes through Triton's interpreter on CPU: keep it to a few dozen tiles


def section_traffic_and_bounds(ctx: DemoContext) -> None:
    """Bytes the Triton kernels move for this problem (exact traffic model) against the lower bound;
    then a cut-down copy runs through the kernels with ``IOCounter`` on, to show counted == model."""
    a = ctx.args
    B, Hq, N, D = ctx.q.shape
    Hkv, dtype = ctx.k.shape[1], ctx.q.dtype
    M = default_cache_words(None, dtype)
    pred = traffic.block_sparse(ctx.layout, B, Hq, Hkv, D, dtype, causal=ctx.causal)
    bound = attention_bound(N, D, M, dtype, layout=ctx.layout, causal=ctx.causal, pass_="fwd+bwd",
                            batch=B, heads=Hq, kv_heads=Hkv)
    print(f"memory traffic of the Triton kernels, forward+backward (exact traffic model, M = {M:,} words):")
    print(f"  predicted {pred.total_bytes:,} B; lower bound {bound['bound_bytes']:,} B = max(compulsory "
          f"{bound['compulsory_bytes']:,} B, {bound['theorem']} {bound['theorem_bytes']:,.0f} B, unit constants); "
          f"traffic / bound = {pred.total_bytes / bound['bound_bytes']:.2f}")
    if bound.get("note"):
        print(f"  note: {bound['note']}")

    n = min(COUNTED_SEQ_LEN, N)
    small = build_layout(a.pattern, n, a.block, num_heads=1)
    gen = torch.Generator().manual_seed(a.seed + 1)
    q, do = (torch.randn(1, 1, n, D, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, n, D, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    q.requires_grad_()
    with IOCounter() as io:
        block_sparse_attention(q, k, v, small, causal=ctx.causal, backend="triton").backward(do)
    model = traffic.block_sparse(small, 1, 1, 1, D, dtype, causal=ctx.causal)
    same = io.report == model
    print(f"\ncounted run (n = {n}, 1 head, backend='triton'{', interpreter' if q.device.type == 'cpu' else ''}): "
          f"counted == model: {'yes' if same else 'NO'}")
    print("  " + str(io.report).replace("\n", "\n  "))
    print()
    ctx.results["traffic"] = {"predicted_bytes": pred.total_bytes, "bound_bytes": bound["bound_bytes"],
                              "counted_equals_model": same}
    ctx.passed &= same


SECTIONS = [section_layout, section_correctness, section_timing, section_traffic_and_bounds]


def add_section(fn, *, after=None) -> None:
    """Register a section ``fn(ctx)``; at the end, or right after the section ``after``."""
    SECTIONS.insert(SECTIONS.index(after) + 1 if after is not None else len(SECTIONS), fn)


def run(args) -> int:
    t0 = time.perf_counter()
    ctx = make_context(args)
    for section in SECTIONS:
        section(ctx)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s: {'PASS' if ctx.passed else 'FAIL'}")
    return 0 if ctx.passed else 1
