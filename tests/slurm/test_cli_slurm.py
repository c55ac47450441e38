"""The ``slurmrun`` command in a batch script on the real cluster: one launch line, two nodes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO

# The command imports this checkout's slurmrun, whatever is installed.
EXPORT = f"export PYTHONPATH={REPO}\n"

TRAIN = """
import argparse, json, os
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = dist.get_rank()
with open(f"rank{rank}.json", "w") as f:
    json.dump({"node": os.environ["SLURMD_NODENAME"], "local_rank": os.environ["LOCAL_RANK"],
               "world": dist.get_world_size(), "sum": t.item(), "epochs": args.epochs,
               "job": os.environ["SLURM_JOB_ID"]}, f)
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
dist.destroy_process_group()
"""


def _train(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(TRAIN))
    return path


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_sbatch_one_launch_line_runs_every_rank(tmp_path: Path, sbatch) -> None:
    _train(tmp_path)
    job = sbatch(
        f"#SBATCH -N2 --ntasks-per-node=2\n{EXPORT}"
        f"{sys.executable} -m slurmrun train.py --epochs 2\n",
        timeout=120,
    )
    assert job.returncode == 0
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(s["node"], s["local_rank"]) for s in seen] == [
        ("node1", "0"),
        ("node1", "1"),
        ("node2", "0"),
        ("node2", "1"),
    ], job.output
    assert {s["world"] for s in seen} == {4}
    assert {s["sum"] for s in seen} == {4.0}
    assert {s["epochs"] for s in seen} == {2}
    assert {s["job"] for s in seen} == {job.job_id}


def test_sbatch_rank_that_raises_fails_the_job_with_its_traceback(tmp_path: Path, sbatch) -> None:
    _train(tmp_path)
    job = sbatch(
        f"#SBATCH -N2 --ntasks-per-node=2\n{EXPORT}"
        f"{sys.executable} -m slurmrun train.py --epochs 2 --fail-rank 3\n",
        timeout=120,
        check=False,
    )
    assert job.returncode == 1, job.output
    assert "RuntimeError: rank 3 fails on purpose" in job.output
    assert 'raise RuntimeError(f"rank {rank} fails on purpose")' in job.output  # the traceback
    assert "rank 3 (host node2, local rank 1)" in job.output


def test_sbatch_ranks_shown_are_those_chosen_on_every_node_and_the_run_is_summed_up(
    tmp_path: Path, sbatch
) -> None:
    # Ranks 1 (node1's second) and 2 (node2's first): each agent forwards its own of them.
    (tmp_path / "talk.py").write_text("import os\nprint('line of rank', os.environ['RANK'])\n")
    job = sbatch(
        f"#SBATCH -N2 --ntasks-per-node=2\n{EXPORT}"
        f"{sys.executable} -m slurmrun --ranks 1,2 talk.py\n",
        timeout=120,
    )
    assert job.returncode == 0, job.output
    shown = sorted(line for line in job.output.splitlines() if "line of rank" in line)
    assert shown == ["[node1:1] line of rank 1", "[node2:0] line of rank 2"], job.output
    assert "slurmrun: 4 ranks on 2 hosts (node1, node2), " in job.output
    folder = tmp_path / job.output.split("0 restarts; logs: ")[1].split()[0]  # (or absolute)
    # Not shown, in its file (after the run's header line).
    assert (folder / "node2.1.log").read_text().splitlines()[1:] == ["line of rank 3"]
