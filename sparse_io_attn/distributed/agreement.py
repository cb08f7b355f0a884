"""The agreement of :func:`~sparse_io_attn.distributed.context_parallel_attention`: before anything
moves, every rank describes its call in a fixed-size int64 descriptor (:data:`_FIELDS`, the error
text of a rank whose checks failed and, for a step, the units and tokens it receives from each rank)
and one ``all_gather`` compares them: a refusal or any difference raises the same ``ValueError`` on
every rank, naming the rank and the field, and no rank starts an exchange its peers do not.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from sparse_io_attn.distributed.plan import ContextParallelPlan
from sparse_io_attn.distributed.step import ContextParallelStep


def _group_rank(group) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group for ``None``; one process without
    ``torch.distributed`` initialised counts as a group of one)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


#: what every rank describes before any exchange (one int64 each), in the order ranks compare them
_FIELDS = ("error", "plan world size", "plan sequence length", "plan block size", "plan causality",
           "plan layout digest", "plan assignment digest", "step digest", "q dtype", "k dtype", "v dtype",
           "batch", "query heads", "KV heads", "head dim", "backward", "backend", "sm_scale")
_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64)
_BACKENDS = (None, "torch", "triton", "cpu")
_MESSAGE_BYTES = 512                       # the refused rank's error text travels with its descriptor
_UNKNOWN = -1


def agreement_bytes(world_size: int) -> int:
    """Bytes of one rank's agreement descriptor in a group of ``world_size`` ranks (each rank receives
    ``world_size`` of them): the fields, the refused rank's error text and, for a step, the units and
    tokens the rank receives from each rank (what tells every rank what it sends)."""
    return 8 * (len(_FIELDS) + 2 * world_size) + _MESSAGE_BYTES

_FIXES = {
    "plan": "every rank must build ContextParallelPlan(layout, world_size, causal=..., balance=..., "
            "tolerance=..., split_rows=...) from the same layout with the same arguments",
    "dtype": "every rank must pass q, k, v of the same dtypes",
    "shape": "every rank must pass shards of the same batch, heads and head dim (plan.shard of the same "
             "tensors)",
    "backward": "every rank must build the backward alike (backward exchanges dK/dV between all ranks): "
                "q/k/v requiring grad and torch.is_grad_enabled() the same on every rank",
    "step": "every rank must pass its step of the same plan, built alike (plan.step of a layout or of a "
            "Selection with the same key block, batch and head groups, and num_heads_kv)",
    "backend": "pass the same backend on every rank",
    "sm_scale": "pass the same sm_scale on every rank",
}


def _dtype_code(t) -> int:
    dtype = t.dtype if isinstance(t, torch.Tensor) else None
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _backward_bits(q, k, v) -> int:
    """``8 * grad mode + 4 * q + 2 * k + v`` (``requires_grad`` of each)."""
    bits = 8 * torch.is_grad_enabled()
    for shift, t in ((2, q), (1, k), (0, v)):
        bits |= (isinstance(t, torch.Tensor) and t.requires_grad) << shift
    return bits


def _runs_backward(bits: int) -> bool:
    return bool(bits & 8) and bool(bits & 7)


def _describe(q, k, v, plan, local, error: Exception | None, world: int) -> torch.Tensor:
    """This rank's descriptor: int64 ``[len(_FIELDS) + _MESSAGE_BYTES // 8 + 2 * world]`` (unknown
    fields -1; the counts 0 unless this rank's step is built and its checks passed). ``local``: the
    local part's prepared call (its ``backend`` and ``sm_scale``), ``None`` when its checks failed."""
    step = plan if isinstance(plan, ContextParallelStep) else None
    plan = step.plan if step is not None else plan
    is_plan = isinstance(plan, ContextParallelPlan)
    pick = (lambda f: f(plan)) if is_plan else (lambda f: _UNKNOWN)           # noqa: E731
    shape = lambda t, i: t.shape[i] if isinstance(t, torch.Tensor) and t.dim() == 4 else _UNKNOWN  # noqa: E731
    scale = _UNKNOWN if local is None else struct.unpack("<q", struct.pack("<d", local.sm_scale))[0]
    fields = [int(error is not None), pick(lambda p: p.world_size), pick(lambda p: p.seqlen),
              pick(lambda p: p.block_size), pick(lambda p: int(p.causal)), pick(lambda p: p.layout_digest),
              pick(lambda p: p.assignment_digest), step.digest if step is not None else 0,
              _dtype_code(q), _dtype_code(k), _dtype_code(v),
              shape(q, 0), shape(q, 1), shape(k, 1), shape(q, 3), _backward_bits(q, k, v),
              _UNKNOWN if local is None else _BACKENDS.index(local.backend), scale]
    text = b"" if error is None else str(error).encode("utf-8", "replace")
    if len(text) > _MESSAGE_BYTES:
        text = text[:_MESSAGE_BYTES - 3] + b"..."
    message = torch.frombuffer(bytearray(text.ljust(_MESSAGE_BYTES, b"\0")), dtype=torch.int64)
    counts = [0] * (2 * world)
    if step is not None and error is None and len(step.recv_units) == world:
        counts = step.recv_units + step.recv_tokens
    return torch.cat([torch.tensor(fields, dtype=torch.int64), message, torch.tensor(counts, dtype=torch.int64)])


def _show(field: str, value: int) -> str:
    if value == _UNKNOWN:                   # (digests are >= 0; -1 is no finite sm_scale's bits)
        return "none (its call failed before)"
    if field.endswith("dtype"):
        return str(_DTYPES[value]) if value < len(_DTYPES) else "an unsupported dtype"
    if field == "backend":
        return repr(_BACKENDS[value])
    if field == "plan causality":
        return str(bool(value))
    if field.endswith("digest"):
        return f"{value & (2 ** 64 - 1):#018x}"
    if field == "sm_scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "backward":
        grads = "/".join(str(bool(value >> s & 1)) for s in (2, 1, 0))
        return (f"{'a' if _runs_backward(value) else 'no'} backward to run (q/k/v requires_grad {grads}, "
                f"grad mode {'on' if value & 8 else 'off'})")
    return str(value)


def _fix(field: str) -> str:
    if field.startswith("plan"):
        return _FIXES["plan"]
    if field.startswith("step"):
        return _FIXES["step"]
    if field.endswith("dtype"):
        return _FIXES["dtype"]
    if field in ("batch", "query heads", "KV heads", "head dim"):
        return _FIXES["shape"]
    return _FIXES[field]


def _disagreement(table: torch.Tensor) -> str | None:
    """The error every rank raises for the gathered descriptors ``table [world, ...]`` (``None``: the
    ranks agree): the refused ranks' errors first, then the first field in which some rank differs
    from rank 0 (the backward as whether it runs)."""
    nf = len(_FIELDS)
    refused = [r for r in range(table.shape[0]) if table[r, 0]]
    if refused:
        r = refused[0]
        words = table[r, nf:nf + _MESSAGE_BYTES // 8].contiguous()
        text = words.view(torch.uint8).numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
        who = (f"rank {r} refused its inputs" if len(refused) == 1 else
               f"ranks {', '.join(map(str, refused))} refused their inputs; rank {r}")
        return f"context_parallel_attention: {who}: {text} (no rank started the exchange)"
    for i, field in enumerate(_FIELDS[1:], 1):
        values = table[:, i].tolist()
        if field == "backward":
            differs = [r for r, x in enumerate(values) if _runs_backward(x) != _runs_backward(values[0])]
        else:
            differs = [r for r, x in enumerate(values) if x != values[0]]
        if differs:
            r = differs[0]
            if field == "backward":
                return (f"context_parallel_attention: ranks disagree: rank {r} has {_show(field, values[r])}, "
                        f"rank 0 {_show(field, values[0])}; {_fix(field)} (no rank started the exchange)")
            return (f"context_parallel_attention: ranks disagree: rank {r} has {field} {_show(field, values[r])}, "
                    f"rank 0 {_show(field, values[0])}; {_fix(field)} (no rank started the exchange)")
    return None


def _agreement_device(group) -> torch.device:
    """Where the agreement's tensors live: the current CUDA device for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _agree(descriptor: torch.Tensor, error: Exception | None, group, world: int) -> torch.Tensor:
    """One ``all_gather`` of every rank's fixed-size descriptor; every rank compares all of them and
    raises the same ``ValueError`` if any rank refused its inputs or the ranks differ in what must
    match (so no rank starts an exchange its peers do not, and none waits alone). Returns the
    gathered descriptors ``[world, ...]`` on the CPU (one read: the agreement's and the counts')."""
    device = _agreement_device(group)
    gathered = [torch.empty_like(descriptor, device=device) for _ in range(world)]
    dist.all_gather(gathered, descriptor.to(device), group=group)
    table = torch.stack(gathered).cpu()
    message = _disagreement(table)
    if message is not None:
        raise ValueError(message) from error
    return table


__all__ = ["agreement_bytes"]
