"""A submitted job's folder on the cluster: private whatever the umask; another user's refused.

What the job writes on the nodes (SLURM's output files, submitit's result, the rank logs, the
launch's log folder written by the agents of every node) is checked after a real job, and
so is what the workers write outside it: the submitter's umask still holds there.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurmrun
from slurmrun.batch import JobFolderError

NOBODY = 65534
JOB_NAME = "slurmrun-test"  # the conftest's: its clean-state check knows it
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
SUBMIT = [sys.executable, "-m", "slurmrun", "submit"]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A shared project directory: every user may create in it (1777)."""
    path = Path(tempfile.mkdtemp(prefix="slurmrun-test-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def _queued(name: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%A"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["umask022", "umask002"])
def test_a_jobs_folder_and_files_are_private_whatever_the_umask(
    slurm_cluster, tmp_path, monkeypatch, mask
):
    def write(out: str) -> int:
        import os

        rank = int(os.environ["RANK"])
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write("mine\n")
        print("rank", rank, "wrote its file")
        return rank, os.environ["SLURM_UMASK"]

    monkeypatch.chdir(tmp_path)  # the job's working directory: this session's
    monkeypatch.setenv("SLURM_UMASK", f"{mask:04o}")  # a user's own, which sbatch would take
    monkeypatch.delenv("SLURMRUN_LOG_DIR")  # the job's logs/ then, as a user's
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    old = os.umask(mask)
    try:
        job = slurmrun.submit(
            write,
            (str(out),),
            nodes=2,
            folder=tmp_path / "jobs",
            time_min=3,
            slurm_parameters={"job_name": JOB_NAME},
        )
    finally:
        os.umask(old)
    try:
        values = job.result(timeout=120, poll=0.5).values()
    except BaseException:
        job.cancel()
        raise
    assert values == [(0, f"{mask:04o}"), (1, f"{mask:04o}")]
    assert job.state == "COMPLETED"  # (caches the state in the folder)
    folder = tmp_path / "jobs"
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*")}
    j = job.job_id
    wrote = {f"{j}/{j}_0_log.out", f"{j}/{j}_0_log.err", f"{j}/{j}_0_result.pkl"}
    wrote |= {f"{j}/{j}_submitted.pkl", f"{j}/slurmrun.json", f"{j}/state", f"{j}/rank1.log"}
    assert wrote <= names, sorted(names)
    agents = [n for n in names if n.startswith(f"{j}/logs/") and "node2" in n]
    assert agents, "\n".join(sorted(names))  # node2's agent wrote its own files into the folder
    modes = {}
    for path in [folder, *folder.rglob("*")]:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):  # (a link's own mode is always 777; its target counts)
            continue
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) != want:
            modes[str(path.relative_to(tmp_path))] = oct(stat.S_IMODE(st.st_mode))
    assert modes == {}, f"not private (umask {mask:03o}): {modes}"
    # The workers keep the submitter's umask for what they write elsewhere.
    for rank in (0, 1):
        assert stat.S_IMODE(os.stat(out / f"rank{rank}").st_mode) == 0o666 & ~mask


@pytest.mark.quick
def test_another_users_folder_is_refused_before_anything_is_submitted(
    slurm_cluster, tmp_path, monkeypatch, shared
):
    monkeypatch.chdir(tmp_path)
    name = f"slurmrun-folder-{os.getpid()}"
    folder = shared / "slurmrun_jobs"
    subprocess.run(  # uid 65534 made it first, in the shared directory
        [*AS_NOBODY, "mkdir", "-m", "755", str(folder)],
        check=True,
        timeout=30,
    )
    try:
        with pytest.raises(JobFolderError) as refused:
            slurmrun.submit(print, folder=folder, time_min=1, slurm_parameters={"job_name": name})
        script = tmp_path / "x.py"
        script.write_text("print('hi')\n")
        cli = subprocess.run(
            [*SUBMIT, "--folder", str(folder), "--job-name", name, "--time", "1", str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:  # today's main submitted into it
        subprocess.run(["scancel", "-n", name], timeout=30, check=False)
    assert f"{folder} belongs to uid 65534 (nobody), not to you" in str(refused.value)
    assert "--folder on the command line" in str(refused.value)
    assert cli.returncode == 1, cli.stderr
    assert cli.stderr.startswith(f"slurmrun submit: {folder} belongs to uid 65534 (nobody)")
    assert "Traceback" not in cli.stderr
    assert _queued(name) == []  # nothing was submitted
    assert list(folder.iterdir()) == []  # nothing was written into theirs
