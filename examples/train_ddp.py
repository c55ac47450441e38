"""Train on many, test on one: `python examples/train_ddp.py`.

A small classifier is trained with DistributedDataParallel on every worker (gloo on CPUs here,
NCCL on GPUs inside a job); rank 0's trained state dict comes back to the launcher, which
evaluates it with a second launch of a single worker.
"""

from __future__ import annotations

import os

import torch

import slurmrun


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points in the plane, labelled by which side of the line x + y = 0 they fall on."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    return x, (x.sum(dim=1) > 0).long()


def make_model() -> torch.nn.Module:
    """The same architecture on the workers and in the evaluation."""
    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def train(epochs: int, lr: float) -> dict[str, torch.Tensor]:
    """Trains with DDP; each rank sees its own shard of the data. Returns the state dict."""
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
    model = make_model()
    model.load_state_dict(state_dict)
    x, y = make_data(2000, seed=12345)
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


if __name__ == "__main__":
    workers = int(os.environ.get("TRAIN_DDP_WORKERS", "2"))
    trained = slurmrun.launch(train, (100, 0.5), workers_per_host=workers)
    state_dict = trained.rank(0)  # every rank holds the same weights after DDP
    print(f"trained on {trained.world_size} workers")
    tested = slurmrun.launch(
        evaluate, (state_dict,), hostnames=["localhost"], workers_per_host=1, backend=None
    )
    print(f"test accuracy: {tested.rank(0):.3f}")
