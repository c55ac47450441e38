"""A job's folder on the real cluster: replaced pickles never load, reused ids never merge.

Each replacement keeps the file's seal line (as one who copies a sealed file and changes its
pickle would) and puts in a pickle that, once unpickled, creates a marker file; the marker
must never appear, wherever the pickle is read: on the node (the call, also when a requeued
job reads it again) or on the login node (the result, by ``slurmrun status`` and
``attach(...).result()``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from slurmrun.errors import JobFolderTamperedError
from tests.slurm.conftest import scontrol_job
from tests.slurm.slurm_helpers import REPO, cancelled_on_failure, project_module, wait_for

FUNCS = """
import os
import pathlib
import time

import slurmrun


def values(tag):
    print(f"output of the {tag} job", flush=True)
    return tag, int(os.environ["RANK"])


def wait_for_requeue(ready):
    if int(os.environ["SLURMRUN_REQUEUE_COUNT"]) > 0:
        return "requeued"
    pathlib.Path(ready).touch()
    deadline = time.monotonic() + 120
    while not slurmrun.requeue_requested() and time.monotonic() < deadline:
        time.sleep(0.1)
    return "cut short"
"""
HOLD = {"additional_parameters": {"hold": True}}


class _Marker:
    """Unpickled, it creates its file (what an attacker's pickle would do, harmlessly)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.fixture
def funcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from project_module(tmp_path, monkeypatch, "sealfuncs", FUNCS)


def replace_pickle(path: Path, marker: Path) -> None:
    """Puts a pickle that creates `marker` into `path`, keeping its first line if it is a seal."""
    first, newline, _ = path.read_bytes().partition(b"\n")
    seal = first + newline if first.startswith(b"slurmrun-sealed") else b""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(seal + pickle.dumps(_Marker(marker)))
    tmp.replace(path)


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


@pytest.mark.quick
def test_a_replaced_call_never_runs_on_the_node(slurm_cluster, funcs, tmp_path):
    marker = tmp_path / "pwned_on_node"
    job = slurmrun.submit(
        funcs.values, ("new",), folder=tmp_path / "jobs", time_min=5, slurm_parameters=HOLD
    )
    with cancelled_on_failure(job):
        replace_pickle(job.files.submitted_pickle, marker)
        subprocess.run(["scontrol", "release", job.job_id], check=True, timeout=30)
        with pytest.raises(JobFolderTamperedError) as info:
            job.result(timeout=120, poll=0.5)
    assert info.value.path == str(job.files.submitted_pickle)
    assert not marker.exists()
    assert job.state == "FAILED"
    assert "was not written by your slurmrun" in job.files.stderr.read_text()


def test_a_replaced_result_is_never_unpickled_by_status_or_result(slurm_cluster, funcs, tmp_path):
    folder = tmp_path / "jobs"
    job = slurmrun.submit(funcs.values, ("new",), folder=folder, time_min=5)
    with cancelled_on_failure(job):
        assert job.result(timeout=120, poll=0.5).values() == [("new", 0)]
    marker = tmp_path / "pwned_on_login"
    replace_pickle(job.files.result_pickle, marker)
    status = cli(tmp_path, "status", job.job_id, "--folder", str(folder))
    assert status.returncode == 1, status
    assert "was not written by your slurmrun" in status.stderr
    with pytest.raises(JobFolderTamperedError) as info:
        slurmrun.attach(job.job_id, folder=folder).result(timeout=10)
    assert info.value.path == str(job.files.result_pickle)
    assert not marker.exists()


def test_a_replaced_call_is_refused_when_the_requeued_job_reads_it_again(
    slurm_cluster, funcs, tmp_path
):
    ready = tmp_path / "ready"
    marker = tmp_path / "pwned_on_requeue"
    job = slurmrun.submit(
        funcs.wait_for_requeue, (str(ready),), folder=tmp_path / "jobs", time_min=5
    )
    with cancelled_on_failure(job):
        wait_for(ready.exists, 90, "the first run")
        replace_pickle(job.files.submitted_pickle, marker)
        subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
        # SLURM holds a requeued job until its credentials expired (cred_expire) to restart it.
        with pytest.raises(JobFolderTamperedError):
            job.result(timeout=180, poll=1.0)
    assert scontrol_job(job.job_id)["Restarts"] == "1"
    assert not marker.exists()


def plant_old_job(old: Path, old_id: str, new_id: str) -> None:
    """Leaves at ``<folder>/<new_id>`` what a finished job of that id would have left."""
    new = old.parent / new_id
    new.mkdir()
    for path in old.iterdir():
        if path.is_file():
            name = path.name
            if name.startswith(f"{old_id}_"):
                name = f"{new_id}_{name.removeprefix(f'{old_id}_')}"
            shutil.copy2(path, new / name)
    meta = json.loads((new / "slurmrun.json").read_text())
    (new / "slurmrun.json").write_text(json.dumps({**meta, "job_id": new_id}))


def test_a_reused_job_id_never_shows_the_old_jobs_files(slurm_cluster, funcs, tmp_path, capfd):
    folder = tmp_path / "jobs"
    old = slurmrun.submit(funcs.values, ("old",), folder=folder, time_min=5)
    with cancelled_on_failure(old):
        assert old.result(timeout=120, poll=0.5).values() == [("old", 0)]
    old.files.cache_state("COMPLETED")
    # The next job's id is one of these (other sessions may submit meanwhile): each holds a
    # finished old job's files, as after SLURM's job ids started again.
    planted = [str(int(old.job_id) + k) for k in range(1, 101)]
    for job_id in planted:
        plant_old_job(old.files.path, old.job_id, job_id)
    new = slurmrun.submit(funcs.values, ("new",), folder=folder, time_min=5, slurm_parameters=HOLD)
    with cancelled_on_failure(new):
        assert new.job_id in planted
        cancel = cli(tmp_path, "cancel", new.job_id, "--folder", str(folder))
        assert cancel.returncode == 0, cancel
        wait_for(lambda: new.state == "CANCELLED", 60, "the cancel")
    status = cli(tmp_path, "status", new.job_id, "--folder", str(folder))
    assert status.returncode == 0, status
    assert status.stdout.startswith(f"{new.job_id} CANCELLED\n")
    assert "without a result" in status.stdout
    assert "every rank finished" not in status.stdout
    with pytest.raises(slurmrun.batch.JobFailedError):
        slurmrun.attach(new.job_id, folder=folder).result(timeout=10)
    logs = cli(tmp_path, "logs", new.job_id, "--folder", str(folder))
    assert "old" not in logs.stdout
    rows = cli(tmp_path, "jobs", "--folder", str(folder)).stdout.splitlines()
    row = next(r.split() for r in rows if r.split()[0] == new.job_id)
    assert row[1] == "CANCELLED"
    aside = list(folder.glob(f"{new.job_id}.old-*"))
    assert len(aside) == 1
    assert "output of the old job" in (aside[0] / "rank0.log").read_text()
    assert f"job id {new.job_id} was used before" in capfd.readouterr().err
