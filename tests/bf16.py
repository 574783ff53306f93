"""bf16 models and the exact fp64 reference of their accumulated, reduced gradients."""
import torch
import torch.nn.functional as F

from helpers import mlp, shard


def loss_on(module, x, y, rank, world_size):
    return F.mse_loss(module(shard(x, rank, world_size).bfloat16()), shard(y, rank, world_size).bfloat16())


def exact_window(data, world_size, sync_each_batch=False):
    """fp64 sum over micro-steps and ranks of the bf16 gradients, divided like the accumulator does."""
    ref = mlp(seed=0, dtype=torch.bfloat16)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref.named_parameters()}
    for x, y in data:
        for r in range(world_size):
            ref.zero_grad()
            (loss_on(ref, x, y, r, world_size) / len(data)).backward()
            for n, p in ref.named_parameters():
                total[n] += p.grad.double()
    return {n: t / world_size for n, t in total.items()}


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()
