"""Rank 0's progress bar updates live in the launcher's terminal: `python examples/progress_bar.py`.

The bar redraws its line with a carriage return (`\r`), as tqdm and rich do: slurmrun shows
such a line in place, live, instead of one line per update. It is drawn by hand here so that
the example needs nothing beyond slurmrun; a tqdm bar (`pip install tqdm`) shows the same way.
Two workers, on a laptop or on one node of a job.
"""

from __future__ import annotations

import sys
import time

import slurmrun


def draw(desc: str, done: int, total: int, width: int = 30) -> None:
    """Redraws the bar on its own line of stderr."""
    filled = width * done // total
    sys.stderr.write(f"\r{desc}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    sys.stderr.flush()


def train() -> int:
    """Prints a line, runs a progress bar, and prints another line in the middle of it."""
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} of {dist.get_world_size()} starting", flush=True)
    steps = 40
    for step in range(steps):
        time.sleep(0.1)
        draw("epoch 1", step + 1, steps)
        if step == 20:
            print("halfway: checkpoint saved", flush=True)  # slurmrun keeps the bar intact
    sys.stderr.write("\n")
    return int(dist.get_rank())


if __name__ == "__main__":
    print("result:", slurmrun.launch(train, workers_per_host=2).values())
