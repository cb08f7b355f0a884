"""Symbolic (structure-only) plans, computed once on the host and cached.

* :func:`product_plan`: for ``C = A B`` on an output block pattern, per output row block ``i`` the
  ``k`` whose A tile ``(i, k)`` is stored and whose B row ``k`` meets C's stored tiles of row ``i``.
  This is the symbolic phase of a sparse product; the numeric phase (the kernel) walks the list.
* :func:`attention_plan`: the score blocks of ``(A1 X) A2^T`` that are structurally nonzero and in
  the QK pattern ("kept", CSR + CSC), and the QK blocks whose scores are structurally zero ("zero":
  their scores are exactly 0, which still enters the softmax as ``exp(0 - m)``).

Plans depend only on block maps, so they are cached by the maps' content (patterns that stay fixed
during training are planned once).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sparse_io_attn.layout._csr import INDEX_DTYPE, csr_transpose, mask_to_csr

class PlanCache:
    """A bounded LRU map ``(kind, content hash, device) -> plan`` that counts hits and misses."""

    def __init__(self, size: int = 256):
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, build):
        if key in self.entries:
            self.entries.move_to_end(key)
            self.hits += 1
            return self.entries[key]
        self.misses += 1
        val = self.entries[key] = build()
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return val

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


#: the process-wide plan cache (tests swap in a fresh one to inspect it)
CACHE = PlanCache()


def _key(*tensors) -> tuple:
    h = hashlib.sha1()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        c = t.detach().cpu().contiguous()
        h.update(str((tuple(c.shape), c.dtype)).encode())
        h.update(c.numpy().tobytes())
    return h.hexdigest()


def _cached(kind: str, key: tuple, build):
    return CACHE.get((kind,) + key, build)


@dataclass(frozen=True)
class ProductPlan:
    """Row-panel plan of ``C = A B``: output row block ``i`` owns pairs ``pair_ptr[i]:pair_ptr[i+1]``
    of ``pair_a`` (A's tile id at ``(i, k)``) and ``pair_k`` (int32): the ``k`` whose A tile is stored
    and whose B row ``k`` shares a stored column tile with C's row ``i``."""
    pair_ptr: torch.Tensor
    pair_a: torch.Tensor
    pair_k: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.pair_ptr.numel()) - 1

    @property
    def num_pairs(self) -> int:
        return int(self.pair_a.numel())

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(i, k)`` of every pair (int64 on the CPU, in list order): output row block and A column
        block / B row block."""
        ptr = self.pair_ptr.cpu().long()
        rows = torch.repeat_interleave(torch.arange(self.num_rows), ptr[1:] - ptr[:-1])
        return rows, self.pair_k.cpu().long()

    def to(self, device) -> "ProductPlan":
        return ProductPlan(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def product_plan(a_map: torch.Tensor, b_map: torch.Tensor, out_map: torch.Tensor) -> ProductPlan:
    """Plan ``C = A B``: ``a_map [I, K]``, ``b_map [K, J]``, ``out_map [I, J]`` (tile ids, -1 absent).
    Every row block of C gets a program (rows with stored tiles but no pair are written as zeros)."""
    if a_map.shape[1] != b_map.shape[0] or out_map.shape != (a_map.shape[0], b_map.shape[1]):
        raise ValueError(f"product_plan: block maps do not chain: {tuple(a_map.shape)} x "
                         f"{tuple(b_map.shape)} -> {tuple(out_map.shape)}")

    def build():
        a, b, o = a_map.cpu().to(torch.int64), b_map.cpu().to(torch.int64), out_map.cpu().to(torch.int64)
        reach = ((o >= 0).to(torch.float32) @ (b >= 0).t().to(torch.float32)) > 0  # [I, K]: some shared j
        pairs = (a >= 0) & reach
        ii, kk = pairs.nonzero(as_tuple=True)  # row-major: grouped by output row block
        ptr = torch.zeros(a.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(pairs.sum(dim=1), 0, out=ptr[1:])
        return ProductPlan(ptr.to(INDEX_DTYPE), a[ii, kk].to(INDEX_DTYPE), kk.to(INDEX_DTYPE))

    dev = a_map.device
    return _cached("product", (_key(a_map, b_map, out_map), str(dev)), lambda: build().to(dev))


def structural_product(a_pattern: torch.Tensor, b_pattern: torch.Tensor) -> torch.Tensor:
    """Block pattern of ``A B`` (bool): block ``(i, j)`` is structurally nonzero iff some ``k`` has
    both ``A[i, k]`` and ``B[k, j]`` stored; leading axes broadcast as in ``torch.matmul``."""
    return (a_pattern.to(torch.float32) @ b_pattern.to(torch.float32)) > 0


@dataclass(frozen=True)
class AttentionPlan:
    """Score-block lists (int32, absolute-offset CSR as in :mod:`sparse_io_attn.layout._csr`, ``L = 1``):
    ``kept_*``: computed blocks; ``zero_*``: QK blocks whose scores are structurally 0.
    ``*_crow [nqb+1]``/``*_col``: by query block; ``*_ccol [nkb+1]``/``*_row``: by key block."""
    kept_mask: torch.Tensor
    zero_mask: torch.Tensor
    kept_crow: torch.Tensor
    kept_col: torch.Tensor
    kept_ccol: torch.Tensor
    kept_row: torch.Tensor
    zero_crow: torch.Tensor
    zero_col: torch.Tensor
    zero_ccol: torch.Tensor
    zero_row: torch.Tensor

    @property
    def has_zero(self) -> bool:
        return bool(self.zero_col.numel())

    def to(self, device) -> "AttentionPlan":
        return AttentionPlan(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def attention_plan(q_pattern: torch.Tensor, a2_pattern: torch.Tensor, qk_mask: torch.Tensor | None) -> AttentionPlan:
    """``q_pattern [nqb, nd]`` (blocks of A1 X), ``a2_pattern [nkb, nd]``, ``qk_mask [nqb, nkb]`` or
    None (all keys)."""

    def build():
        struct = structural_product(q_pattern.cpu(), a2_pattern.cpu().t())
        qk = torch.ones_like(struct) if qk_mask is None else qk_mask.cpu()
        kept, zero = struct & qk, qk & ~struct
        nkb = kept.shape[1]
        lists = []
        for m in (kept, zero):
            crow, col = mask_to_csr(m[None])
            ccol, row, _ = csr_transpose(crow, col, nkb)
            lists.append((crow[0], col, ccol[0], row))
        (kc, kcol, kcc, krow), (zc, zcol, zcc, zrow) = lists
        return AttentionPlan(kept, zero, kc, kcol, kcc, krow, zc, zcol, zcc, zrow)

    dev = q_pattern.device
    key = (_key(q_pattern, a2_pattern, qk_mask), str(dev))
    return _cached("attention", key, lambda: build().to(dev))


@dataclass(frozen=True)
class GroupPlans:
    """The plans of a batched call: ``parts`` the distinct plans (built once each, in first-use
    order), ``counts`` how many ``(b, h)`` groups use each, ``ids [B * H]`` (int32, on the plans'
    device) the part of every group, and ``plan`` the parts concatenated into one plan the kernels
    index with ``ids`` (row pointers shifted to absolute offsets into the concatenated lists; part
    ``p``'s row pointers start at ``p * (rows + 1)``); ``keys`` what each part was built from."""
    parts: tuple
    counts: tuple
    ids: torch.Tensor
    plan: object
    keys: tuple = ()


def _shifted(ptrs: list, lists: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate CSR row pointers (shifted by the entries before each part) and their lists."""
    out, start = [], 0
    for ptr, lst in zip(ptrs, lists):
        out.append(ptr.to(torch.int64) + start)
        start += int(lst.numel())
    return torch.cat(out).to(INDEX_DTYPE), torch.cat(lists)


def stack_product_plans(parts: list) -> ProductPlan:
    ptr, pair_a = _shifted([p.pair_ptr for p in parts], [p.pair_a for p in parts])
    return ProductPlan(ptr, pair_a, torch.cat([p.pair_k for p in parts]))


def stack_attention_plans(parts: list) -> AttentionPlan:
    kc, kcol = _shifted([p.kept_crow for p in parts], [p.kept_col for p in parts])
    kcc, krow = _shifted([p.kept_ccol for p in parts], [p.kept_row for p in parts])
    zc, zcol = _shifted([p.zero_crow for p in parts], [p.zero_col for p in parts])
    zcc, zrow = _shifted([p.zero_ccol for p in parts], [p.zero_row for p in parts])
    return AttentionPlan(torch.stack([p.kept_mask for p in parts]), torch.stack([p.zero_mask for p in parts]),
                         kc, kcol, kcc, krow, zc, zcol, zcc, zrow)


def first_equal(t: torch.Tensor) -> dict:
    """``{(i, j): (i0, j0)}`` over the two leading axes of ``t`` (block maps or patterns ``[L0, L1,
    R, C]``): the first index, in row-major order, whose slice equals ``t[i, j]``, so groups on equal
    patterns name one plan."""
    L0, L1 = t.shape[:2]
    flat = t.detach().reshape(L0 * L1, -1).cpu().to(torch.int64)
    if flat.shape[1] == 0:
        inverse = [0] * (L0 * L1)
    else:
        inverse = torch.unique(flat, dim=0, return_inverse=True)[1].tolist()
    first: dict = {}
    return {divmod(g, L1): divmod(first.setdefault(c, g), L1) for g, c in enumerate(inverse)}


def group_plans(keys: list, build, stack, device) -> GroupPlans:
    """``keys[g]``: a hashable naming group ``g``'s plan; ``build(key)`` builds (or fetches from
    :data:`CACHE`) a plan; ``stack`` concatenates the distinct ones."""
    order: dict = {}
    ids = [order.setdefault(k, len(order)) for k in keys]
    parts = [build(k) for k in order]
    counts = [ids.count(i) for i in range(len(parts))]
    return GroupPlans(tuple(parts), tuple(counts), torch.tensor(ids, dtype=INDEX_DTYPE, device=device),
                      parts[0] if len(parts) == 1 else stack(parts), tuple(order))
