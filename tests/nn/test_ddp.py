"""DistributedDataParallel and FSDP2 (``fully_shard``) with `SparseSelfAttention`, gloo, 2 CPU
processes: one step of data-parallel training gives the gradients (and, for DDP, the parameters
after an SGD step) of single-process training on the combined batch."""
import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from sparse_io_attn import patterns
from sparse_io_attn.nn import SparseSelfAttention
from sparse_io_attn.block_sparse.reference import rel_err

from helpers import free_port, spawn

WORLD = 2
LR = 0.1
TIMEOUT_S = 120  # a hung rank fails the test instead of blocking the suite


def _model() -> nn.Module:
    pattern = functools.partial(patterns.strided, block_size=8, stride=16, causal=True)
    return nn.Sequential(SparseSelfAttention(16, 4, pattern, num_kv_heads=2, causal=True, backend="torch"),
                         nn.Linear(16, 3))


def _step(model: nn.Module, fwd, x, y):
    """One SGD step on the mean squared error; returns (loss, grads, params after the step)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = nn.functional.mse_loss(fwd(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, port: int, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        data = torch.load(path + ".in")
        model = _model()
        model.load_state_dict(data["state"])
        ddp = DistributedDataParallel(model)
        x, y = data["x"].chunk(WORLD)[rank], data["y"].chunk(WORLD)[rank]
        loss, grads, params = _step(model, ddp, x, y)

        sharded = _model()
        sharded.load_state_dict(data["state"])
        fully_shard(sharded[0])  # shard the attention layer's parameters, then the rest
        fully_shard(sharded)
        nn.functional.mse_loss(sharded(x), y).backward()
        fsdp_grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        torch.save({"loss": loss, "grads": grads, "params": params, "fsdp_grads": fsdp_grads},
                   f"{path}.rank{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()



@pytest.mark.slow
def test_ddp_and_fsdp_gloo_two_processes_match_single_process(tmp_path):
    model = _model()
    x, y = torch.randn(4, 37, 16), torch.randn(4, 37, 3)  # 37: not a multiple of the block
    path = str(tmp_path / "ddp")
    torch.save({"state": model.state_dict(), "x": x, "y": y}, path + ".in")

    spawn(_worker, (free_port(), path), WORLD, "DDP workers", TIMEOUT_S)

    _, grads, params = _step(model, model, x, y)  # single process, combined batch
    ranks = [torch.load(f"{path}.rank{r}") for r in range(WORLD)]
    assert not torch.equal(ranks[0]["loss"], ranks[1]["loss"])  # the ranks saw different data
    for r in ranks:
        for name, g in grads.items():
            assert torch.isfinite(r["grads"][name]).all(), name
            if name == "0.k_proj.bias":  # a key bias shifts a row's scores equally: gradient ~ 0
                assert r["grads"][name].norm() < 1e-5 * r["grads"]["0.k_proj.weight"].norm()
                continue
            assert rel_err(r["grads"][name], g) < 1e-5, name
            assert rel_err(r["params"][name], params[name]) < 1e-6, name
            assert rel_err(r["fsdp_grads"][name], g) < 1e-5, name
