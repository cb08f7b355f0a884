"""``sparse-io-attn bounds``: the paper's I/O lower bounds for one attention problem.

Prints the paper's regime (small cache M < d^2 or large cache) and the kernels the library runs
(``dense.backward`` / ``dense.forward`` with ``regime="auto"``: the kernel that fits and moves the
fewest predicted bytes, with the bytes of each), both terms of Theorem 1.1 (dense backward) and of
Saha & Ye's dense forward bound, Theorem 4.5 and Theorem 1.2 (Table 1's informal sparse bound in
Z_input, Z_QK) for a block-sparse pattern or given nnz counts, the binding term and the compulsory
traffic (each input read once, each output written once). ``--verbose`` adds the explicit-constant
bounds for *materialising* QK^T (a standalone product writing its n x n output: not a bound for
attention, which need not write it). All bounds are asymptotic expressions evaluated
with unit constants (the paper states Theta/Omega only); words are matrix elements, bytes = words x
dtype size.
"""
from __future__ import annotations

import argparse
import contextlib
import resource

import torch

from sparse_io_attn._memory import available_memory_bytes
from sparse_io_attn.accounting import traffic
from sparse_io_attn.bounds import (DEFAULT_CPU_FAST_MEMORY_BYTES, dense_backward, dense_forward,
                                   device_fast_memory_words, get_device, parse_memory, sparse, sparse_informal)
from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.cli import _common as common
from sparse_io_attn.dense import regime

EXAMPLES = """examples:
  sparse-io-attn bounds --seq-len 8192 --head-dim 128 --cache 228KiB --dtype bf16
  sparse-io-attn bounds --seq-len 8192 --head-dim 256 --device a100 --dtype fp32
  sparse-io-attn bounds --seq-len 8192 --head-dim 128 --cache 228KiB --pattern sliding_window:512
  sparse-io-attn bounds --seq-len 4096 --head-dim 64 --cache 116224 \\
      --z-a 262144 --z-x 4096 --z-ax 262144 --z-axa 1048576 --json
  sparse-io-attn bounds --seq-len 4096 --head-dim 64 --cache 116224 --z-input 262144 --z-qk 1048576
  sparse-io-attn bounds --seq-len 8192 --head-dim 256 --device h100 --dtype fp32 --verbose

--cache takes words (116224) or a byte size with a unit (228KiB, 48KB) converted with --dtype.
Without --cache, M is --device's on-chip memory per block, or the current GPU's, or the
library's documented CPU default."""

Z_FLAGS = ("z_a", "z_x", "z_ax", "z_axa")
INFORMAL_FLAGS = ("z_input", "z_qk")


def add_parser(sub) -> None:
    p = sub.add_parser("bounds", help="I/O lower bounds, regime and kernel choice for one problem",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=common.parse_count, required=True, help="n, sequence length (4k accepted)")
    p.add_argument("--head-dim", type=int, required=True, help="d, head dimension")
    p.add_argument("--cache", default=None, help="fast memory M: words or a size like 228KiB")
    p.add_argument("--device", default=None, help="device name from the table (h100, a100, ...) for M")
    p.add_argument("--dtype", default="bf16", help="fp32, fp16 or bf16 (default bf16)")
    p.add_argument("--pattern", default=None, help="block-sparse QK pattern spec, e.g. sliding_window:512")
    p.add_argument("--block", type=common.parse_count, default=64, help="block size for --pattern (default 64)")
    p.add_argument("--causal", action="store_true", help="count only key <= query inside the pattern")
    for z, what in zip(Z_FLAGS, ("min(nnz A1, nnz A2)", "nnz X", "min(nnz A1X, nnz XA2^T)", "nnz A1XA2^T")):
        p.add_argument(f"--{z.replace('_', '-')}", dest=z, type=common.parse_count, default=None, help=f"Z: {what}")
    p.add_argument("--z-input", dest="z_input", type=common.parse_count, default=None,
                   help="Theorem 1.2: nonzeros of the input matrix (with --z-qk)")
    p.add_argument("--z-qk", dest="z_qk", type=common.parse_count, default=None,
                   help="Theorem 1.2: nonzeros of the key-query matrix (with --z-input)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the explicit-constant bounds for materialising QK^T (not attention bounds)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------ helpers
def default_cache_words(cache, dtype, device_name: str | None = None) -> int:
    """M in words: ``cache`` (words or a size string) if given, else the device table / current GPU."""
    if cache is not None:
        return int(parse_memory(str(cache), dtype))
    words = device_fast_memory_words(dtype, device=device_name)
    if words is None:  # no CUDA device and no --device: the documented CPU default (an H100's)
        words = DEFAULT_CPU_FAST_MEMORY_BYTES // itemsize(dtype)
    return int(words)


def qk_nnz(layout, causal: bool) -> int:
    """Kept score elements per stored mask, averaged over the masks (Z_AXA under the pattern),
    from ``accounting.traffic.kept_elements`` (the one cost model)."""
    total = traffic.kept_elements(layout, layout.layout_batch, layout.layout_heads, causal=causal)
    return round(total / layout.num_layouts)


PATTERN_NOTE = ("Z_AXA counts the kept scores of the QK pattern: Theorem 4.5 is proven for structurally "
                "sparse operands, not for masked attention, so this term is the theorem's formula used "
                "as an estimate, not a proven lower bound")


def attention_bound(n: int, d: int, cache_words: int, dtype, *, layout=None, causal: bool = False,
                    pass_: str = "fwd+bwd", batch: int = 1, heads: int = 1, kv_heads: int | None = None) -> dict:
    """The lower bound a benchmark compares its traffic with, in bytes, for ``batch * heads``
    (batch, head) problems of attention under a QK pattern (dense Q = A1 X, K = A2 with X = I:
    Z_A = n·d, Z_X = d², Z_AX = n·d, Z_AXA = kept score elements per head, averaged over heads).

    ``bound_bytes = max(compulsory, theorem)``: compulsory = inputs read once and outputs written
    once (fwd: q, k, v in, o out; fwd+bwd: q, k, v, do in, o, dq, dk, dv out; k/v with the GQA
    kv heads); theorem = ``batch * heads`` x Theorem 4.5 with unit constants (a lower bound for
    forward and for backward alike, hence also for fwd+bwd). Returns both parts and which binds.
    """
    kv_heads = kv_heads or heads
    es = itemsize(dtype)
    if layout is None:
        z_axa = n * n
    else:
        z_axa = round(traffic.kept_elements(layout, batch, heads, causal=causal) / (batch * heads))
    b = sparse(n * d, d * d, n * d, z_axa, cache_words, n=n, d=d)
    theorem_words = b.value_words * batch * heads
    per = 2 if pass_ == "fwd" else 4
    compulsory_words = per * batch * n * d * (heads + kv_heads)
    theorem_bytes = theorem_words * es
    compulsory_bytes = compulsory_words * es
    return {"bound_bytes": int(max(theorem_bytes, compulsory_bytes)), "theorem_bytes": theorem_bytes,
            "compulsory_bytes": int(compulsory_bytes), "theorem": "Thm 4.5",
            "binds": "compulsory" if compulsory_bytes >= theorem_bytes else "Thm 4.5",
            "z_per_head": {"Z_A": n * d, "Z_X": d * d, "Z_AX": n * d, "Z_AXA": z_axa}, "cache_words": cache_words,
            "note": "" if layout is None or z_axa == n * n else PATTERN_NOTE}


@contextlib.contextmanager
def _one_thread():
    """Run the block counting on one torch thread: its passes are O(kept blocks) and memory-bound,
    and on a shared machine a thread pool that waits for busy cores costs more than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_OOM_TEXT = ("can't allocate memory", "cannot allocate memory", "not enough memory", "failed to map segment")


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: Python's ``MemoryError``, torch's allocator ``RuntimeError``, or a
    shared library (Triton's) that could not be mapped."""
    return isinstance(exc, MemoryError) or (isinstance(exc, (RuntimeError, OSError, ImportError)) and any(
        s in str(exc).lower() for s in _OOM_TEXT))


def _memory_limits() -> str:
    """The limits an allocation failure ran into, in words: ``ulimit -v`` and ``MemAvailable``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    free, source = available_memory_bytes("cpu")
    parts = [] if soft == resource.RLIM_INFINITY else [f"address-space limit (ulimit -v) {soft / 2**30:.2f} GiB"]
    if free is not None:
        parts.append(f"{free / 2**30:.1f} GiB available ({source})")
    return "; ".join(parts) or "memory limits unknown"


@contextlib.contextmanager
def _memory_for(what: str, fix: str):
    """Turn running out of memory inside the block into a ``ValueError`` (one line from the CLI)
    naming ``what`` was being done, the limits met and ``fix``."""
    try:
        yield
    except (MemoryError, RuntimeError, OSError, ImportError) as e:
        if not _out_of_memory(e):
            raise
        raise ValueError(f"out of memory {what} ({_memory_limits()}); {fix}") from None


def pattern_counts(spec: str, n: int, block: int, causal: bool):
    """``(layout, Z_AXA)`` for ``--pattern``: the layout built from ``spec`` and its kept score
    elements per stored mask (:func:`qk_nnz`), in O(kept blocks + stored masks) memory, on one
    torch thread. Running out of memory raises ``ValueError`` naming the problem, the limits met
    and what to change."""
    with _memory_for(f"counting --pattern {spec} at --seq-len {n:,}, --block {block}",
                     "use a larger --block or a shorter --seq-len, or allow the process more memory"), _one_thread():
        layout = common.build_layout(spec, n, block)
        return layout, qk_nnz(layout, causal)


# ------------------------------------------------------------------------------------ main
def run(args) -> int:
    dtype = common.parse_dtype(args.dtype)
    n, d = args.seq_len, args.head_dim
    if d < 1:
        raise ValueError(f"--head-dim must be >= 1, got {d}")
    given = [z for z in Z_FLAGS if getattr(args, z) is not None]
    informal = [z for z in INFORMAL_FLAGS if getattr(args, z) is not None]
    if informal and len(informal) != 2:
        raise ValueError("--z-input and --z-qk go together (Theorem 1.2)")
    if informal and (given or args.pattern):
        raise ValueError("give --z-input/--z-qk (Theorem 1.2) or --pattern / the four --z-* counts (Theorem 4.5, "
                         "which also prints Theorem 1.2), not both")
    if args.pattern and given:
        raise ValueError("give either --pattern or the --z-* counts, not both")
    if given and len(given) != 4:
        missing = [f"--{z.replace('_', '-')}" for z in Z_FLAGS if z not in given]
        raise ValueError(f"the Z counts go together; missing {', '.join(missing)}")
    if args.causal and not args.pattern:
        raise ValueError("--causal applies to --pattern; pass a pattern (e.g. --pattern dense --causal)")
    if args.device is not None:
        get_device(args.device)  # ValueError listing the known names
    M = default_cache_words(args.cache, dtype, args.device)

    choice = regime.kernel_choice(n, d, M, dtype)
    out = {"n": n, "d": d, "dtype": args.dtype, "M_words": M, "M_bytes": M * itemsize(dtype),
           "d_squared": d * d, "M_over_d2": M / (d * d),
           "regime": "small cache (M < d^2)" if M < d * d else "large cache (M >= d^2)",
           "kernel_choice": choice["backward"]["summary"], "kernels": choice,
           "source_of_M": (f"--cache {args.cache}" if args.cache else
                           f"device table: {args.device}" if args.device else
                           "this GPU's shared memory per block" if torch.cuda.is_available() else
                           "no GPU: DEFAULT_CPU_FAST_MEMORY_BYTES, an H100's 227 KiB per block"),
           "constants": "unit constants: the paper's bounds are Theta/Omega without stated constants"}
    objs = {"dense_backward": dense_backward(n, d, M, dtype=dtype),
            "dense_forward": dense_forward(n, d, M, dtype=dtype)}
    if args.pattern or given:
        if args.pattern:
            layout, z_axa = pattern_counts(args.pattern, n, args.block, args.causal)
            z = {"Z_A": n * d, "Z_X": d * d, "Z_AX": n * d, "Z_AXA": z_axa}
            out["pattern"] = {"name": layout.name, "density": layout.density, "block": args.block,
                              "note": "dense Q/K operands (Z_A = n d, Z_X = d^2, Z_AX = n d), Z_AXA = kept score "
                                      "elements of the pattern" + (" with causal masking" if args.causal else "")}
        else:
            z = {k: getattr(args, k.lower()) for k in ("Z_A", "Z_X", "Z_AX", "Z_AXA")}
        objs["sparse"] = sparse(z["Z_A"], z["Z_X"], z["Z_AX"], z["Z_AXA"], M, n=n, d=d, dtype=dtype,
                                note=PATTERN_NOTE if args.pattern else "")
        objs["sparse_informal"] = sparse_informal(z["Z_A"], z["Z_AXA"], M, n=n, d=d, dtype=dtype,
                                                  note="Z_input = Z_A, Z_QK = Z_AXA" +
                                                  ("; " + PATTERN_NOTE if args.pattern else ""))
    elif informal:
        objs["sparse_informal"] = sparse_informal(args.z_input, args.z_qk, M, n=n, d=d, dtype=dtype)
    for key, b in objs.items():
        out[key] = b.to_dict()
    if args.json:
        print(common.to_json(out))
        return 0
    print(_text(out, objs, verbose=args.verbose))
    return 0


def _text(out: dict, objs: dict, verbose: bool = False) -> str:
    k = out["kernels"]
    lines = [f"n = {out['n']:,}, d = {out['d']}, dtype {out['dtype']}, M = {out['M_words']:,} words "
             f"({common.human_bytes(out['M_bytes'])}; {out['source_of_M']})",
             f"M / d^2 = {out['M_over_d2']:.3g} -> {out['regime']}",
             f"backward: {k['backward']['summary']}", f"forward:  {k['forward']['summary']}"]
    for pass_ in ("backward", "forward"):
        cands = k[pass_].get("candidates") or {}
        parts = [f"{name} {c['bytes']:.3e} B" if c["feasible"] else f"{name} -" for name, c in cands.items()]
        if parts:
            lines.append(f"  predicted {pass_} bytes (one head, all outputs): " + ", ".join(parts))
    g = k["backward_dX_path_bytes"]
    if g.get("small") and any(g.get(v) for v in ("large-faithful", "large-fa2")):
        best = min(v for key, v in g.items() if key != "small" and v)
        lines.append(f"  on the paper's dX path alone: small-cache / best large-cache = {g['small'] / best:.3g}")
    if "pattern" in out:
        p = out["pattern"]
        lines.append(f"pattern {p['name']}, density {p['density']:.4f}, block {p['block']}: {p['note']}")
    for key in ("dense_backward", "dense_forward", "sparse", "sparse_informal"):
        if key in objs:
            lines += ["", objs[key].describe(verbose=verbose)]
    return "\n".join(lines)
