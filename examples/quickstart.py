"""A small DDP training loop: run it with `python examples/quickstart.py`.

How many workers: slurmrun's default, `workers_per_host="auto"`. On a laptop that is one
worker per usable CPU core; inside `salloc`/`sbatch` the same script runs one worker per GPU
of every node of the job (on nodes without GPUs, one per task). To choose the number per host
yourself, set `QUICKSTART_WORKERS` (`QUICKSTART_WORKERS=2 python examples/quickstart.py`).
"""

from __future__ import annotations

import os

import slurmrun


def train(steps: int, lr: float) -> dict[str, float]:
    """Fits y = 3x + 1 with DistributedDataParallel; each rank sees its own data shard."""
    import torch  # on the workers: the launcher itself never needs torch here
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randn(64, 1)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged over all ranks here
        optimizer.step()
    weight, bias = model.module.weight.item(), model.module.bias.item()
    return {"rank": rank, "world": world, "loss": loss.item(), "weight": weight, "bias": bias}


if __name__ == "__main__":
    workers: int | str = os.environ.get("QUICKSTART_WORKERS", "auto")
    if workers != "auto":
        workers = int(workers)
    result = slurmrun.launch(train, (200,), {"lr": 0.1}, workers_per_host=workers)
    for value in result.values():
        print(
            f"rank {value['rank']}/{value['world']}: loss {value['loss']:.4f}, "
            f"y = {value['weight']:.3f} x + {value['bias']:.3f}"
        )
