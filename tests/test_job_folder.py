"""A job folder is the submitter's alone: others' folders are refused, slurmrun's files private.

No cluster is needed: every refusal comes before anything is submitted (a dry run checks as
a submission does), and a second user (uid 65534, nobody) runs slurmrun's commands with a
copy of its dependencies that they can read. The job's own files are checked on the cluster
(tests/slurm/test_job_folder_slurm.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurmrun
from slurmrun.batch import JobFolderError
from slurmrun.batch.folder import JobFolder
from slurmrun.batch.job_resources import JobResources
from slurmrun.batch.submit import JobSpec
from slurmrun.log_dirs import resolve_log_dir

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
# What `slurmrun submit` and `slurmrun SCRIPT.py` import (besides the standard library) up to
# the errors tested here: torch is not among them.
DEPENDENCIES = (
    "cloudpickle",
    "docstring_parser",
    "hostlist",
    "submitit",
    "typeguard",
    "typing_extensions",
    "tyro",
)
SYSTEM_PYTHON = Path("/usr/bin/python3")  # ours may lie where nobody cannot reach (/root)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    """Restores the test process's umask after a test changes it."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory as a shared project directory is: every user may create in it (1777)."""
    path = Path(tempfile.mkdtemp(prefix="slurmrun-test-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def _as_nobody(argv: list[str], cwd: Path) -> None:
    subprocess.run(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--", *argv],
        cwd=cwd,
        check=True,
        timeout=30,
    )


def _refused_for_nobody(error: JobFolderError | str) -> None:
    text = str(error)
    assert "belongs to uid 65534 (nobody), not to you" in text, text
    assert "folder= in Python, --folder on the command line" in text, text


def test_another_users_folder_is_refused_before_submitting_and_never_read(shared):
    folder = shared / "slurmrun_jobs"
    _as_nobody(["mkdir", "-m", "0755", str(folder)], shared)  # theirs, made first
    with pytest.raises(JobFolderError) as refused:
        slurmrun.submit(print, folder=folder, dry_run=True)
    _refused_for_nobody(refused.value)
    assert refused.value.owner == NOBODY
    assert isinstance(refused.value, PermissionError)
    with pytest.raises(JobFolderError):
        slurmrun.submit_array(print, [(1,), (2,)], folder=folder, dry_run=True)
    # A job folder in it that looks like one of ours: never attached to, nothing read.
    _as_nobody(["mkdir", str(folder / "7")], shared)
    _as_nobody(["touch", str(folder / "7" / "7_submitted.pkl")], shared)
    with pytest.raises(JobFolderError) as refused:
        slurmrun.attach("7", folder=folder)
    _refused_for_nobody(refused.value)
    with pytest.raises(JobFolderError):
        slurmrun.jobs(folder=folder)
    handle: slurmrun.SubmittedLaunch[object] = slurmrun.SubmittedLaunch("7", folder)
    with pytest.raises(JobFolderError):
        handle.logs()


def test_the_commands_refuse_another_users_folder_in_a_sentence(shared, capsys):
    from slurmrun.cli.main import main

    folder = shared / "slurmrun_jobs"
    _as_nobody(["mkdir", str(folder)], shared)
    _as_nobody(["mkdir", str(folder / "7")], shared)
    _as_nobody(["touch", str(folder / "7" / "7_submitted.pkl")], shared)
    script = shared / "x.py"
    script.write_text("print('hi')\n")
    for argv in (
        ["submit", "--dry-run", "--folder", str(folder), str(script)],
        ["status", "7", "--folder", str(folder)],
        ["logs", "7", "--folder", str(folder)],
        ["jobs", "--folder", str(folder)],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"slurmrun {argv[0]}: {folder} belongs to uid 65534"), err
        _refused_for_nobody(err)


def _other_writable(d: Path) -> Path:
    (d / "jobs").mkdir(mode=0o777)
    (d / "jobs").chmod(0o777)
    return d / "jobs"


def _group_writable(d: Path) -> Path:
    (d / "jobs").mkdir()
    (d / "jobs").chmod(0o775)
    os.chown(d / "jobs", -1, NOBODY)  # a group of others (nogroup), not the user's own
    return d / "jobs"


def _in_a_writable_parent(d: Path) -> Path:
    d.chmod(0o777)  # others may rename jobs/ away and make their own
    (d / "jobs").mkdir()
    return d / "jobs"


def _in_a_group_writable_parent(d: Path) -> Path:
    d.chmod(0o775)
    os.chown(d, -1, NOBODY)
    return d / "new" / "jobs"  # not made yet: whoever makes it first owns it


def _below_anothers_entry_of_a_sticky_parent(d: Path) -> Path:
    d.chmod(0o1777)
    (d / "theirs" / "jobs").mkdir(parents=True)
    os.chown(d / "theirs", NOBODY, -1)  # they may replace what is in it
    return d / "theirs" / "jobs"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_other_writable, "jobs has mode 777: other users can write to it"),
        (_group_writable, "jobs has mode 775: group nogroup can write to it"),
        (_in_a_writable_parent, "project has mode 777: other users can write to it, so they can "
         "replace .*/project/jobs with a directory of their own"),
        (_in_a_group_writable_parent, "project has mode 775: group nogroup can write to it"),
        (_below_anothers_entry_of_a_sticky_parent, "theirs belongs to uid 65534 \\(nobody\\), in "
         ".*/project \\(mode 1777\\), so they can replace what is in it"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)  # fmt: skip
def test_a_folder_others_can_write_or_replace_is_refused(tmp_path, make, says):
    parent = tmp_path / "project"
    parent.mkdir()
    folder = make(parent)
    with pytest.raises(JobFolderError, match=says) as refused:
        slurmrun.submit(print, folder=folder, dry_run=True)
    assert "slurmrun does not use it as a job folder" in str(refused.value)
    (folder / "3").mkdir(parents=True, exist_ok=True)
    (folder / "3" / "3_submitted.pkl").touch()
    with pytest.raises(JobFolderError, match=says):
        slurmrun.attach("3", folder=folder)


def test_folders_only_the_user_can_change_are_used(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot replace what is ours in it
    (sticky / "jobs").mkdir()
    (tmp_path / "readable").mkdir(mode=0o755)  # others may read (an older slurmrun's folder)
    (tmp_path / "own-group").mkdir()
    (tmp_path / "own-group").chmod(0o770)  # the user's private group (root:root here)
    for folder in (sticky / "jobs", sticky / "new", tmp_path / "readable", tmp_path / "own-group"):
        assert slurmrun.submit(print, folder=folder, dry_run=True).folder == folder


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_the_folder_and_slurmruns_own_files_are_private_whatever_the_umask(
    tmp_path, umask, mask, monkeypatch
):
    os.umask(mask)
    monkeypatch.setenv("SLURM_UMASK", f"{mask:04o}")  # a user's own, which sbatch would take
    spec = JobSpec.make(None, print, (), None, folder=tmp_path / "a" / "jobs", job=JobResources())
    with spec.submitting():
        assert os.umask(0o077) == 0o077  # (reading it sets it: what it was is put back)
        assert os.environ["SLURM_UMASK"] == "0077"  # for sbatch: the job's output files
        (spec.base / "7").mkdir()
        (spec.base / "7" / "7_submitted.pkl").touch()  # as submitit writes
    assert os.umask(mask) == mask  # put back after submitting
    assert os.environ["SLURM_UMASK"] == f"{mask:04o}"
    assert _mode(tmp_path / "a") == 0o700
    assert _mode(spec.base) == 0o700
    assert _mode(spec.base / "7") == 0o700
    assert _mode(spec.base / "7" / "7_submitted.pkl") == 0o600
    files = JobFolder.of(spec.base, "7")
    files.write_meta({"job_id": "7"})
    files.cache_state("COMPLETED")
    assert _mode(spec.base / "7" / "slurmrun.json") == 0o600
    assert _mode(spec.base / "7" / "state") == 0o600
    assert files.meta() == {"job_id": "7"}
    assert files.cached_state() == "COMPLETED"
    assert spec.umask == mask  # what the job's workers will run with


# --------------------------------------------------------------------------- a second user
@pytest.fixture(scope="module")
def nobody_site() -> Iterator[Path]:
    """A copy of slurmrun's dependencies that user nobody can import (ours lie in /root)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"no {SYSTEM_PYTHON} for user nobody to run")
    site = Path(tempfile.mkdtemp(prefix="slurmrun-test-site-", dir="/tmp"))
    site.chmod(0o755)
    for name in DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, site / name)
        else:
            shutil.copy(origin, site)
    subprocess.run(["chmod", "-R", "a+rX", str(site)], check=True, timeout=30)
    yield site
    shutil.rmtree(site)


def _nobody_runs(site: Path, cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--",
            str(SYSTEM_PYTHON), "-m", "slurmrun", *argv,
        ],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": f"{site}:{REPO}", "HOME": str(cwd), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip


def test_a_second_user_in_the_same_directory_is_told_whose_folders_they_are(
    shared, nobody_site, monkeypatch
):
    monkeypatch.chdir(shared)
    (shared / "x.py").write_text("print('hi')\n")
    (shared / "slurmrun_jobs").mkdir(mode=0o700)  # the first user's (root's) folders
    resolve_log_dir({})  # ./slurmrun_logs, as a local launch makes it
    submitted = _nobody_runs(nobody_site, shared, "submit", "x.py")
    assert submitted.returncode == 1, submitted.stderr
    assert "Traceback" not in submitted.stderr
    assert "belongs to uid 0 (root), not to you (uid 65534 (nobody))" in submitted.stderr
    assert "--folder on the command line" in submitted.stderr
    launched = _nobody_runs(nobody_site, shared, "x.py")
    assert launched.returncode == 1, launched.stderr
    assert "Traceback" not in launched.stderr
    assert "slurmrun_logs, the default): " in launched.stderr
    assert "belongs to uid 0 (root) (mode 755), not to you (uid 65534 (nobody))" in launched.stderr
    assert "Set SLURMRUN_LOG_DIR to a folder of your own" in launched.stderr
