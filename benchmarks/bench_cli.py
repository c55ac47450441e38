"""``slurmrun train.py`` against ``torchrun --standalone --nproc-per-node=2 train.py``.

    python benchmarks/bench_cli.py [--rounds N] [--workers N] [--json out.json]

The same torchrun-style script (init_process_group("gloo"), one all_reduce,
destroy_process_group) is started by both commands on this machine, the two alternating run
by run after one warm-up each; each figure is the whole command's wall time (from spawn to
exit), and the table shows medians and the ratio slurmrun / torchrun. slurmrun imports torch
once per node (in the agent's spawner, before it forks the workers); torchrun's workers each
import it themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRAIN = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def _timed(argv: list[str], cwd: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    cp = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    elapsed = time.perf_counter() - start
    if cp.returncode != 0:
        raise RuntimeError(f"{argv} exited with {cp.returncode}:\n{cp.stdout}\n{cp.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the medians here")
    opts = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's slurmrun
    env["SLURMRUN_LOG_DIR"] = ""
    n = str(opts.workers)
    commands = {
        "slurmrun": [sys.executable, "-m", "slurmrun", "--workers-per-host", n, "train.py"],
        "torchrun": [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *(f"--nproc-per-node={n}", "train.py"),
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "train.py").write_text(TRAIN)
        for argv in commands.values():
            _timed(argv, tmp, env)  # warm-up: page cache, .pyc files
        for _ in range(opts.rounds):
            for name, argv in commands.items():
                times[name].append(_timed(argv, tmp, env))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["slurmrun"] / med["torchrun"]
    print(f"{opts.workers} workers, {opts.rounds} rounds, whole command wall time (s)")
    print(f"{'command':<10} {'median':>8} {'min':>8} {'max':>8}")
    for name, t in times.items():
        print(f"{name:<10} {med[name]:8.3f} {min(t):8.3f} {max(t):8.3f}")
    print(f"slurmrun / torchrun = {ratio:.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"median_s": med, "ratio": ratio, "runs_s": times}))


if __name__ == "__main__":
    main()
