"""Selectors: callables ``(q, k) -> BlockSparseLayout`` that choose a layout from the activations at
every forward (:class:`~sparse_io_attn.nn.SparseSelfAttention`'s ``selector=``, the Hugging Face
integration's ``"moba:..."`` specs).

A selector runs on the activations' device with tensor operations only (block pooling, a small
matmul, :func:`~sparse_io_attn.layout.patterns.topk`), so it adds no host synchronisation and
traces under ``torch.compile(fullgraph=True)``; a new selection with the same shapes does not
recompile. The selection itself is not differentiable (as in MoBA, the gate is a hard top-k).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns.selection import topk


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [B, H, N, D]`` -> the mean of each block of ``block`` positions, ``[B, H, ceil(N / block), D]``
    (the last, ragged block averages the positions it has), in float32.

    One average pool over the positions (``ceil_mode``: the ragged window divides by what it has),
    which on CPU runs about twice as fast as a mean over a block axis of the same tensor."""
    B, H, N, D = x.shape
    if N == 0:
        return x.new_zeros(B, H, 0, D, dtype=torch.float32)
    means = F.avg_pool1d(x.float().reshape(B * H, N, D).transpose(1, 2), block, ceil_mode=True)
    return means.transpose(1, 2).unflatten(0, (B, H))


class MoBASelector:
    """MoBA-style block selection (Mixture of Block Attention, Lu et al. 2025): each query block reads
    its own key block and the ``top_k - 1`` other key blocks whose mean-pooled keys score highest
    against its mean-pooled queries, never a block wholly in the causal future.

    Scores are per KV head (the query heads of a GQA group pool their queries together, as Native
    Sparse Attention shares one selection per group), so the layout holds ``Hkv`` head masks and
    every backend applies each to its group. Use it with ``causal=True`` on the attention (the
    diagonal block is then masked element-wise); ``causal=False`` selects over every key block.
    """

    def __init__(self, block_size: int, top_k: int, *, causal: bool = True):
        self.block_size, self.top_k = positive_int(block_size, "block_size"), positive_int(top_k, "top_k")
        causal_offset(causal, 1, 1)   # ValueError naming the accepted modes
        self.causal = causal

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Block scores ``[B, Hkv, Mq, Mk]``: pooled queries (averaged over each GQA group) times
        pooled keys."""
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        qb = block_means(q.detach(), self.block_size)
        qb = qb.view(B, Hkv, Hq // Hkv, qb.shape[2], D).mean(2)
        return qb @ block_means(k.detach(), self.block_size).transpose(-1, -2)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> BlockSparseLayout:
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
                or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"the selector takes q [B, Hq, Nq, D] and k [B, Hkv, Nk, D] with Hq a multiple "
                             f"of Hkv, got {tuple(q.shape)} and {tuple(k.shape)}")
        if 0 in (q.shape[0], q.shape[2], k.shape[2]):
            raise ValueError(f"the selector chooses a layout of at least one query and key position and batch "
                             f"element, got q {tuple(q.shape)} and k {tuple(k.shape)}; an empty batch or "
                             f"sequence has nothing to select (SparseSelfAttention returns its empty output)")
        with torch.no_grad():
            return topk(self.scores(q, k), self.top_k, self.block_size, (q.shape[2], k.shape[2]),
                        causal=self.causal, include_diagonal=True)

    def __repr__(self) -> str:
        return f"moba(block_size={self.block_size}, top_k={self.top_k}, causal={self.causal!r})"


def moba(block_size: int, top_k: int, *, causal: bool = True) -> MoBASelector:
    """The MoBA-style selector: key blocks of ``block_size`` tokens, ``top_k`` kept per query block
    (the own block included). See :class:`MoBASelector`."""
    return MoBASelector(block_size, top_k, causal=causal)


#: selector spec names -> (factory, parameter names in positional order, aliases)
SPECS = {"moba": (moba, ("block_size", "top_k"), {"block": "block_size", "b": "block_size", "k": "top_k",
                                                     "topk": "top_k"})}


def is_spec(spec) -> bool:
    """Whether ``spec`` is a selector spec string (``"moba:..."``) rather than a static pattern's."""
    return isinstance(spec, str) and spec.strip().split(":", 1)[0].strip() in SPECS


def from_spec(spec: str, *, causal=True) -> MoBASelector:
    """A selector from a spec string: ``"moba:block=64,top_k=8"`` (or positionally ``"moba:64,8"``;
    keys ``block``/``block_size``, ``top_k``/``k``). ``ValueError`` naming the accepted form otherwise."""
    name, _, args = spec.strip().partition(":")
    if name.strip() not in SPECS:
        raise ValueError(f"unknown selector {name!r} in {spec!r}; available: {sorted(SPECS)}")
    factory, params, aliases = SPECS[name.strip()]
    form = f"{name}:" + ",".join(f"{p}=<int>" for p in params)
    values: dict = {}
    for i, arg in enumerate(a.strip() for a in args.split(",") if a.strip()):
        key, eq, value = arg.partition("=")
        key = aliases.get(key.strip(), key.strip()) if eq else (params[i] if i < len(params) else None)
        value = value if eq else arg
        if key not in params or key in values:
            raise ValueError(f"selector spec {spec!r}: unexpected argument {arg!r}; expected {form}")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"selector spec {spec!r}: {key} must be an int, got {value!r}") from None
    missing = [p for p in params if p not in values]
    if missing:
        raise ValueError(f"selector spec {spec!r} misses {missing}; expected {form}")
    return factory(**values, causal=causal)


__all__ = ["MoBASelector", "block_means", "from_spec", "is_spec", "moba"]
