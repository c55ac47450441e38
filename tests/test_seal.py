"""The job key and the seals of a job's pickles (`slurmrun.batch.seal`), without a cluster.

The cluster tests (tests/slurm/test_sealed_jobs_slurm.py) replace a job's call and result
for real; these check the key's file and modes, and the login side's reading of a result.
"""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slurmrun.batch.handle import JobFailedError, SubmittedLaunch
from slurmrun.batch.seal import job_key, key_path, new_nonce, read_sealed, write_sealed
from slurmrun.errors import JobFolderTamperedError, JobKeyError

NOBODY = 65534


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.path, "w"))


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "slurmrun"


def test_the_key_is_made_private_once_whatever_the_umask(config):
    old = os.umask(0o002)
    try:
        key = job_key(create=True)
    finally:
        os.umask(old)
    assert key_path() == config / "job-key"
    assert stat.S_IMODE(os.stat(config / "job-key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o700
    assert len(key) == 32
    assert job_key(create=True) == key
    assert job_key(create=False) == key
    assert sorted(os.listdir(config)) == ["job-key"]


def test_a_key_others_can_read_or_that_is_not_yours_is_refused(config):
    with pytest.raises(JobKeyError, match="there is no job key"):
        job_key(create=False)
    job_key(create=True)
    path = config / "job-key"
    path.chmod(0o640)
    with pytest.raises(JobKeyError, match="mode 0640: others may read it"):
        job_key(create=True)
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(JobKeyError, match=f"belongs to uid {NOBODY}, not to you"):
        job_key(create=False)
    os.chown(path, os.getuid(), os.getgid())
    config.chmod(0o777)
    with pytest.raises(JobKeyError, match="others may replace the key in it"):
        job_key(create=False)


def test_a_changed_or_unsealed_pickle_is_refused_before_it_is_unpickled(config, tmp_path):
    key = job_key(create=True)
    nonce = new_nonce()
    path = tmp_path / "12_0_result.pkl"
    write_sealed(path, pickle.dumps(("success", 1)), key=key, nonce=nonce)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_sealed(path, key=key).nonce == nonce
    marker = tmp_path / "pwned"
    seal = path.read_bytes().partition(b"\n")[0]
    path.write_bytes(seal + b"\n" + pickle.dumps(_Marker(marker)))
    with pytest.raises(JobFolderTamperedError, match="its seal does not match") as info:
        read_sealed(path, key=key)
    assert info.value.path == str(path)
    path.write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(JobFolderTamperedError, match="it has no slurmrun seal"):
        read_sealed(path, key=key)
    assert not marker.exists()


def _job(tmp_path: Path, call_nonce: str, result_nonce: str) -> SubmittedLaunch[object]:
    key = job_key(create=True)
    folder = tmp_path / "jobs" / "12"
    folder.mkdir(parents=True)
    write_sealed(folder / "12_submitted.pkl", b"call", key=key, nonce=call_nonce)
    write_sealed(
        folder / "12_0_result.pkl", pickle.dumps(("success", 7)), key=key, nonce=result_nonce
    )
    return SubmittedLaunch("12", tmp_path / "jobs")


def test_a_result_another_submission_of_the_id_left_is_not_this_jobs(config, tmp_path):
    ours = new_nonce()
    assert _job(tmp_path / "a", ours, ours)._read_result("COMPLETED") == 7
    with pytest.raises(JobFailedError, match="ended CANCELLED without a result"):
        _job(tmp_path / "b", ours, new_nonce())._read_result("CANCELLED")


def _run_job(folder: Path, nonce: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SUBMITIT_EXECUTOR": "slurm"}
    module = ["-m", "slurmrun.batch.sealed_job", nonce, "-u", "-m", "submitit.core._submit"]
    return subprocess.run(
        [sys.executable, "-u", *module, str(folder / "%j")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_job_runs_its_sealed_call_and_nothing_else(config, tmp_path):
    from submitit.core.utils import DelayedSubmission

    key = job_key(create=True)
    nonce = new_nonce()
    call = tmp_path / "12" / "12_submitted.pkl"
    call.parent.mkdir()
    write_sealed(call, pickle.dumps(DelayedSubmission(max, 3, 5)), key=key, nonce=nonce)
    assert _run_job(tmp_path, nonce).returncode == 0
    result = read_sealed(tmp_path / "12" / "12_0_result.pkl", key=key)
    assert (result.nonce, pickle.loads(result.payload)) == (nonce, ("success", 5))
    marker = tmp_path / "pwned"
    seal = call.read_bytes().partition(b"\n")[0]
    call.write_bytes(seal + b"\n" + pickle.dumps(_Marker(marker)))
    done = _run_job(tmp_path, nonce)
    assert done.returncode == 1
    assert "was not written by your slurmrun" in done.stderr
    result = read_sealed(tmp_path / "12" / "12_0_result.pkl", key=key)
    status, outcome = pickle.loads(result.payload)
    assert status == "success"
    with pytest.raises(JobFolderTamperedError):
        outcome.unwrap()
    assert not marker.exists()
