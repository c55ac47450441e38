"""Each worker's SLURM variables on the real cluster: as srun would set them for a task of a
step with the run's layout (slurmrun/worker_env.py), and what ``slurmrun info`` says of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import JOB_NAME, REPO

EXPORT = f"export PYTHONPATH={REPO}\n"

SHOW = """
import json, os
names = [k for k in os.environ if k.startswith(("SLURM_", "PMI", "TORCHELASTIC_"))]
with open(f"env{os.environ['RANK']}.json", "w") as f:
    json.dump({k: os.environ[k] for k in names + ["SLURMD_NODENAME"]}, f)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_every_worker_sees_itself_as_one_task_of_the_runs_step(tmp_path: Path, sbatch) -> None:
    (tmp_path / "show.py").write_text(SHOW)
    job = sbatch(
        f"#SBATCH -N2 --ntasks-per-node=2 --cpus-per-task=1\n{EXPORT}"
        f"{sys.executable} -m slurmrun show.py\n"
        f"{sys.executable} -m slurmrun info\n",
        timeout=120,
    )
    assert job.returncode == 0, job.output
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]
    for rank, env in enumerate(seen):
        node = rank // 2
        assert env["SLURMD_NODENAME"] == f"node{node + 1}"
        assert (env["SLURM_PROCID"], env["SLURM_LOCALID"]) == (str(rank), str(rank % 2))
        assert env["SLURM_NODEID"] == str(node)
        assert env["SLURM_GTIDS"] == f"{2 * node},{2 * node + 1}"
        assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == env["SLURM_STEP_NUM_TASKS"] == "4"
        assert env["SLURM_NTASKS_PER_NODE"] == "2"
        assert env["SLURM_TASKS_PER_NODE"] == env["SLURM_STEP_TASKS_PER_NODE"] == "2(x2)"
        assert env["SLURM_NNODES"] == env["SLURM_STEP_NUM_NODES"] == "2"
        # the job's, which the agents' srun cannot carry (it reads them as its options)
        assert env["SLURM_JOB_NAME"] == JOB_NAME
        assert env["SLURM_JOB_NUM_NODES"] == "2"
        assert env["SLURM_CPUS_PER_TASK"] == "1"  # the job's -c, not the agents' step's 2
        assert env["SLURM_JOB_ID"] == env["TORCHELASTIC_RUN_ID"] == job.job_id
        assert not [k for k in env if k.startswith("PMI")]
    pids = {env["SLURM_TASK_PID"] for env in seen}
    assert len(pids) == 4
    # `slurmrun info` in the job lists what a worker adds, rank 0's values
    info = job.output[job.output.index("each worker adds") :].split()
    assert "SLURM_PROCID=0" in info
    assert "SLURM_TASKS_PER_NODE='2(x2)'" in info
    assert f"SLURM_JOB_NAME={JOB_NAME}" in info
    assert f"TORCHELASTIC_RUN_ID={job.job_id}" in info
