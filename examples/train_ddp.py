"""Train on many, test on one: `python examples/train_ddp.py`.

A small classifier is trained with DistributedDataParallel on every worker (gloo on CPUs here,
NCCL on GPUs inside a job); rank 0's trained state dict comes back to the launcher, which
evaluates it with a second launch of a single worker.

How many workers: slurmrun's default, `workers_per_host="auto"` (on a laptop, one per usable
CPU core; inside `salloc`/`sbatch`, one per GPU of every node of the job, or one per task on
nodes without GPUs); `TRAIN_DDP_WORKERS=2 python examples/train_ddp.py` sets the number per
host instead. torch is imported where it runs, on the workers; the launcher gets it only to
hold the returned tensors.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import slurmrun

if TYPE_CHECKING:
    import torch


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points in the plane, labelled by which side of the line x + y = 0 they fall on."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    return x, (x.sum(dim=1) > 0).long()


def make_model() -> torch.nn.Module:
    """The same architecture on the workers and in the evaluation."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def train(epochs: int, lr: float) -> dict[str, torch.Tensor]:
    """Trains with DDP; each rank sees its own shard of the data. Returns the state dict."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_data(512, seed=rank)
    for _ in range(epochs):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged over all ranks here
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def evaluate(state_dict: dict[str, torch.Tensor]) -> float:
    """Accuracy of the trained weights on held-out data (one worker, no process group)."""
    import torch

    model = make_model()
    model.load_state_dict(state_dict)
    x, y = make_data(2000, seed=12345)
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


if __name__ == "__main__":
    workers: int | str = os.environ.get("TRAIN_DDP_WORKERS", "auto")
    if workers != "auto":
        workers = int(workers)
    trained = slurmrun.launch(train, (100, 0.5), workers_per_host=workers)
    state_dict = trained.rank(0)  # every rank holds the same weights after DDP
    print(f"trained on {trained.world_size} workers")
    tested = slurmrun.launch(
        evaluate, (state_dict,), hostnames=["localhost"], workers_per_host=1, backend=None
    )
    print(f"test accuracy: {tested.rank(0):.3f}")
