"""Pattern specs, the CLI's ``--pattern`` strings: ``NAME[:arg,...]`` -> a layout (grammar in
:mod:`sparse_io_attn.layout.patterns`)."""
from __future__ import annotations

import inspect
from typing import Callable

from sparse_io_attn.layout._args import as_pair
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns._grid import _int
from sparse_io_attn.layout.patterns.builders import (bigbird, causal, dense, document, fixed, longformer, prefix_lm,
                                                     random, sliding_window, strided)


def _document_spec(seqlen, block_size, num_docs: int = 4, lengths=None, cu_seqlens=None, *,
                   causal: bool = False, rows=None) -> BlockSparseLayout:
    """``document`` for specs: ``cu_seqlens``, document ``lengths`` or ``num_docs`` equal parts of
    ``seqlen`` (the last one takes the remainder)."""
    total = as_pair(seqlen, "seqlen")
    if total[0] != total[1]:
        raise ValueError(f"document needs seqlen_q == seqlen_k, got {total}")
    total = total[0]
    if cu_seqlens is None:
        if lengths is None:
            num_docs = _int(num_docs, "num_docs", 1, total)  # each document holds a position
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
    return document(list(cu_seqlens), block_size, causal=causal, rows=rows)


def _causal_spec(seqlen, block_size, flag, rows) -> BlockSparseLayout:
    if flag is not True:
        raise ValueError(f"pattern 'causal' cannot be built with causal={flag!r}; use 'dense'")
    return causal(seqlen, block_size, rows=rows)


# name -> (builder taking (seqlen, block_size, **kw), positional spec parameters)
_REGISTRY: dict[str, tuple[Callable[..., BlockSparseLayout], tuple[str, ...]]] = {
    "dense": (dense, ()),
    "causal": (lambda seqlen, block_size, *, causal=True, rows=None: _causal_spec(seqlen, block_size, causal, rows),
               ()),
    "sliding_window": (sliding_window, ("window",)),
    "strided": (strided, ("stride",)),
    "fixed": (fixed, ("stride", "summary")),
    "longformer": (longformer, ("window", "global_tokens")),
    "bigbird": (bigbird, ("window", "num_global", "num_random")),
    "random": (random, ("density",)),
    "document": (_document_spec, ("num_docs",)),
    "prefix_lm": (lambda seqlen, block_size, prefix=None, *, rows=None: prefix_lm(
        seqlen, block_size, as_pair(seqlen, "seqlen")[1] // 4 if prefix is None else prefix, rows=rows), ("prefix",)),
}
_NAME_ALIASES = {"block_diagonal": "document", "documents": "document", "local": "sliding_window",
                 "window": "sliding_window"}
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
    """The pattern parameters of a builder (``rows``, which selects what to build, is not one)."""
    return {p for p in inspect.signature(fn).parameters if p not in ("seqlen", "block_size", "rows")}


def get(name: str, seqlen, block_size, *, rows=None, **kwargs) -> BlockSparseLayout:
    """Build pattern ``name`` (see :func:`available`) for ``seqlen`` and ``block_size``.

    ``num_heads`` and ``seed`` are passed to the patterns that use them (``bigbird``, ``random``)
    and ignored by deterministic ones, whose single shared mask already broadcasts over heads.
    ``rows=(start, stop)``: only query positions ``[start, stop)``, equal to ``.rows(start, stop)``
    of the whole layout and built from those rows alone (every builder takes it).
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
    return fn(seqlen, block_size, **kwargs) if rows is None else fn(seqlen, block_size, rows=rows, **kwargs)


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


def from_spec(spec: str, seqlen, block_size, *, rows=None, **kwargs) -> BlockSparseLayout:
    """Build a layout from a spec string (grammar in the module docstring), e.g.
    ``from_spec("bigbird", seqlen=4096, block_size=64)`` or ``from_spec("sliding_window:512", 4096,
    64)``. ``kwargs`` (such as ``num_heads``, ``seed``, ``causal``) are defaults the spec overrides;
    ``rows=(start, stop)`` builds only those query positions (as :func:`get`)."""
    key, spec_kwargs = parse_spec(spec)
    return get(key, seqlen, block_size, rows=rows, **{**kwargs, **spec_kwargs})
