"""Runs inside ``salloc -N3``: trivial slurmrun launches next to bare ``srun`` steps.

    salloc -N3 python benchmarks/slurm_bench.py --rounds 5

Alternates ``srun -N3 python -c "import torch"`` and ``slurmrun.launch`` of a function that
does one all_reduce (gloo, one worker per node), then runs the same function rounds + 1 times
in one warm ``slurmrun.Launcher``; prints one ``BENCH_JSON`` line with the three series;
``error`` says why slurmrun could not launch, if it could not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit


def trivial() -> int:
    """One all_reduce, then the rank."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()


def time_srun() -> float:
    """Wall time of a bare srun step that imports torch on every node."""
    t0 = time.perf_counter()
    subprocess.run(["srun", "-N3", sys.executable, "-c", "import torch"], check=True, timeout=300)
    return time.perf_counter() - t0


def time_launch() -> float:
    """Wall time of one trivial slurmrun launch on the allocation's nodes."""
    import slurmrun

    t0 = time.perf_counter()
    result = slurmrun.launch(trivial, backend="gloo", timeout=120)
    elapsed = time.perf_counter() - t0
    if sorted(result.values()) != list(range(len(result.values()))):
        raise RuntimeError(f"unexpected results {result.values()}")
    return elapsed


def time_warm(runs: int) -> list[float]:
    """Wall time of each run of one warm launcher: the 1st starts the agents (one srun step)."""
    import slurmrun

    times = []
    with slurmrun.Launcher(backend="gloo", timeout=120) as launcher:
        for _ in range(runs):
            t0 = time.perf_counter()
            result = launcher.run(trivial)
            times.append(time.perf_counter() - t0)
            if sorted(result.values()) != list(range(len(result.values()))):
                raise RuntimeError(f"unexpected results {result.values()}")
    return times


def main() -> None:
    """Alternates srun and launch for --rounds rounds."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    data: dict[str, Any] = {
        "srun_s": [],
        "launch_s": [],
        "nodes": os.environ.get("SLURM_JOB_NODELIST"),
    }
    try:
        for _ in range(a.rounds):
            data["srun_s"].append(time_srun())
            data["launch_s"].append(time_launch())
        data["warm_s"] = time_warm(a.rounds + 1)
    except Exception as e:
        data["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        data["traceback"] = traceback.format_exc()[-2000:]
    emit(data)


if __name__ == "__main__":
    main()
