"""Rank 0's tqdm bar updates live in the launcher's terminal: `python examples/progress_bar.py`."""

from __future__ import annotations

import time

import slurmrun


def train() -> int:
    """Prints a line, runs a progress bar, and prints another line in the middle of it."""
    import torch.distributed as dist
    import tqdm

    print(f"rank {dist.get_rank()} of {dist.get_world_size()} starting", flush=True)
    for step in tqdm.tqdm(range(40), desc="epoch 1", mininterval=0):
        time.sleep(0.1)
        if step == 20:
            print("halfway: checkpoint saved", flush=True)
    return int(dist.get_rank())


if __name__ == "__main__":
    print("result:", slurmrun.launch(train, workers_per_host=2).values())
