"""The plan split by lifetime, without processes: `ContextParallelPlan.for_sequence` (ownership) and
`plan.step(layout_or_selection)` (`ContextParallelStep`) against brute force over dense element
masks (the units each rank asks for = the selected blocks it reads and does not own; the local and
received parts, mapped back to global keys, = the rank's rows), the step's one host read, the
traffic model of steps, the errors, and a one-rank step through `context_parallel_attention`."""
import math

import pytest
import torch
from helpers import FP32_TOL

from sparse_io_attn import BlockSparseLayout, block_sparse_attention, patterns, selection_attention
from sparse_io_attn.accounting.traffic import context_parallel_steps
from sparse_io_attn.block_sparse.reference import rel_err
from sparse_io_attn.distributed import (ContextParallelPlan, ContextParallelStep, causal_layout,
                                        context_parallel_attention)
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.reference import selection_mask


def _selection_case(n, bs, L_batch, G, K, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (L_batch, G, n, K) if L_batch else (G, n, K)
    idx = torch.randint(-2, math.ceil(n / bs) + 1, shape, generator=g)          # empty and out-of-range slots
    idx[..., -1, -1] = 2 ** 32 + 1                                              # past int32: not block 1
    counts = torch.randint(0, K + 1, shape[:-1], generator=g) if seed % 2 else None
    return Selection(idx, bs, counts)


def _cases():
    """``(id, plan args, source, num_heads_kv)``: layouts and selections, ragged lengths."""
    n, b = 117, 8
    R = math.ceil(n / b)
    g = torch.Generator().manual_seed(0)
    topk_kv = patterns.topk(torch.randn(2, R, R, generator=g), 3, b, n, causal=True)      # per KV head
    topk_batch = patterns.topk(torch.randn(2, 1, R, R, generator=g), 4, b, n)             # per batch element
    return [
        ("topk-kv-causal", dict(causal=True), topk_kv, 2),
        ("topk-batch", dict(causal=False, balance="contiguous"), topk_batch, None),
        ("window-partial", dict(causal=False, balance="balanced"), patterns.sliding_window(n, b, 13), None),
        ("sel-gqa-causal", dict(causal=True), _selection_case(n, b, 0, 2, 3, 1), 4),
        ("sel-per-query-head", dict(causal="bottom_right"), _selection_case(n, b // 2, 2, 4, 5, 2), 2),
        ("sel-shared-token-rows", dict(causal=True), _selection_case(n, b, 0, 1, 4, 3), None),
    ]


def _dense(source, n, causal: bool) -> torch.Tensor:
    """The element mask ``[L, n, n]`` of a layout or selection (``L = Lb * G``)."""
    if isinstance(source, BlockSparseLayout):
        m = source.to_dense_mask().flatten(0, 1)
    else:
        m = selection_mask(source, source.batch or 1, source.num_selections, n).flatten(0, 1)
    return m & torch.ones(n, n, dtype=torch.bool).tril() if causal else m


def _unit_of(step: ContextParallelStep) -> torch.Tensor:
    l = torch.arange(step.batch_groups * step.groups)
    return (l // step.groups) * step.kv_groups + (l % step.groups) // (step.groups // step.kv_groups)


def _part_dense(step: ContextParallelStep, part, n_keys: int, causal: bool) -> torch.Tensor:
    """A step's part as an element mask ``[L, n_local, n_keys]``."""
    if step.kind == "layout":
        m = part.to_dense_mask().flatten(0, 1)
        return m & torch.ones(m.shape[1], n_keys, dtype=torch.bool).tril() if causal else m
    L = step.batch_groups * step.groups
    sel = Selection(part.rows.view(L, part.rows.shape[1], -1), step.block_size, part.row_counts.view(L, -1))
    return selection_mask(sel, 1, L, n_keys, causal=causal)[0]


def _received_keys(step: ContextParallelStep) -> torch.Tensor:
    """``[U, received_seqlen]``: the global token at each position of each unit group's received key
    space (``-1``: unused), from the requests and where they land."""
    C, bs, full = step.num_key_blocks, step.block_size, step.full_slots
    ids = step.requests
    ragged = (ids % C == C - 1) & (step.last_tokens < bs)
    order = torch.sort(ragged.to(torch.int8), stable=True).indices
    ids = ids[order]
    keys = torch.full((step.num_unit_groups, step.received_seqlen), -1, dtype=torch.int64)
    n_full = step.recv_regular.numel()
    for i, unit in enumerate(ids.tolist()):
        u, c = divmod(unit, C)
        slot = int(step.recv_regular[i]) % max(full, 1) if i < n_full else full
        assert (int(step.recv_regular[i]) // max(full, 1) if i < n_full else int(step.recv_ragged[i - n_full])) == u
        tokens = torch.arange(c * bs, min(c * bs + bs, step.plan.seqlen))
        keys[u, slot * bs:slot * bs + tokens.numel()] = tokens
    return keys


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_steps_match_brute_force(world):
    for name, kwargs, source, hkv in _cases():
        n = source.seqlen_q if isinstance(source, BlockSparseLayout) else source.seqlen_q
        block = source.block_size[0] if isinstance(source, BlockSparseLayout) else 8
        plan = ContextParallelPlan.for_sequence(n, block, world, **kwargs)
        dense = _dense(source, n, plan.causal)
        steps = [plan.step(source, rank=r, num_heads_kv=hkv) for r in range(world)]
        for r, step in enumerate(steps):
            bs, C = step.block_size, step.num_key_blocks
            owner = plan.owner[torch.arange(C) * bs // plan.block_size]
            rows = dense[:, plan.token_index(r)]                                         # [L, n_local, n]
            read = rows.any(1)                                                           # [L, n]: keys read
            blocks = torch.zeros(read.shape[0], C, dtype=torch.bool)
            blocks.index_put_((torch.arange(read.shape[0])[:, None].expand_as(read)[read],
                               torch.arange(n).expand_as(read)[read] // bs), torch.tensor(True))
            units = torch.unique((_unit_of(step)[:, None] * C + torch.arange(C))[blocks & (owner != r)])
            assert torch.equal(torch.sort(step.requests).values, units), (name, world, r)
            assert torch.equal(step.floor_units(), units), (name, world, r)
            src = owner[step.requests % C]
            assert torch.equal(src, torch.sort(src).values), (name, r)                  # grouped by source
            tok = (n - torch.arange(C) * bs).clamp(max=bs)
            for s in range(world):
                mine = step.requests[src == s]
                assert step.recv_units[s] == mine.numel() and step.recv_tokens[s] == int(tok[mine % C].sum())
            # the parts, mapped back to global keys, are the rank's rows
            got = torch.zeros_like(rows)
            local = _part_dense(step, step.local, plan.num_tokens(r), plan.causal)
            got[:, :, plan.token_index(r)] |= local
            if step.received is not None:
                keys = _received_keys(step)
                part = _part_dense(step, step.received, step.received_seqlen, False)
                for lid, u in enumerate(_unit_of(step).tolist()):
                    used = keys[u] >= 0
                    got[lid][:, keys[u][used]] |= part[lid][:, used]
                    assert not part[lid][:, ~used].any(), (name, r)
            else:
                assert sum(step.recv_units) == 0
            assert torch.equal(got, rows), (name, world, r)
        model = context_parallel_steps(steps, batch=2, num_heads_kv=4, head_dim=8, dtype=torch.float32)
        assert model.recv == model.floor and sum(model.send) == sum(model.recv), name
        assert sum(model.req_send) == sum(model.req_recv), name


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the operations that read tensor data back to the host."""
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["topk-kv-causal", "sel-gqa-causal", "sel-per-query-head"])
def test_a_step_reads_the_host_once(name):
    """Built on the device with tensor operations: one read of the counts (fixed-capacity layouts
    and selections; the plan's per-rank tables are kept from the first step)."""
    _, kwargs, source, hkv = next(c for c in _cases() if c[0] == name)
    n = source.seqlen_q
    plan = ContextParallelPlan.for_sequence(n, 8, 3, **kwargs)
    plan.step(source, rank=1, num_heads_kv=hkv)
    with _HostReads() as mode:
        plan.step(source, rank=1, num_heads_kv=hkv)
    assert mode.reads == ["tolist"], mode.reads


def test_for_sequence_ownerships():
    n, b, W = 1000, 16, 4
    R = math.ceil(n / b)
    for balance in ("contiguous", "zigzag", "balanced"):
        plan = ContextParallelPlan.for_sequence(n, b, W, causal=True, balance=balance)
        assert plan.layout is None and not plan.is_static and plan.layout_digest == 0
        assert torch.equal(torch.sort(torch.cat([plan.token_index(r) for r in range(W)])).values, torch.arange(n))
        x = torch.randn(2, n)
        assert torch.equal(plan.unshard([plan.shard(x, r, 1) for r in range(W)], 1), x)
        assert plan.imbalance < 1.1 if balance != "contiguous" else plan.imbalance > 1.5, (balance, plan)
    zig = ContextParallelPlan.for_sequence(n, b, W, causal=True)
    assert zig.strategy == "zigzag" and torch.equal(zig.rows(0), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 56, 57, 58,
                                                                                59, 60, 61, 62]))
    weighted = ContextParallelPlan.for_sequence(n, b, W, causal=False, balance="balanced",
                                                row_work=torch.arange(R) % 3)
    assert weighted.digest != ContextParallelPlan.for_sequence(n, b, W, causal=False, balance="contiguous").digest
    with pytest.raises(ValueError, match="2 \\* world_size = 8 blocks"):
        ContextParallelPlan.for_sequence(100, 16, 4, causal=True)
    with pytest.raises(ValueError, match="balance must be one of"):
        ContextParallelPlan.for_sequence(n, b, W, causal=True, balance="lpt")
    with pytest.raises(ValueError, match="row_work must be"):
        ContextParallelPlan.for_sequence(n, b, W, causal=True, balance="balanced", row_work=torch.ones(3))
    with pytest.raises(ValueError, match="use plan.step"):
        zig.send_blocks(0, 1)
    with pytest.raises(ValueError, match="plan.step"):
        context_parallel_attention(*(torch.randn(1, 1, zig.num_tokens(0), 8) for _ in range(3)),
                                   ContextParallelPlan.for_sequence(n, b, 1, causal=True), causal=True)


def test_step_errors():
    n, b = 96, 16
    plan = ContextParallelPlan.for_sequence(n, b, 2, causal=True)
    with pytest.raises(ValueError, match="block_size=16 over the whole sequence"):
        plan.step(patterns.causal(n, 8), rank=0)
    with pytest.raises(ValueError, match="do not divide the plan's blocks of 16"):
        plan.step(Selection(torch.zeros(1, n, 2, dtype=torch.long), 12), rank=0)
    with pytest.raises(ValueError, match="query rows"):
        plan.step(Selection(torch.zeros(1, 40, 2, dtype=torch.long), 8), rank=0)
    with pytest.raises(TypeError, match="BlockSparseLayout or a Selection"):
        plan.step(torch.zeros(3), rank=0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        plan.step(patterns.causal(n, b), rank=2)
    with pytest.raises(ValueError, match="one must divide the other"):
        plan.step(Selection(torch.zeros(3, n, 2, dtype=torch.long), 8), rank=0, num_heads_kv=2)
    step = plan.step(Selection(torch.zeros(4, n, 2, dtype=torch.long), 8), rank=0)
    with pytest.raises(ValueError, match="num_heads_kv=2"):
        step.check_heads(1, 4, 2)                                          # 4 groups, 2 K/V heads
    with pytest.raises(ValueError, match="batch"):
        plan.step(Selection(torch.zeros(3, 1, n, 2, dtype=torch.long), 8), rank=0).check_heads(2, 2, 2)
    fixed = BlockSparseLayout.from_kv_indices(torch.zeros(6, 1, dtype=torch.long), b, n)
    fixed.crow_indices.copy_(torch.tensor([[0, 6, 6, 6, 6, 6, 6]]))     # a row past its capacity
    fixed.col_slots.copy_(torch.arange(6))
    with pytest.raises(ValueError, match="keeps more than 1 blocks"):
        plan.step(fixed, rank=0)


@pytest.mark.parametrize("name", ["topk-kv-causal", "sel-per-query-head"])
def test_one_rank_step_is_the_op(name):
    """Without processes, a one-rank step runs the local part only: the op itself."""
    _, kwargs, source, hkv = next(c for c in _cases() if c[0] == name)
    n = source.seqlen_q
    plan = ContextParallelPlan.for_sequence(n, 8, 1, **kwargs)
    B, Hq, Hkv = 2, 4, hkv or 2
    q, k, v, do = (torch.randn(B, h, n, 8) for h in (Hq, Hkv, Hkv, Hq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*leaves, plan.step(source, num_heads_kv=Hkv), causal=kwargs["causal"],
                                     backend="torch")
    out.backward(do)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if isinstance(source, BlockSparseLayout):
        want = block_sparse_attention(*ref, source, causal=kwargs["causal"], backend="torch")
    else:                                  # out-of-range entries are empty slots, as the step reads them
        want = selection_attention(*ref, source, causal=kwargs["causal"], backend="torch", check=False)
    want.backward(do)
    for a, b in zip([out] + [t.grad for t in leaves], [want] + [t.grad for t in ref]):
        assert rel_err(a, b) <= FP32_TOL


def test_causal_layout_keeps_a_causal_layout_and_cuts_the_rest():
    """Already causal (O(rows) to decide): an equal copy; otherwise blocks above the diagonal dropped
    and diagonal masks cut, without a sort; both against the dense mask."""
    n, b = 100, 8
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(0)
    R = math.ceil(n / b)
    for layout in (patterns.causal(n, b), patterns.topk(torch.randn(R, R, generator=g), 3, b, n, causal=True),
                   patterns.sliding_window(n, b, 20), patterns.bigbird(n, b, seed=1), patterns.dense(n, b)):
        got = causal_layout(layout)
        want = BlockSparseLayout.from_dense_mask(layout.to_dense_mask() & tril, b)
        assert got.equal(want), layout.name
        assert got.crow_indices.data_ptr() != layout.crow_indices.data_ptr()          # the plan's own copy
