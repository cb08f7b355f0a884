"""Pattern builders: each returns a :class:`~sparse_io_attn.BlockSparseLayout` with a readable name.

Signature shape: ``NAME(seqlen, block_size, <pattern parameters>, *, causal=False, [num_heads=1,
seed=0])``. ``seqlen`` is an int or a ``(seqlen_q, seqlen_k)`` pair, ``block_size`` an int or a
``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` pair (only :func:`document` takes ``cu_seqlens`` first).

Every pattern is defined on *elements* ``(q, k)`` (query position ``q``, key position ``k``,
top-left aligned, ``d = q - k``); a block is kept iff at least one of its in-range elements is
allowed (exactly what ``BlockSparseLayout.from_dense_mask`` of the element mask gives). The block
masks are computed from the block extents, never from the ``seqlen_q x seqlen_k`` element mask, so
long sequences are cheap. ``causal=True`` intersects the element definition with ``k <= q``.

==================  ==========================================================================
pattern             element ``(q, k)`` allowed iff
==================  ==========================================================================
dense               always
causal              ``k <= q``
sliding_window      ``|q - k| <= window`` (``window`` in elements)
strided             ``|q - k| < stride`` or ``(q - k) % stride == 0`` (Child et al. 2019)
fixed               ``q // stride == k // stride`` or ``k % stride >= stride - summary`` (Child et al.)
longformer          ``|q - k| <= window`` or ``q`` or ``k`` is a global token
bigbird             ``|q - k| <= window`` or query block ``< num_global`` or key block ``< num_global``;
                    plus ``num_random`` random key blocks per query-block row (seeded, per head)
random              ``round(density * n)`` blocks of the ``n`` allowed ones, uniformly (seeded, per head)
document            ``q`` and ``k`` in the same document of ``cu_seqlens`` (packed sequences)
==================  ==========================================================================

Specs (``from_spec``, used by the CLI's ``--pattern``)::

    spec  := NAME [":" arg ("," arg)*]
    arg   := value | KEY "=" value | FLAG          # FLAG: a bare boolean name, e.g. causal
    value := int | float | true | false | int ("/" int)+      # "/" separates a list

Positional values fill the pattern's main parameters in order (see ``SPEC_PARAMS``), e.g.
``sliding_window:512``, ``bigbird:window=256,global=1,random=2``, ``random:0.1,seed=3,heads=8``,
``document:4`` (4 equal documents) or ``document:lengths=1000/3096,causal``. Keys accept the full
parameter names and the short aliases in ``ALIASES`` (``w``, ``g``/``global``, ``r``/``random``,
``d``, ``c``, ``heads``). Parameters left out get defaults scaled to ``seqlen`` and ``block_size``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from sparse_io_attn.layout.core import BlockSparseLayout, _pair

__all__ = ["dense", "causal", "sliding_window", "strided", "fixed", "longformer", "bigbird", "random",
           "document", "block_diagonal", "from_spec", "get", "available", "SPEC_PARAMS", "ALIASES"]


# ---------------------------------------------------------------------------------------- helpers
class _Grid:
    """Block extents of a ``seqlen`` x ``block_size`` grid: ``q_lo/q_hi [R, 1]``, ``k_lo/k_hi [1, C]``
    (first and last in-range element of each block, int64)."""

    def __init__(self, seqlen, block_size):
        self.sq, self.sk = _pair(seqlen, "seqlen")
        self.bq, self.bk = _pair(block_size, "block_size")
        self.R, self.C = math.ceil(self.sq / self.bq), math.ceil(self.sk / self.bk)
        r, c = torch.arange(self.R), torch.arange(self.C)
        self.q_lo = (r * self.bq)[:, None]
        self.q_hi = (torch.clamp((r + 1) * self.bq, max=self.sq) - 1)[:, None]
        self.k_lo = (c * self.bk)[None, :]
        self.k_hi = (torch.clamp((c + 1) * self.bk, max=self.sk) - 1)[None, :]

    def band(self, lo: float, hi: float) -> torch.Tensor:
        """``[R, C]``: some element of the block has ``lo <= q - k <= hi``."""
        return (self.q_lo - self.k_hi <= hi) & (self.q_hi - self.k_lo >= lo)

    def causal(self) -> torch.Tensor:
        return self.band(0, math.inf)

    def allowed(self, causal: bool) -> torch.Tensor:
        return self.causal() if causal else torch.ones(self.R, self.C, dtype=torch.bool)

    def layout(self, block_mask: torch.Tensor, name: str) -> BlockSparseLayout:
        return BlockSparseLayout.from_block_mask(block_mask, (self.bq, self.bk), (self.sq, self.sk),
                                                 name=name)


def _int(x, what: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{what} must be an int, got {x!r}")
    if x < lo:
        raise ValueError(f"{what} must be >= {lo}, got {x}")
    return x


def _bool(x, what: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{what} must be True or False, got {x!r}")
    return x


def _heads(num_heads) -> int:
    return _int(num_heads, "num_heads", 1)


def _generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(_int(seed, "seed"))


def _tag(name: str, params: str, causal: bool) -> str:
    inner = ",".join(p for p in (params, "causal" if causal else "") if p)
    return f"{name}({inner})" if inner else name


def _default_window(seqlen) -> int:
    """4% of ``seqlen_k`` each side: about 10% block density at N = 4096, block 64."""
    return max(1, _pair(seqlen, "seqlen")[1] // 25)


# ---------------------------------------------------------------------------------------- patterns
def dense(seqlen, block_size, *, causal: bool = False) -> BlockSparseLayout:
    """Every block (``causal=True`` gives the same as :func:`causal`)."""
    g = _Grid(seqlen, block_size)
    return g.layout(g.allowed(_bool(causal, "causal")), "causal" if causal else "dense")


def causal(seqlen, block_size) -> BlockSparseLayout:
    """Block-level lower triangle: block ``(i, j)`` is kept iff it holds an element with ``k <= q``
    (top-left aligned, also for rectangular blocks and ``seqlen_q != seqlen_k``)."""
    g = _Grid(seqlen, block_size)
    return g.layout(g.causal(), "causal")


def sliding_window(seqlen, block_size, window: int | None = None, *,
                   causal: bool = False) -> BlockSparseLayout:
    """Local band: ``|q - k| <= window`` (``0 <= q - k <= window`` with ``causal``), ``window`` in
    elements (default ``seqlen_k // 25``)."""
    window = _default_window(seqlen) if window is None else _int(window, "window")
    g = _Grid(seqlen, block_size)
    mask = g.band(0, window) if _bool(causal, "causal") else g.band(-window, window)
    return g.layout(mask, _tag("sliding_window", f"w={window}", causal))


def strided(seqlen, block_size, stride: int | None = None, *, causal: bool = False) -> BlockSparseLayout:
    """Sparse Transformer "strided" (Child et al. 2019): a local window ``|q - k| < stride`` plus
    every ``stride``-th diagonal ``(q - k) % stride == 0``; ``causal`` keeps ``q - k >= 0`` only.
    Default ``stride = 8 * BLOCK_SIZE_KV``. At block granularity every pair of blocks whose
    ``q - k`` range spans a multiple of ``stride`` is kept, so ``stride <= block`` is dense."""
    g = _Grid(seqlen, block_size)
    stride = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    _bool(causal, "causal")
    lo = 0 if causal else -(stride - 1)
    local = g.band(lo, stride - 1)
    d_hi = g.q_hi - g.k_lo
    d_lo = g.q_lo - g.k_hi
    if causal:
        d_lo = torch.clamp(d_lo, min=0)
    strided_ = torch.div(d_hi, stride, rounding_mode="floor") * stride >= d_lo  # a multiple in range
    return g.layout(local | strided_, _tag("strided", f"stride={stride}", causal))


def fixed(seqlen, block_size, stride: int | None = None, summary: int | None = None, *,
          causal: bool = False) -> BlockSparseLayout:
    """Sparse Transformer "fixed" (Child et al. 2019): attend within the same chunk of ``stride``
    positions (``q // stride == k // stride``) and to the last ``summary`` positions of every chunk
    (``k % stride >= stride - summary``). Defaults: ``stride = 8 * BLOCK_SIZE_KV``,
    ``summary = BLOCK_SIZE_KV`` (capped at ``stride``)."""
    g = _Grid(seqlen, block_size)
    stride = 8 * g.bk if stride is None else _int(stride, "stride", 1)
    summary = min(g.bk, stride) if summary is None else _int(summary, "summary", 1)
    if summary > stride:
        raise ValueError(f"summary must be <= stride ({stride}), got {summary}")
    l = stride
    if _bool(causal, "causal"):
        overlap = (g.k_lo <= g.q_hi) & (g.q_lo <= g.k_hi)
        same_chunk = overlap | ((g.k_hi < g.q_lo) & (g.k_hi // l == g.q_lo // l))
        k_max = torch.minimum(g.k_hi, g.q_hi)
    else:
        same_chunk = (g.q_lo // l <= g.k_hi // l) & (g.k_lo // l <= g.q_hi // l)
        k_max = g.k_hi.expand(g.R, g.C)
    first_summary = torch.maximum(g.k_lo, (g.k_lo // l) * l + l - summary)  # first k >= k_lo in a summary
    mask = same_chunk | (first_summary <= k_max)
    return g.layout(mask, _tag("fixed", f"stride={stride},c={summary}", causal))


def longformer(seqlen, block_size, window: int | None = None, global_tokens: int | Sequence[int] = 1,
               *, causal: bool = False) -> BlockSparseLayout:
    """Longformer: sliding window ``|q - k| <= window`` plus global tokens, whose rows (as queries)
    and columns (as keys) are complete. ``global_tokens`` is a count (the first ``n`` positions) or a
    sequence of positions; ``window`` in elements (default ``seqlen_k // 25``)."""
    g = _Grid(seqlen, block_size)
    window = _default_window(seqlen) if window is None else _int(window, "window")
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        n = _int(global_tokens, "global_tokens")
        pos = torch.arange(n)
        tag = f"w={window},g={n}"
    elif isinstance(global_tokens, Sequence) and all(
            isinstance(p, int) and not isinstance(p, bool) for p in global_tokens):
        pos = torch.tensor(sorted(set(global_tokens)), dtype=torch.int64)
        if pos.numel() and (pos.min() < 0 or pos.max() >= max(g.sq, g.sk)):
            raise ValueError(f"global_tokens must lie in [0, {max(g.sq, g.sk)}), got values in "
                             f"[{int(pos.min())}, {int(pos.max())}]")
        tag = f"w={window},g={pos.numel()}"
    else:
        raise TypeError(f"global_tokens must be an int count or a sequence of int positions, "
                        f"got {global_tokens!r}")
    _bool(causal, "causal")
    band = g.band(0, window) if causal else g.band(-window, window)
    # last global query of each query block (-1: none) and first global key of each key block
    is_gq = torch.zeros(g.R * g.bq, dtype=torch.bool)
    is_gq[pos[pos < g.sq]] = True
    is_gk = torch.zeros(g.C * g.bk, dtype=torch.bool)
    is_gk[pos[pos < g.sk]] = True
    big = g.sq + g.sk
    gq_last = torch.where(is_gq, torch.arange(g.R * g.bq), -1).view(g.R, g.bq).amax(1)[:, None]
    gk_first = torch.where(is_gk, torch.arange(g.C * g.bk), big).view(g.C, g.bk).amin(1)[None, :]
    rows = (gq_last >= 0) & ((g.k_lo <= gq_last) if causal else True)
    cols = (gk_first < big) & ((gk_first <= g.q_hi) if causal else True)
    return g.layout(band | rows | cols, _tag("longformer", tag, causal))


def bigbird(seqlen, block_size, *, window: int | None = None, num_global: int = 2, num_random: int = 3,
            seed: int = 0, num_heads: int = 1, causal: bool = False) -> BlockSparseLayout:
    """BigBird (Zaheer et al. 2020): sliding window ``|q - k| <= window`` (elements, default
    ``BLOCK_SIZE_KV``: 3 blocks per row), the first ``num_global`` query blocks attend everywhere
    and the first ``num_global`` key blocks are attended by all, plus ``num_random`` random key
    blocks per query-block row drawn uniformly from the allowed blocks not already kept (all of them
    if fewer remain). Random blocks come from ``torch.Generator().manual_seed(seed)`` and differ per
    head when ``num_heads > 1`` (a per-head layout). Defaults give about 15% density at N = 4096,
    block 64."""
    g = _Grid(seqlen, block_size)
    window = g.bk if window is None else _int(window, "window")
    num_global = _int(num_global, "num_global")
    num_random = _int(num_random, "num_random")
    H = _heads(num_heads)
    allowed = g.allowed(_bool(causal, "causal"))
    band = g.band(0, window) if causal else g.band(-window, window)
    r, c = torch.arange(g.R)[:, None], torch.arange(g.C)[None, :]
    fixed_part = (band | (r < num_global) | (c < num_global)) & allowed
    candidates = allowed & ~fixed_part
    scores = torch.rand(H, g.R, g.C, generator=_generator(seed))
    scores = torch.where(candidates, scores, -1.0)
    top = scores.topk(min(num_random, g.C), dim=-1).indices
    rand = torch.zeros(H, g.R, g.C, dtype=torch.bool).scatter_(-1, top, True) & candidates
    mask = fixed_part | rand
    tag = f"w={window},g={num_global},r={num_random},seed={seed}"
    return g.layout(mask if H > 1 else mask[0], _tag("bigbird", tag, causal))


def random(seqlen, block_size, density: float = 0.1, *, seed: int = 0, num_heads: int = 1,
           causal: bool = False) -> BlockSparseLayout:
    """Exactly ``round(density * n)`` blocks per head (Python ``round``), chosen uniformly without
    replacement from the ``n`` allowed blocks (all blocks, or the causal ones with ``causal``), with
    ``torch.Generator().manual_seed(seed)``; heads differ when ``num_heads > 1``."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    g = _Grid(seqlen, block_size)
    H = _heads(num_heads)
    where = g.allowed(_bool(causal, "causal")).reshape(-1).nonzero()[:, 0]
    k = round(density * where.numel())
    gen = _generator(seed)
    mask = torch.zeros(H, g.R * g.C, dtype=torch.bool)
    for h in range(H):
        mask[h, where[torch.randperm(where.numel(), generator=gen)[:k]]] = True
    mask = mask.view(H, g.R, g.C)
    return g.layout(mask if H > 1 else mask[0], _tag("random", f"d={density},seed={seed}", causal))


def document(cu_seqlens, block_size, *, causal: bool = False) -> BlockSparseLayout:
    """Packed variable-length sequences: document ``i`` holds positions ``[cu_seqlens[i],
    cu_seqlens[i+1])`` and attends only to itself (block diagonal; ``causal`` within each document).
    ``cu_seqlens`` is a non-decreasing int sequence or 1-D int tensor starting at 0; ``seqlen =
    cu_seqlens[-1]`` for queries and keys."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of "
                            f"shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.detach().cpu().to(torch.int64)
    elif isinstance(cu_seqlens, Sequence) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        cu = torch.tensor(list(cu_seqlens), dtype=torch.int64)
    else:
        raise TypeError(f"cu_seqlens must be a sequence of ints or a 1-D integer tensor, got "
                        f"{type(cu_seqlens).__name__}")
    if cu.numel() < 2 or cu[0] != 0 or (cu[1:] < cu[:-1]).any() or cu[-1] <= 0:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the total "
                         f"length > 0 (e.g. [0, 100, 300]), got {cu.tolist()[:8]}"
                         f"{'...' if cu.numel() > 8 else ''}")
    n = int(cu[-1])
    g = _Grid(n, block_size)
    bounds = cu[1:]

    def doc(x):  # document id of each position
        return torch.searchsorted(bounds, x.contiguous(), right=True)

    if _bool(causal, "causal"):
        overlap = (g.k_lo <= g.q_hi) & (g.q_lo <= g.k_hi)
        mask = overlap | ((g.k_hi < g.q_lo) & (doc(g.k_hi) == doc(g.q_lo)))
    else:
        mask = (doc(g.q_lo) <= doc(g.k_hi)) & (doc(g.k_lo) <= doc(g.q_hi))
    return g.layout(mask, _tag("document", f"n={int((cu[1:] > cu[:-1]).sum())}", causal))


block_diagonal = document


# ---------------------------------------------------------------------------------------- specs
def _document_spec(seqlen, block_size, num_docs: int = 4, lengths=None, cu_seqlens=None, *,
                   causal: bool = False) -> BlockSparseLayout:
    """``document`` for specs: ``cu_seqlens``, document ``lengths`` or ``num_docs`` equal parts of
    ``seqlen`` (the last one takes the remainder)."""
    total = _pair(seqlen, "seqlen")
    if total[0] != total[1]:
        raise ValueError(f"document needs seqlen_q == seqlen_k, got {total}")
    total = total[0]
    if cu_seqlens is None:
        if lengths is None:
            num_docs = _int(num_docs, "num_docs", 1)
            step = max(1, total // num_docs)
            lengths = [step] * (min(num_docs, total) - 1)
            lengths.append(total - sum(lengths))
        lengths = [lengths] if isinstance(lengths, int) else list(lengths)
        cu_seqlens = [0]
        for x in lengths:
            cu_seqlens.append(cu_seqlens[-1] + _int(x, "document length"))
    if list(cu_seqlens)[-1] != total:
        raise ValueError(f"the documents must cover seqlen = {total} positions, got "
                         f"{list(cu_seqlens)[-1]}")
    return document(list(cu_seqlens), block_size, causal=causal)


def _causal_spec(seqlen, block_size, flag) -> BlockSparseLayout:
    if flag is not True:
        raise ValueError(f"pattern 'causal' cannot be built with causal={flag!r}; use 'dense'")
    return causal(seqlen, block_size)


# name -> (builder taking (seqlen, block_size, **kw), positional spec parameters)
_REGISTRY: dict[str, tuple[Callable[..., BlockSparseLayout], tuple[str, ...]]] = {
    "dense": (dense, ()),
    "causal": (lambda seqlen, block_size, *, causal=True: _causal_spec(seqlen, block_size, causal), ()),
    "sliding_window": (sliding_window, ("window",)),
    "strided": (strided, ("stride",)),
    "fixed": (fixed, ("stride", "summary")),
    "longformer": (longformer, ("window", "global_tokens")),
    "bigbird": (bigbird, ("window", "num_global", "num_random")),
    "random": (random, ("density",)),
    "document": (_document_spec, ("num_docs",)),
}
_NAME_ALIASES = {"block_diagonal": "document", "local": "sliding_window", "window": "sliding_window"}
#: positional parameters of each pattern in a spec, in order
SPEC_PARAMS = {name: params for name, (_, params) in _REGISTRY.items()}
#: short keys accepted in specs (pattern-specific ones first)
ALIASES = {"w": "window", "g": "num_global", "global": "num_global", "r": "num_random",
           "random": "num_random", "d": "density", "c": "summary", "heads": "num_heads",
           "n": "num_docs", "docs": "num_docs"}
_FLAGS = ("causal",)
_PER_PATTERN_ALIASES = {"longformer": {"g": "global_tokens", "global": "global_tokens"}}


def available() -> list[str]:
    """Pattern names accepted by :func:`get` and :func:`from_spec`."""
    return sorted(_REGISTRY) + sorted(_NAME_ALIASES)


def _builder(name: str):
    key = _NAME_ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown pattern {name!r}; known patterns: {', '.join(available())}")
    return key, _REGISTRY[key]


def _accepted(fn) -> set[str]:
    import inspect

    return {p for p in inspect.signature(fn).parameters if p not in ("seqlen", "block_size")}


def get(name: str, seqlen, block_size, **kwargs) -> BlockSparseLayout:
    """Build pattern ``name`` (see :func:`available`) for ``seqlen`` and ``block_size``.

    ``num_heads`` and ``seed`` are passed to the patterns that use them (``bigbird``, ``random``)
    and ignored by deterministic ones, whose single shared mask already broadcasts over heads.
    """
    key, (fn, _) = _builder(name)
    accepted = _accepted(fn)
    for ignorable in ("num_heads", "seed"):
        if ignorable in kwargs and ignorable not in accepted:
            kwargs.pop(ignorable)
    unknown = set(kwargs) - accepted
    if unknown:
        raise ValueError(f"pattern {key!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
                         f"{sorted(accepted) or 'none'}")
    return fn(seqlen, block_size, **kwargs)


def _parse_value(text: str, what: str):
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if "/" in t:
        return [_parse_value(x, what) for x in t.split("/")]
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"cannot read value {t!r} of {what}: expected an int, a float, true/false "
                         f"or ints separated by '/'") from None


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"bigbird:window=256,global=1"`` -> ``("bigbird", {"window": 256, "num_global": 1})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a pattern spec is a non-empty string like 'sliding_window:512', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    key, (fn, positional) = _builder(name)
    aliases = {**ALIASES, **_PER_PATTERN_ALIASES.get(key, {})}
    accepted = _accepted(fn) | {"num_heads", "seed"}
    kwargs: dict = {}
    n_pos = 0
    for raw in (a for a in rest.split(",") if a.strip()) if rest else ():
        if "=" in raw:
            k, _, v = raw.partition("=")
            k = aliases.get(k.strip(), k.strip())
            if k not in accepted:
                raise ValueError(f"pattern {key!r} has no parameter {k!r} (spec {spec!r}); it accepts "
                                 f"{sorted(accepted)}")
            kwargs[k] = _parse_value(v, f"{k} in {spec!r}")
        elif raw.strip() in _FLAGS and raw.strip() in accepted:
            kwargs[raw.strip()] = True  # a bare flag such as "causal"
        else:
            if n_pos >= len(positional):
                raise ValueError(f"pattern {key!r} takes {len(positional)} positional value(s) "
                                 f"{list(positional)}, got more in {spec!r}; use KEY=VALUE")
            kwargs[positional[n_pos]] = _parse_value(raw, f"{positional[n_pos]} in {spec!r}")
            n_pos += 1
    return key, kwargs


def from_spec(spec: str, seqlen, block_size, **kwargs) -> BlockSparseLayout:
    """Build a layout from a spec string (grammar in the module docstring), e.g.
    ``from_spec("bigbird", seqlen=4096, block_size=64)`` or ``from_spec("sliding_window:512", 4096,
    64)``. ``kwargs`` (such as ``num_heads``, ``seed``, ``causal``) are defaults the spec overrides."""
    key, spec_kwargs = parse_spec(spec)
    return get(key, seqlen, block_size, **{**kwargs, **spec_kwargs})
