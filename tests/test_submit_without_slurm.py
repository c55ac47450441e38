"""`slurmrun submit` where SLURM cannot take the job: a clear error, within seconds, nothing left.

No cluster is needed: SLURM's commands are hidden from PATH, or pointed (SLURM_CONF) at a
controller that is not there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmrun.batch.folder import JobFolder
from slurmrun.batch.seal import job_key, new_nonce, write_sealed

REPO = Path(__file__).resolve().parents[1]
needs_slurm_commands = pytest.mark.skipif(
    not all(shutil.which(c) for c in ("sbatch", "srun", "scontrol")),
    reason="needs SLURM's commands (no cluster)",
)


def submit(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "x.py").write_text("print('hi')\n")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "slurmrun", "submit", "--nodes", "1", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        check=False,
    )
    return done, time.monotonic() - start


def test_without_slurms_commands_it_says_so(tmp_path):
    bare = tmp_path / "bin"  # a PATH with python and nothing of SLURM's
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    done, took = submit(tmp_path, PATH=str(bare))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "slurmrun submit: sbatch and srun not found on PATH" in done.stderr
    assert "Submit from a login node of your cluster" in done.stderr
    assert "`slurmrun SCRIPT.py`" in done.stderr  # what runs it here instead
    assert done.stdout == ""
    assert not (tmp_path / "slurmrun_jobs").exists()
    assert took < 15


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_slurm_commands
def test_with_no_controller_answering_it_says_so_within_seconds(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=elsewhere\n"
        "SlurmctldHost=nowhere(127.0.0.1)\n"
        f"SlurmctldPort={unused_port()}\n"  # nothing listens: refused
        "MessageTimeout=2\n"
        "NodeName=n1 CPUs=1\n"
        "PartitionName=p Nodes=n1\n"
    )
    done, took = submit(tmp_path, SLURM_CONF=str(conf))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "slurmrun submit: no SLURM controller answers (`scontrol ping`: " in done.stderr
    assert f"Check that SLURM_CONF={conf} is your cluster's" in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "slurmrun_jobs").exists()
    assert took < 15  # sbatch alone tries for 20 s with the default MessageTimeout


@needs_slurm_commands
def test_a_missing_slurm_conf_is_named_at_once(tmp_path):
    done, took = submit(tmp_path, SLURM_CONF=str(tmp_path / "no.conf"))
    assert done.returncode == 1, done.stderr
    assert f"SLURM_CONF={tmp_path / 'no.conf'}: no such file" in done.stderr
    assert took < 15  # SLURM's commands retry a missing file for 60 s


@needs_slurm_commands
def test_a_controller_host_that_does_not_resolve_is_named_at_once(tmp_path):
    """Issue 45 (6a): not scontrol's ten ``getaddrinfo() failed ... attempt number`` in 10 s."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=elsewhere\n"
        "SlurmctldHost=nowhere.invalid\n"  # .invalid never resolves (RFC 2606)
        "NodeName=n1 CPUs=1\n"
        "PartitionName=p Nodes=n1\n"
    )
    done, took = submit(tmp_path, SLURM_CONF=str(conf))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"slurmrun submit: the SLURM controller's host nowhere.invalid (SlurmctldHost in "
        f"SLURM_CONF={conf}) does not resolve to an address here, so nothing was submitted. "
        f"Check that SLURM_CONF={conf} is your cluster's, and that this machine's DNS (or "
        "/etc/hosts) knows that host (`sinfo` fails the same way; your cluster's admins can tell)."
    ]
    assert done.stdout == ""
    assert not (tmp_path / "slurmrun_jobs").exists()
    assert took < 5  # scontrol ping tries ten times, a second apart

    # `status` asks squeue and sacct, which would retry as long each: its folder answers.
    files = JobFolder.of(tmp_path / "slurmrun_jobs", "14")
    files.path.mkdir(parents=True)
    write_sealed(files.submitted_pickle, b"", key=job_key(create=True), nonce=new_nonce())
    files.cache_state("CANCELLED")
    start = time.monotonic()
    status = subprocess.run(
        [sys.executable, "-m", "slurmrun", "status", "14"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_CONF": str(conf)},
        check=False,
    )
    assert status.stdout.startswith("14 CANCELLED\nfailed: JobFailedError: job 14 ended")
    assert time.monotonic() - start < 5


def test_what_scontrol_says_again_at_each_attempt_is_said_once():
    from slurmrun.slurm.cluster import _said

    said = "".join(
        "scontrol: error: get_addr_info: getaddrinfo() failed: Name or service not known: No "
        f"such file or directory, attempt number {n}\n"
        for n in range(-4, 6)
    )
    assert _said(said, b"*****\n** RESTORE SLURMCTLD DAEMON TO SERVICE **\n") == (
        "scontrol: error: get_addr_info: getaddrinfo() failed: Name or service not known: No "
        "such file or directory"
    )
