"""``sparse-io-attn bench``: time block-sparse attention backends against each other and set their
memory traffic against the paper's lower bound.

Columns: median time over warm repeats with its spread (IQR and min..max), effective TFLOP/s
counted on the kept blocks only (the same numerator for every backend, so a dense backend that
computes skipped blocks shows a lower number), the memory traffic of the run -- *counted* by the
kernels' ``COUNT_IO`` counters or *predicted* by the traffic model, the column says which; backends
without a traffic model show ``-`` --, the lower bound (max of compulsory traffic and Theorem 4.5
with unit constants, see ``sparse-io-attn bounds``) and traffic / bound.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention

from sparse_io_attn.accounting import IOCounter, traffic
from sparse_io_attn.block_sparse.api import block_sparse_attention
from sparse_io_attn._memory import available_memory_bytes
from sparse_io_attn.cli import _common as common
from sparse_io_attn.cli.bounds import attention_bound, default_cache_words

BACKENDS = ("cpu", "torch", "triton", "sdpa", "flex")
PASSES = ("fwd", "fwd+bwd")
INTERPRETER_TILE_LIMIT = 512  # kept tiles x heads the Triton interpreter runs without --allow-interpreter

EXAMPLES = """examples:
  sparse-io-attn bench --pattern bigbird --seq-len 4096 --heads 8 --head-dim 64 --dtype fp32
  sparse-io-attn bench --pattern sliding_window:512 --backends torch,sdpa --pass fwd --json
  sparse-io-attn bench --pattern causal --seq-len 2k --csv bench.csv --json bench.json
  sparse-io-attn bench --pattern bigbird --seq-len 512 --heads 1 --backends triton --count

backends: torch (pure-PyTorch block-sparse path), triton (the library's kernels; on a CPU only
through Triton's interpreter: small sizes or --allow-interpreter), sdpa (dense
scaled_dot_product_attention with the equivalent element mask), flex (torch.compile(flex_attention)
with layout.to_flex_block_mask(); its backward is not implemented on CPU). A backend that cannot
run a case on this machine is listed as skipped with the reason."""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time backends and compare their traffic with the lower bound",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pattern", default="bigbird", help="pattern spec (default bigbird; see `layout --help`)")
    p.add_argument("--seq-len", type=common.parse_count, default=4096, help="sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA (default = --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--block", type=common.parse_count, default=64, help="layout block size (default 64)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--causal", action="store_true", help="element-level causal masking inside kept blocks")
    p.add_argument("--backends", default="cpu,torch,triton,sdpa,flex",
                   help="comma list of cpu,torch,triton,sdpa,flex (cpu: the C++ kernel, CPU tensors only)")
    p.add_argument("--pass", dest="passes", default="fwd,fwd+bwd", help="comma list of fwd,fwd+bwd")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported; default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (default 1)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="stop repeating a case after this long")
    p.add_argument("--cache", default=None, help="fast memory M for the bound, words or a size like 228KiB "
                   "(default: this GPU's shared memory per block, or the library's documented CPU default)")
    p.add_argument("--count", action="store_true", help="count the triton backend's traffic with IOCounter "
                   "(an extra run) instead of predicting it with the traffic model")
    p.add_argument("--allow-interpreter", action="store_true",
                   help=f"run triton through the interpreter on CPU beyond {INTERPRETER_TILE_LIMIT} tiles (slow)")
    p.add_argument("--csv", nargs="?", const="-", metavar="PATH", help="write rows as CSV (to stdout without PATH)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write header+rows as JSON (stdout without PATH)")
    p.add_argument("--md", metavar="PATH", help="write the header and table as Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------ cost model
def flops(layout, causal: bool, batch: int, heads: int, head_dim: int, pass_: str) -> int:
    """FLOPs on kept elements (``accounting.traffic.block_sparse_flops``: forward 4·D per kept score
    element, backward 10·D, the FlashAttention convention)."""
    fl = traffic.block_sparse_flops(layout, batch, heads, head_dim, causal=causal)
    if pass_ == "fwd+bwd":
        fl += traffic.block_sparse_flops(layout, batch, heads, head_dim, causal=causal, backward=True)
    return fl


# ------------------------------------------------------------------------------------ backends
class Skip(Exception):
    """A backend that cannot run this case on this machine; the message is the reason."""


def _attention_fn(backend: str, q, k, v, layout, causal: bool, args):
    """A callable computing the forward for one backend, or :class:`Skip`."""
    if backend == "torch":
        return lambda: block_sparse_attention(q, k, v, layout, causal=causal, backend="torch")
    if backend == "cpu":
        if q.device.type != "cpu":
            raise Skip("the C++ kernel runs on CPU tensors only")
        from sparse_io_attn.block_sparse import cpu  # the C++ build module loads torch._dynamo (and Triton)

        if not cpu.is_available():
            raise Skip(f"the C++ kernel is unavailable: {cpu.unavailable_reason()}")
        return lambda: block_sparse_attention(q, k, v, layout, causal=causal, backend="cpu")
    if backend == "triton":
        from sparse_io_attn._triton import runtime as triton_runtime

        if q.device.type != "cuda":
            tiles = layout.nnz_blocks * (1 if layout.num_layouts > 1 else q.shape[0] * q.shape[1])
            if not triton_runtime.INTERPRET:
                raise Skip("no CUDA device and Triton's interpreter is off (set TRITON_INTERPRET=1)")
            if tiles > INTERPRETER_TILE_LIMIT and not args.allow_interpreter:
                raise Skip(f"CPU: Triton runs only through its interpreter (~5 ms per tile); {tiles:,} tiles "
                           f"> {INTERPRETER_TILE_LIMIT}: use a smaller case or --allow-interpreter")
        return lambda: block_sparse_attention(q, k, v, layout, causal=causal, backend="triton")
    if backend == "sdpa":
        B, Hq = q.shape[:2]
        scores = B * Hq * q.shape[2] * k.shape[2] * max(q.element_size(), 4) * (3 if q.requires_grad else 1)
        free, source = available_memory_bytes(q.device)
        if free is not None and scores > free // 2:
            raise Skip(f"dense SDPA would materialize n x n scores (~{common.human_bytes(scores)}) on a device with "
                       f"{common.human_bytes(free)} available ({source})")
        mask = layout.to(q.device).expand_dense_mask(B, Hq)
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=q.device).tril()
        rep = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        return lambda: scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    if backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        if causal:
            raise Skip("flex with --causal is not wired in this benchmark (block mask only)")
        block_mask = layout.to(q.device).to_flex_block_mask()
        compiled = torch.compile(flex_attention, dynamic=False)
        gqa = q.shape[1] != k.shape[1]
        return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    raise ValueError(f"unknown backend {backend!r}")


def _cannot_run(backend: str) -> tuple[type[BaseException], ...]:
    """The errors that mean ``backend`` cannot run this case on this machine (reported as skipped):
    flex: ``torch.compile`` failing to build the kernel (no C++ compiler, unsupported block sizes);
    triton: the kernels' tiles needing more shared memory or registers than this GPU has."""
    if backend == "flex":
        import torch._dynamo.exc

        return (torch._dynamo.exc.BackendCompilerFailed,)
    if backend == "triton":
        from triton.runtime.errors import OutOfResources

        return (OutOfResources,)
    return ()


def _case_fn(fwd, pass_: str, q, k, v, do):
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                fwd()
        return run

    def run():
        for t in (q, k, v):
            t.grad = None
        fwd().backward(do)
    return run


# ------------------------------------------------------------------------------------ traffic
def triton_traffic(layout, q, k, v, causal: bool, pass_: str, count: bool, fwd):
    """``(bytes, "counted" | "predicted")`` for the triton backend: counted by the kernels under
    ``IOCounter`` (an extra run) with ``count``, else predicted by ``accounting.traffic``."""
    if count:
        with IOCounter() as io:
            if pass_ == "fwd":
                with torch.no_grad():
                    fwd()
            else:
                fwd().backward(torch.randn_like(q))
        return io.report.total_bytes, "counted"
    B, Hq, _, D = q.shape
    predict = traffic.block_sparse_forward if pass_ == "fwd" else traffic.block_sparse
    return predict(layout, B, Hq, k.shape[1], D, q.dtype, causal=causal).total_bytes, "predicted"


# ------------------------------------------------------------------------------------ main
def run(args) -> int:
    if "triton" in common.parse_list(args.backends, allowed=BACKENDS, what="--backends"):
        import sparse_io_attn._triton.runtime  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton is imported)
    dtype = common.parse_dtype(args.dtype)
    backends = common.parse_list(args.backends, allowed=BACKENDS, what="--backends")
    passes = common.parse_list(args.passes, allowed=PASSES, what="--pass")
    for name in ("batch", "heads", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_heads is not None and args.kv_heads < 1:
        raise ValueError(f"--kv-heads must be >= 1, got {args.kv_heads}")
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads} (GQA)")
    if not 16 <= args.head_dim <= 256:
        raise ValueError(f"--head-dim must be in 16..256, got {args.head_dim}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is present; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.json == "-" and args.csv == "-":
        raise ValueError("--json and --csv cannot both write to stdout; give one of them a PATH")
    for flag in ("json", "csv", "md"):   # refuse before the benchmark runs, not after
        common.check_writable(getattr(args, flag), f"--{flag}")
    kv = args.kv_heads or args.heads
    elem = torch.empty((), dtype=dtype).element_size()
    # q, k, v, do, out, their gradients, and the kernels' fp32 work copies (about 4 x q in fp32)
    tensors = args.batch * args.seq_len * args.head_dim * ((3 * args.heads + 2 * kv) * 2 * elem + 4 * args.heads * 4)
    common.check_memory(tensors, f"--seq-len {args.seq_len} with batch {args.batch}, {args.heads} heads, head dim "
                   f"{args.head_dim}", device, fix="use a smaller --seq-len or --batch")

    layout = common.build_layout(args.pattern, args.seq_len, args.block).to(device)
    B, H, D, n = args.batch, args.heads, args.head_dim, args.seq_len
    cache_words = default_cache_words(args.cache, dtype)
    header = common.machine_header(dtype, device)
    header.update({"pattern": layout.name, "seq_len": n, "batch": B, "heads": H, "kv_heads": kv_heads,
                   "head_dim": D, "block": args.block, "causal": args.causal, "density": round(layout.density, 4),
                   "cache_words": cache_words})

    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda h: torch.randn(B, h, n, D, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(H), mk(kv_heads), mk(kv_heads)
    do = mk(H)
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    rows = []
    with common.progress(len(backends) * len(passes), "bench", enabled=not args.no_progress) as bar:
        for backend in backends:
            for pass_ in passes:
                row = {"backend": backend, "pass": pass_, "status": "ok", "reason": ""}
                rows.append(row)
                need_grad = pass_ != "fwd"
                qq, kk, vv = (t.detach().requires_grad_(need_grad) for t in (q, k, v))
                try:
                    fwd = _attention_fn(backend, qq, kk, vv, layout, args.causal, args)
                    timing = common.time_fn(_case_fn(fwd, pass_, qq, kk, vv, do), warmup=args.warmup,
                                       repeats=args.repeats, max_seconds=args.max_seconds, sync=sync)
                except Skip as e:
                    row.update(status="skipped", reason=str(e))
                    if backend == "triton":  # not timed, but its traffic is still known from the model
                        traffic, source = triton_traffic(layout, qq, kk, vv, args.causal, pass_, False, None)
                        row.update(traffic_bytes=traffic, traffic_source=source)
                    bar.update(note=f"{backend} {pass_} skipped")
                    continue
                except NotImplementedError as e:  # e.g. FlexAttention's backward on a CPU
                    row.update(status="skipped", reason=f"NotImplementedError: {' '.join(str(e).split())[:160]}")
                    bar.update(note=f"{backend} {pass_} skipped")
                    continue
                except _cannot_run(backend) as e:
                    what = ("torch.compile cannot build flex_attention for this case here" if backend == "flex" else
                            "the kernels need more GPU resources than this device has")
                    row.update(status="skipped",
                               reason=f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
                    bar.update(note=f"{backend} {pass_} skipped")
                    continue
                fl = flops(layout, args.causal, B, H, D, pass_)
                row.update(median_ms=timing["median_s"] * 1e3, iqr_ms=timing["iqr_s"] * 1e3,
                           min_ms=timing["min_s"] * 1e3, max_ms=timing["max_s"] * 1e3, runs=timing["runs"],
                           gflop=fl / 1e9, tflops=fl / timing["median_s"] / 1e12)
                if backend == "triton":
                    traffic, source = triton_traffic(layout, qq, kk, vv, args.causal, pass_, args.count, fwd)
                    row.update(traffic_bytes=traffic, traffic_source=source)
                else:
                    row.update(traffic_bytes=None, traffic_source="-")
                bar.update(note=f"{backend} {pass_} {timing['median_s'] * 1e3:.1f} ms")

    bound = _bound_columns(rows, layout, args, dtype, cache_words, B, H, D, n)
    _emit(rows, header, bound, args)
    return 0


def _bound_columns(rows, layout, args, dtype, cache_words, B, H, D, n):
    """Fill bound_bytes and traffic/bound for every row; return the bound of each pass."""
    summary = {}
    for pass_ in {r["pass"] for r in rows}:
        summary[pass_] = attention_bound(n, D, cache_words, dtype, layout=layout, causal=args.causal, pass_=pass_,
                                         batch=B, heads=args.heads, kv_heads=args.kv_heads)
    for r in rows:
        b = summary.get(r["pass"])
        if b:
            r["bound_bytes"] = b["bound_bytes"]
            r["bound_binds"] = b["binds"]
            if r.get("traffic_bytes"):
                r["traffic_over_bound"] = r["traffic_bytes"] / b["bound_bytes"]
    return summary


COLUMNS = [("backend", "backend"), ("pass", "pass"), ("status", "status"), ("median_ms", "median ms"),
           ("iqr_ms", "IQR ms"), ("min_ms", "min ms"), ("max_ms", "max ms"), ("tflops", "TFLOP/s (kept)"),
           ("traffic_bytes", "traffic B"), ("traffic_source", "traffic is"), ("bound_bytes", "bound B"),
           ("traffic_over_bound", "traffic/bound")]


def _emit(rows, header, bound, args) -> None:
    table = common.format_table(rows, COLUMNS)
    notes = [f"- {r['backend']} {r['pass']}: {r['reason']}" for r in rows if r.get("reason")]
    bound_lines = []
    for pass_, b in sorted(bound.items()):
        bound_lines.append(f"- bound ({pass_}): {b['bound_bytes']:,} B = max(compulsory {b['compulsory_bytes']:,} B, "
                           f"{b['theorem']} {b['theorem_bytes']:,.0f} B, unit constants); binding: {b['binds']}")
        if b.get("note"):
            bound_lines.append(f"  note: {b['note']}")
    text = "\n".join([common.format_header(header),
                      f"# pattern {header['pattern']} (density {header['density']}), n={header['seq_len']}, "
                      f"B={header['batch']}, H={header['heads']}/{header['kv_heads']}, D={header['head_dim']}, "
                      f"block {header['block']}, causal={header['causal']}, M={header['cache_words']:,} words",
                      table] + bound_lines + notes)
    payload = {"header": header, "rows": rows, "bounds": bound}
    if args.json == "-":
        print(common.to_json(payload))
    elif args.csv == "-":
        print(common.format_csv(rows), end="")
    else:
        print(text)
    if args.json and args.json != "-":
        common.write_json(args.json, payload)
    if args.csv and args.csv != "-":
        common.write_csv(args.csv, rows, header)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text("```\n" + text + "\n```\n")
