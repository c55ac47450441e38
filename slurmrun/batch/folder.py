"""Where a submitted job keeps its files: ``<folder>/<job id>/``.

That directory holds submitit's files (the batch script, the pickled call, the job's
output ``<id>_0_log.out``/``.err``, the result ``<id>_0_result.pkl``), ``slurmrun.json``
(what was submitted, written by the submitter), ``rank<N>.log`` (each worker's output,
written while the job runs) and ``state`` (the last final state seen, for when SLURM has
forgotten the job).

The folder is the submitter's alone (`check_folder`): what is in it is run and unpickled as
them, so a folder that someone else owns, may write to or could replace is never used; and
everything in it is created 0700/0600 (`slurmrun.private.private_umask`, on the nodes too).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmrun.private import Problem, problem, replaceable

__all__ = ["JobFolder", "JobFolderError", "base_folder", "check_folder"]

_JOB_ID = re.compile(r"^\d+(_\d+)?$")
META = "slurmrun.json"


def base_folder(folder: str | os.PathLike[str]) -> Path:
    """The folder jobs are submitted into: `folder`, less a trailing ``%j`` (submitit's style).

    Raises:
        ValueError: ``%j`` elsewhere than as the last part.
    """
    path = Path(os.fspath(folder)).expanduser()
    if path.name == "%j":
        path = path.parent
    if "%" in str(path):
        raise ValueError(
            f"folder {os.fspath(folder)!r}: pass the folder to submit jobs into; each job gets "
            "its own subfolder named by its job id (a '%j' may only be the last part)"
        )
    return path.absolute()


class JobFolderError(PermissionError):
    """A job folder that is not the user's alone: slurmrun neither submits into it nor reads it.

    Attributes:
        path: the folder refused.
        owner: the uid that owns it, or the directory above it that others may write to.
    """

    def __init__(self, message: str, *, path: Path, owner: int) -> None:
        super().__init__(message)
        self.path = path
        self.owner = owner

    def __str__(self) -> str:  # not OSError's "[Errno None] ..."
        return str(self.args[0])


def check_folder(path: Path) -> None:
    """Refuses a job folder that others own, may write to, or could replace.

    A missing folder is refused where others could make it first (`slurmrun.private`).

    Raises:
        JobFolderError: the message says whose it is, and what to do.
    """
    why = problem(path) or replaceable(path)
    if why is None:
        return
    raise JobFolderError(_refusal(why), path=path, owner=why.owner)


def _refusal(why: Problem) -> str:
    if why.kind == "other":  # not a directory, unreadable: nothing of anyone else's
        reason = "slurmrun cannot use it as a job folder"
    else:
        who = "its owner" if why.kind == "owner" else "others"
        reason = "slurmrun does not use it as a job folder"
        reason += f" ({who} could make your jobs run their code)"
    fix = "`chmod 700` it, or submit" if why.kind == "mode" else "Submit"
    return (
        f"{why.text}: {reason}. {fix} into a folder of your own: folder= in Python, --folder on "
        "the command line (e.g. ~/slurmrun_jobs; the compute nodes must share it)"
    )


def _write_private(path: Path, text: str) -> None:
    """Writes `path` (mode 0600, whatever the umask) through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # (made 0600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class JobFolder:
    """The files of one job.

    Attributes:
        path: ``<folder>/<job id>``.
        job_id: the SLURM job id.
    """

    path: Path
    job_id: str

    @classmethod
    def of(cls, folder: str | os.PathLike[str], job_id: str) -> JobFolder:
        """The folder of `job_id` among the jobs submitted into `folder`."""
        return cls(base_folder(folder) / job_id, job_id)

    @property
    def result_pickle(self) -> Path:
        """What submitit wrote for task 0 (the only task: the launch runs in the batch step)."""
        return self.path / f"{self.job_id}_0_result.pkl"

    @property
    def stdout(self) -> Path:
        """The job's own output (the launcher's side)."""
        return self.path / f"{self.job_id}_0_log.out"

    @property
    def stderr(self) -> Path:
        """The job's own error output (the launcher's side)."""
        return self.path / f"{self.job_id}_0_log.err"

    @property
    def submitted_pickle(self) -> Path:
        """The call as submitit pickled it; its presence marks a job submitted into the folder."""
        return self.path / f"{self.job_id}_submitted.pkl"

    def check(self) -> None:
        """Refuses a folder (this job's, or the one above) that is not the user's alone.

        Raises:
            JobFolderError: see `check_folder`.
        """
        check_folder(self.path.parent)
        check_folder(self.path)

    def rank_log(self, rank: int) -> Path:
        """The output of worker `rank` (all its attempts, appended)."""
        return self.path / f"rank{rank}.log"

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Records what was submitted (read by `slurmrun.batch`)."""
        _write_private(self.path / META, json.dumps(meta, indent=1, sort_keys=True))

    def meta(self) -> dict[str, Any]:
        """What `write_meta` recorded; ``{}`` if nothing (yet)."""
        try:
            data = json.loads((self.path / META).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def cached_state(self) -> str | None:
        """The final state last seen for this job, if any."""
        try:
            return (self.path / "state").read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def cache_state(self, state: str) -> None:
        """Remembers a final state, for when neither squeue nor sacct knows the job."""
        with contextlib.suppress(OSError):
            _write_private(self.path / "state", state + "\n")


def submitted_jobs(folder: str | os.PathLike[str]) -> list[JobFolder]:
    """The jobs submitted into `folder`, oldest job id first."""
    base = base_folder(folder)
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    found = [
        JobFolder(entry, entry.name)
        for entry in entries
        if _JOB_ID.match(entry.name) and (entry / f"{entry.name}_submitted.pkl").exists()
    ]

    def key(job: JobFolder) -> tuple[int, int]:
        first, _, task = job.job_id.partition("_")
        return int(first), int(task or -1)

    return sorted(found, key=key)
