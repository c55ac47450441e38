"""A preempted reservation: SLURM requeues it under the same id; a run in progress fails with
`ReservationRequeuedError`; the next run waits for the job to run again, and runs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import slurmrun
from slurmrun.errors import ReservationRequeuedError
from tests.slurm.conftest import JOB_NAME, preempt_debug_jobs, scontrol_job
from tests.slurm.slurm_helpers import wait_for

# Every test here changes the whole cluster (every job of `debug` preempted):
# the other cluster tests wait meanwhile.
pytestmark = pytest.mark.cluster_exclusive


def where() -> tuple[str, int]:
    return os.environ["SLURMD_NODENAME"], int(os.environ["RANK"])


def nap() -> None:
    print("napping", flush=True)
    time.sleep(120)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_preempted_reservation_comes_back_under_its_id_and_the_next_run_waits_for_it(
    slurm_cluster, tmp_path: Path, monkeypatch, node_processes
):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    reservation = slurmrun.reserve(
        nodes=2, time_min=5, idle_timeout=120, folder=tmp_path / "jobs",
        slurm_parameters={"job_name": JOB_NAME},
    )  # fmt: skip
    with reservation:
        reservation.wait(60)
        job = reservation.job_id
        with slurmrun.Launcher(job=job, timeout=120) as launcher:
            assert launcher.run(where).values() == [("node1", 0), ("node2", 1)]
            failed: list[BaseException] = []

            def run() -> None:
                try:
                    launcher.run(nap)
                except BaseException as e:
                    failed.append(e)

            thread = threading.Thread(target=run)
            thread.start()
            workers = lambda: [  # noqa: E731
                p for ps in node_processes(wait=0).values() for p in ps if " rank " in p.cmdline
            ]
            wait_for(lambda: len(workers()) == 2, 30, "both workers napping", job_id=job)
            preempt_debug_jobs(tmp_path, slurm_cluster)
            thread.join(60)
            assert not thread.is_alive(), "the run in progress did not end"
            assert failed and isinstance(failed[0], ReservationRequeuedError), failed
            assert f"reservation {job} was requeued" in str(failed[0]), failed[0]
            assert scontrol_job(job)["Restarts"] == "1"
            # The same launcher's next run waits for the job to run again (the urgent job
            # sleeps 1 s), and runs on the new keeper's agents.
            started = time.monotonic()
            assert launcher.run(where).values() == [("node1", 0), ("node2", 1)]
            print(f"the next run, through the requeue: {time.monotonic() - started:.1f} s")
        assert slurmrun.launch(where, job=job, timeout=60).values() == [
            ("node1", 0),
            ("node2", 1),
        ]
        assert scontrol_job(job)["JobState"] == "RUNNING"
    assert node_processes() == {}
