"""Requeue on SLURM's signal and on preemption, and job arrays, on the real cluster.

The functions live in a project module that only the submitter's sys.path has (as in
test_jobs_slurm.py). A requeued job waits in PENDING until its job credentials expired
before it may start again (SLURM sets its begin time past the expiry; starting it sooner
gets it killed with "Job credential revoked"): 120 s by default, 10 s in the test cluster
(``AuthInfo=cred_expire=10``), so each requeue test takes at least that long.

The test cluster preempts as shared GPU clusters do: a job of the `urgent` partition requeues
the jobs of `debug` (the default) that hold the nodes it needs (PreemptMode=REQUEUE).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from tests.slurm.conftest import preempt_debug_jobs, preemption_grace, scontrol_job
from tests.slurm.slurm_helpers import cancelled_on_failure, project_module, wait_for

FUNCS = '''
import os
import pathlib
import time

import slurmrun


def checkpointed_counter(checkpoint, ready):
    """Run 0 waits for the requeue signal, checkpoints 41 and returns; run 1 adds 1 to it."""
    path = pathlib.Path(checkpoint)
    value = int(path.read_text()) if path.exists() else 0
    runs = int(os.environ["SLURMRUN_REQUEUE_COUNT"])
    if runs == 0:
        pathlib.Path(f"{ready}.{os.environ['RANK']}").touch()
        deadline = time.monotonic() + 120
        while not slurmrun.requeue_requested() and time.monotonic() < deadline:
            time.sleep(0.1)
        if os.environ["RANK"] == "0":
            path.write_text("41")
        return "cut short"
    return runs, value + 1


def preemptible_counter(checkpoint, ready):
    """Run 0 checkpoints 41 and waits to be preempted; run 1 adds 1 to the checkpoint."""
    path = pathlib.Path(checkpoint)
    runs = int(os.environ["SLURMRUN_REQUEUE_COUNT"])
    if runs == 0:
        if os.environ["RANK"] == "0":
            path.write_text("41")
        pathlib.Path(f"{ready}.{os.environ['RANK']}").touch()
        time.sleep(120)
        return "not preempted"
    return runs, int(path.read_text()) + 1


def wait_for_signal(ready):
    pathlib.Path(f"{ready}.{os.environ['RANK']}").touch()
    deadline = time.monotonic() + 120
    while not slurmrun.requeue_requested() and time.monotonic() < deadline:
        time.sleep(0.1)
    return "cut short"


def element(k, scale):
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * k * scale
    dist.all_reduce(t)
    env = os.environ
    return k, t.item(), env["SLURM_JOB_ID"], env["SLURM_ARRAY_TASK_ID"], env["SLURMD_NODENAME"]
'''


@pytest.fixture
def funcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from project_module(tmp_path, monkeypatch, "requeuefuncs", FUNCS)


def _wait_ready(ready: Path) -> None:
    wait_for(lambda: all(Path(f"{ready}.{r}").exists() for r in (0, 1)), 90, "workers ready")


def _signal_when_ready(job: slurmrun.SubmittedLaunch[Any], ready: Path) -> None:
    _wait_ready(ready)
    # The form the issue names: every step of the job (not the batch step) gets it.
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_signalled_job_is_requeued_and_its_second_run_reads_the_checkpoint(
    slurm_cluster, funcs, tmp_path
):
    ready = tmp_path / "ready"
    job = slurmrun.submit(
        funcs.checkpointed_counter,
        (str(tmp_path / "checkpoint"), str(ready)),
        nodes=2,
        folder=tmp_path / "jobs",
        time_min=10,
    )
    with cancelled_on_failure(job):
        _signal_when_ready(job, ready)
        wait_for(lambda: job.state == "PENDING", 60, "the requeue")
        # SLURM holds a requeued job until its credentials expired (cred_expire) to restart it.
        result = job.result(timeout=300, poll=1.0)
    assert result.values() == [(1, 42), (1, 42)]
    assert (tmp_path / "jobs" / job.job_id / "requeue.0").exists()
    assert scontrol_job(job.job_id)["Restarts"] == "1"
    assert job.state == "COMPLETED"


def test_a_job_signalled_past_its_requeue_cap_fails_clearly(slurm_cluster, funcs, tmp_path):
    ready = tmp_path / "ready"
    job = slurmrun.submit(
        funcs.wait_for_signal,
        (str(ready),),
        nodes=2,
        folder=tmp_path / "jobs",
        time_min=5,
        requeue=slurmrun.Requeue(max_requeues=0),
    )
    with cancelled_on_failure(job):
        _signal_when_ready(job, ready)
        with pytest.raises(slurmrun.batch.RequeueLimitError, match=r"after 0 requeues"):
            job.result(timeout=90, poll=0.5)
    assert job.state == "COMPLETED"  # the job ended by itself, with that error as its outcome


def test_an_array_of_multi_node_launches_returns_each_elements_result(
    slurm_cluster, funcs, tmp_path
):
    jobs = slurmrun.submit_array(
        funcs.element,
        [(0, 1.0), (1, 1.0), (2, 10.0)],
        nodes=2,
        max_parallel=1,
        folder=tmp_path / "jobs",
        time_min=5,
    )
    with cancelled_on_failure(*jobs):
        results = [job.result(timeout=180, poll=0.5).values() for job in jobs]
    array_id = jobs[0].job_id.split("_")[0]
    assert [job.job_id for job in jobs] == [f"{array_id}_{k}" for k in range(3)]
    for k, (values, scale) in enumerate(zip(results, (1.0, 1.0, 10.0), strict=True)):
        assert len(values) == 2  # one worker on each of 2 nodes
        assert {v[:2] for v in values} == {(k, 2 * k * scale)}
        assert {v[3] for v in values} == {str(k)}
        assert len({v[4] for v in values}) == 2
    listed = slurmrun.jobs(folder=tmp_path / "jobs")
    assert [(j.job_id, j.state) for j in listed] == [(j.job_id, "COMPLETED") for j in jobs]


@contextlib.contextmanager
def preempted_job(
    funcs: Any, tmp_path: Path, cluster: Any, **more: Any
) -> Iterator[slurmrun.SubmittedLaunch[Any]]:
    """A 2-node job of `preemptible_counter`, preempted (GraceTime 20 s) once both ranks run."""
    ready = tmp_path / "ready"
    with preemption_grace(20):
        job = slurmrun.submit(
            funcs.preemptible_counter,
            (str(tmp_path / "checkpoint"), str(ready)),
            nodes=2,
            folder=tmp_path / "jobs",
            time_min=10,
            **more,
        )
        with cancelled_on_failure(job):
            _wait_ready(ready)
            preempt_debug_jobs(tmp_path, cluster)
            yield job


@pytest.mark.cluster_exclusive  # every job of `debug` preempted, its GraceTime changed
def test_a_preempted_job_is_requeued_and_its_second_run_reads_the_checkpoint(
    slurm_cluster, funcs, tmp_path
):
    # With a GraceTime the steps get SIGTERM and the launch fails while the job still runs:
    # the batch step must requeue it (SLURM would end it COMPLETED). With GraceTime=0 SLURM
    # kills and requeues the job itself (seen by hand; not run here, to spare the suite 60 s).
    with preempted_job(funcs, tmp_path, slurm_cluster) as job:
        wait_for(lambda: job.state == "PENDING", 60, "the requeue")
    with cancelled_on_failure(job):
        result = job.result(timeout=150, poll=1.0)
    assert result.values() == [(1, 42), (1, 42)]
    assert scontrol_job(job.job_id)["Restarts"] == "1"
    err = (tmp_path / "jobs" / job.job_id / f"{job.job_id}_0_log.err").read_text()
    assert "this run will be requeued" in err


@pytest.mark.cluster_exclusive  # every job of `debug` preempted, its GraceTime changed
def test_a_job_preempted_past_its_requeue_cap_fails_clearly(slurm_cluster, funcs, tmp_path):
    limit = slurmrun.Requeue(max_requeues=0)
    with (
        preempted_job(funcs, tmp_path, slurm_cluster, requeue=limit) as job,
        pytest.raises(slurmrun.batch.RequeueLimitError, match=r"was preempted after 0 requeues"),
    ):
        job.result(timeout=90, poll=0.5)
