"""A job that SLURM preempts with a GraceTime, when the launch runs in the user's own batch
script: ``slurmrun SCRIPT.py`` requeues the job (SLURM requeues only a job whose batch
script still runs when the grace ends), and `launch` gives its workers the grace time, says
why it failed and does not restart.
(`slurmrun.submit`'s jobs: tests/slurm/test_requeue_slurm.py.)
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.slurm.conftest import (
    JOB_NAME,
    REPO,
    preempt_debug_jobs,
    preemption_grace,
    scontrol_job,
)
from tests.slurm.slurm_helpers import wait_for

# Every test here changes the whole cluster (the debug partition's GraceTime, every job of
# `debug` preempted): the other cluster tests wait meanwhile.
pytestmark = pytest.mark.cluster_exclusive

HOLD = """
import os, pathlib, time
rank = os.environ["RANK"]
if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    pathlib.Path(f"ready.{rank}").touch()
    time.sleep(120)
    raise SystemExit("not preempted")
pathlib.Path(f"second.{rank}").write_text(os.environ["SLURMD_NODENAME"])
"""


def _submit(tmp_path: Path, script: str, *args: str) -> str:
    path = tmp_path / "job.sh"
    path.write_text(f"#!/bin/bash\nexport PYTHONPATH={REPO}\n{textwrap.dedent(script)}")
    done = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=5", "--nodes=2",
         f"--output={tmp_path / 'job.out'}", "--open-mode=append", *args, str(path)],
        check=True, capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def _ready(tmp_path: Path) -> bool:
    return all((tmp_path / f"ready.{r}").exists() for r in (0, 1))


@pytest.mark.parametrize("where", ["batch script", "one-task step"])
def test_slurmrun_in_a_batch_script_requeues_its_preempted_job(slurm_cluster, tmp_path, where):
    # In a step, the command is SIGTERMed with the agents' step; in the batch script, not.
    (tmp_path / "hold.py").write_text(HOLD)
    srun = "srun --nodes=1 --ntasks=1 " if where == "one-task step" else ""
    script = f'{srun}{sys.executable} -m slurmrun hold.py\necho "slurmrun exited with $?"\n'
    with preemption_grace(20):
        job_id = _submit(tmp_path, script, "--requeue")
        wait_for(lambda: _ready(tmp_path), 90, "both ranks ready", job_id=job_id)
        preempt_debug_jobs(tmp_path, slurm_cluster)
        wait_for(lambda: scontrol_job(job_id)["Restarts"] == "1", 60, "the requeue", job_id=job_id)
    wait_for(
        lambda: scontrol_job(job_id)["JobState"] == "COMPLETED",
        120,
        "the second run",
        job_id=job_id,
    )
    assert [(tmp_path / f"second.{r}").read_text() for r in (0, 1)] == ["node1", "node2"]
    out = (tmp_path / "job.out").read_text()
    assert f"slurmrun: job {job_id} was preempted at " in out
    assert "requeueing it" in out
    # The first run's script never went on past the launch: only the second's did.
    assert out.count("slurmrun exited with") == 1
    assert "slurmrun exited with 0" in out


CHECKPOINT = """
import os, pathlib, signal, time
import slurmrun

def train():
    rank = os.environ["RANK"]
    pathlib.Path(f"attempt{os.environ['SLURMRUN_RESTART_COUNT']}.{rank}").touch()
    sigterms = []
    if rank == "0":  # rank 0 checkpoints on SIGTERM; rank 1 dies of it at once
        signal.signal(signal.SIGTERM, lambda *_: sigterms.append(time.time()))
    pathlib.Path(f"ready.{rank}").touch()
    while not sigterms:
        time.sleep(0.1)
    # longer than the launcher's own grace, well within the partition's GraceTime (20 s)
    time.sleep(10)
    pathlib.Path("checkpoint.0").write_text(str(len(sigterms)))

def on_event(event):
    if event.kind == "step_ending":
        print("event", event.kind, event.host, flush=True)

try:
    slurmrun.launch(train, backend=None, max_restarts=3, on_event=on_event)
except Exception as e:
    print("raised", type(e).__name__, e, *getattr(e, "__notes__", ()), sep="\\n", flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_preempted_launch_gives_its_workers_the_grace_time_and_says_why_it_failed(
    slurm_cluster, tmp_path
):
    """SLURM's SIGTERM reaches every process of the agents' step: the spawner must survive it
    (its workers die with it), the agent must not signal or kill the workers after its own
    short grace, and the launcher must wait for that agent, until SLURM's kill at the latest.
    The error then says that SLURM preempted the job, and `max_restarts` is not spent."""
    (tmp_path / "driver.py").write_text(CHECKPOINT)
    with preemption_grace(20):
        job_id = _submit(tmp_path, f"{sys.executable} driver.py\n", "--no-requeue")
        wait_for(lambda: _ready(tmp_path), 90, "both ranks ready", job_id=job_id)
        preempt_debug_jobs(tmp_path, slurm_cluster)
        wait_for(
            lambda: "raised" in (tmp_path / "job.out").read_text(), 60, "the error", job_id=job_id
        )
    out = (tmp_path / "job.out").read_text()
    # one SIGTERM (SLURM's), and the whole checkpoint written before the launch returned
    assert (tmp_path / "checkpoint.0").read_text() == "1", out
    # rank 1 died of SLURM's SIGTERM: the error says so, rather than blame the worker
    assert "AgentFailedError" in out and "SLURM is ending its step" in out
    assert "worker rank 1 (host node2, local rank 0) was killed by SIGTERM" in out
    assert "the launch is not restarted" in out
    assert sorted(p.name for p in tmp_path.glob("attempt*")) == ["attempt0.0", "attempt0.1"]
    assert f"slurmrun: SLURM preempted job {job_id} at " in out
    # the warning comes once per launch, for whichever agent said so first; each agent's event
    assert re.search(r"SLURM is ending the step on node[12] \(SIGTERM\)", out)
    assert "event step_ending node1" in out and "event step_ending node2" in out
