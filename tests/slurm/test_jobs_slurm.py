"""slurmrun.submit's handle on the real cluster: states, logs, cancel, attach, errors, signals.

The functions live in a module of a project folder that the submitter (this pytest process)
has on its sys.path and the job does not: the job must restore the submitter's sys.path.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from slurmrun.batch import JobFailedError
from tests.slurm.slurm_helpers import cancelled_on_failure, project_module, wait_for

FUNCS = '''
import os
import pathlib
import signal
import time


def where(scale):
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * scale
    dist.all_reduce(t)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK"), os.environ.get("SLURM_JOB_CPUS_PER_NODE")
    env = os.environ
    return env["SLURMD_NODENAME"], int(env["RANK"]), env["SLURM_JOB_ID"], t.item(), cpus


def key_error_on_rank1():
    if os.environ["RANK"] == "1":
        raise KeyError("missing-key")
    return 0


def exit_on_rank1():
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(60)


def talk_until(flag, seconds=90):
    """Prints a line a second until `flag` exists (the test creates it), then returns RANK."""
    rank = os.environ["RANK"]
    deadline = time.monotonic() + seconds
    i = 0
    while not os.path.exists(flag) and time.monotonic() < deadline:
        print(f"rank {rank} line {i}", flush=True)
        i += 1
        time.sleep(0.5)
    return int(rank)


def handler_or_not(flag):
    """Rank 0 installs a USR2 handler (it asked for the signal); the others do not."""
    got = []
    if os.environ["RANK"] == "0":
        signal.signal(signal.SIGUSR2, lambda *_: got.append(1))
    pathlib.Path(flag + ".ready." + os.environ["RANK"]).touch()
    deadline = time.monotonic() + 90
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(got)
'''


@pytest.fixture
def funcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The project module, importable here only through sys.path; jobs submitted from tmp_path."""
    yield from project_module(tmp_path, monkeypatch, "jobfuncs", FUNCS)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
@pytest.mark.cluster_exclusive  # 3 of node1's 4 CPUs: another group's test would not fit there
def test_a_function_from_the_submitters_sys_path_runs_on_every_cpu_of_one_node(
    slurm_cluster, funcs, tmp_path
):
    job = slurmrun.submit(
        funcs.where, (1.0,), nodes=1, workers_per_node=3, folder=tmp_path / "jobs", time_min=3
    )
    with cancelled_on_failure(job):
        result = job.result(timeout=120, poll=0.5)
    values = result.values()
    assert [v[1] for v in values] == [0, 1, 2]
    assert {v[2] for v in values} == {job.job_id}
    assert {v[3] for v in values} == {3.0}
    # the job has 3 CPUs on its node, one per task (its --cpus-per-task, which each worker
    # sees as a task of a plain srun in the job would: not the agents' step's 3)
    assert {v[4] for v in values} == {("1", "3")}
    assert job.state == "COMPLETED"
    assert job.done()


def test_a_workers_exception_comes_back_as_itself(slurm_cluster, funcs, tmp_path):
    job = slurmrun.submit(funcs.key_error_on_rank1, nodes=2, folder=tmp_path / "jobs", time_min=3)
    with cancelled_on_failure(job), pytest.raises(KeyError, match="missing-key") as info:
        job.result(timeout=120, poll=0.5)
    assert "key_error_on_rank1" in str(info.value.__cause__)
    assert job.wait(timeout=10) == "COMPLETED"  # the job returned the error as its outcome


def test_a_dead_worker_comes_back_as_worker_failed_error(slurm_cluster, funcs, tmp_path):
    job = slurmrun.submit(funcs.exit_on_rank1, nodes=2, folder=tmp_path / "jobs", time_min=3)
    with cancelled_on_failure(job), pytest.raises(slurmrun.WorkerFailedError) as info:
        job.result(timeout=120, poll=0.5)
    assert info.value.rank == 1
    assert info.value.exitcode == 3


def test_logs_while_running_then_cancel_is_seen_within_10_s(slurm_cluster, funcs, tmp_path):
    flag = str(tmp_path / "never")  # never created: the job runs until cancelled
    job = slurmrun.submit(funcs.talk_until, (flag,), nodes=2, folder=tmp_path / "jobs", time_min=3)
    with cancelled_on_failure(job):
        wait_for(lambda: "rank 1 line 2" in job.logs(rank=1), 90, "rank 1's third line")
        assert job.state == "RUNNING"
        assert "rank 0 line" not in job.logs(rank=1)
        job.cancel()
        start = time.monotonic()
        state = job.wait(timeout=10, poll=0.5)
        waited = time.monotonic() - start
    assert state == "CANCELLED", waited
    with pytest.raises(JobFailedError, match="CANCELLED"):
        job.result(timeout=5)


def test_attach_from_another_process_and_a_pickled_handle(slurm_cluster, funcs, tmp_path):
    flag = tmp_path / "go"
    job = slurmrun.submit(
        funcs.talk_until, (str(flag),), nodes=2, folder=tmp_path / "jobs", time_min=3
    )
    with cancelled_on_failure(job):
        wait_for(lambda: "line 1" in job.logs(rank=1), 90, "rank 1's output")
        script = textwrap.dedent(f"""
            import slurmrun
            job = slurmrun.attach({job.job_id!r}, folder={str(tmp_path / "jobs")!r})
            print("state", job.state)
            print("logs", job.logs(rank=1).replace("\\n", " "))
            listed = slurmrun.jobs(folder={str(tmp_path / "jobs")!r})
            print("listed", [(j.job_id, j.state) for j in listed])
            open({str(flag)!r}, "w").close()
            print("result", job.result(timeout=60, poll=0.5).values())
        """)
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "state RUNNING"
    assert "rank 1 line 0" in lines[1]  # (torch may print a warning of its own first)
    assert lines[2] == f"listed [('{job.job_id}', 'RUNNING')]"
    assert lines[3] == "result [0, 1]"
    again = pickle.loads(pickle.dumps(job))
    assert again == job
    assert again.result(timeout=10).values() == [0, 1]
    assert [(j.job_id, j.state) for j in slurmrun.jobs(folder=tmp_path / "jobs")] == [
        (job.job_id, "COMPLETED")
    ]


def test_usr2_does_not_kill_workers_that_did_not_ask_for_it(slurm_cluster, funcs, tmp_path):
    flag = tmp_path / "go"
    job = slurmrun.submit(
        funcs.handler_or_not,
        (str(flag),),
        nodes=2,
        folder=tmp_path / "jobs",
        time_min=3,
        requeue=False,  # the signal would requeue the job (test_requeue_slurm.py)
    )
    with cancelled_on_failure(job):
        wait_for(
            lambda: all((tmp_path / f"go.ready.{r}").exists() for r in (0, 1)), 90, "workers ready"
        )
        subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
        time.sleep(2)  # the signal is delivered by slurmstepd; give it time to land
        flag.touch()
        result = job.result(timeout=60, poll=0.5)
    # rank 0 asked for the signal and got it; rank 1 did not ask, and lived
    assert result.values() == [1, 0]


def test_no_warning_is_printed_while_polling(slurm_cluster, funcs, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path / "project")!r})
        import slurmrun
        import {funcs.__name__} as funcs
        job = slurmrun.submit(funcs.key_error_on_rank1, nodes=1, workers_per_node=1,
                              folder="jobs", time_min=3)
        print(job.wait(timeout=90, poll=0.2))
        print(job.result().values())
    """)
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["COMPLETED", "[0]"]
    assert done.stderr == ""


@pytest.mark.cluster_exclusive  # 3 jobs on node1: another group's test would not fit there
def test_listing_many_jobs_asks_the_controller_once(slurm_cluster, funcs, tmp_path, monkeypatch):
    # squeue and sacct stay the real ones; a wrapper in front of each records its calls.
    calls = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("squeue", "sacct"):
        real = shutil.which(tool)
        assert real is not None, tool
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    flag = tmp_path / "go"
    folder = tmp_path / "jobs"
    submitted = [
        slurmrun.submit(funcs.talk_until, (str(flag),), nodes=1, folder=folder, time_min=3)
        for _ in range(3)
    ]
    try:
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        listed = slurmrun.jobs(folder=folder)
        asked = calls.read_text().splitlines()
    finally:
        flag.touch()
        for job in submitted:
            with contextlib.suppress(Exception):
                job.result(timeout=120, poll=0.5)
    assert sorted(j.job_id for j in listed) == sorted(j.job_id for j in submitted)
    assert len(asked) == 1, asked  # one squeue for the three jobs, no sacct (squeue knew them)
    assert asked[0].startswith("squeue ")
    assert all(job.job_id in asked[0] for job in submitted), asked
