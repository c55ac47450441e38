"""`SubmittedLaunch` and `SubmittedMap`: handles on a submitted job, made of its id and folder.

The handle holds no connection and no submitit object: it asks SLURM about its job id
(`query_states`) and reads the job's folder, so it pickles, and `attach` rebuilds it in
another process from the job id alone.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from slurmrun.batch.folder import JobFolder, base_folder
from slurmrun.batch.map_done import kept_count
from slurmrun.batch.seal import Sealed, job_key, read_sealed
from slurmrun.logs import tail_file
from slurmrun.result import LaunchResult
from slurmrun.slurm.queue import FINAL_STATES, UNKNOWN, query_states

__all__ = [
    "JobFailedError",
    "SubmittedJob",
    "SubmittedLaunch",
    "SubmittedMap",
    "attach",
    "handle_of",
]

T = TypeVar("T")
# A finished job's result file may show up a moment after SLURM says COMPLETED (NFS).
RESULT_GRACE = 10.0
# What ``slurmrun.json`` says a job runs (its "kind"): a launch unless it says a map.
MAP_KIND = "map"


class JobFailedError(RuntimeError):
    """The job ended without a launch result (cancelled, timed out, its node failed...).

    Attributes:
        job_id: the SLURM job id.
        state: the state it ended in.
        stderr_tail: the end of the job's own error output.
    """

    def __init__(self, message: str, *, job_id: str, state: str, stderr_tail: str = "") -> None:
        super().__init__(message)
        self.job_id = job_id
        self.state = state
        self.stderr_tail = stderr_tail


@dataclass(frozen=True)
class SubmittedJob:
    """A submitted SLURM batch job: what `SubmittedLaunch` and `SubmittedMap` share.

    Attributes:
        job_id: the SLURM job id.
        folder: the folder the job was submitted into (its files are in ``folder/job_id``).
    """

    job_id: str
    folder: Path

    @property
    def files(self) -> JobFolder:
        """The job's files."""
        return JobFolder(self.folder / self.job_id, self.job_id)

    @property
    def state(self) -> str:
        """SLURM's state of the job now (one query of SLURM).

        ``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``,
        ``PREEMPTED``...; ``UNKNOWN`` when neither SLURM nor the job's folder knows.
        """
        return states_of([self])[self.job_id]

    def done(self) -> bool:
        """Whether the job has ended (in any final state)."""
        return self.state in FINAL_STATES

    def wait(self, timeout: float | None = None, poll: float = 1.0) -> str:
        """Waits until the job ends; returns its final state (e.g. ``"COMPLETED"``).

        Args:
            timeout: seconds to wait at most (None: as long as the job takes).
            poll: seconds between two queries of SLURM.

        Raises:
            TimeoutError: the job has not ended within `timeout` (it keeps running).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.state
            if state in FINAL_STATES:
                return state
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"job {self.job_id} is still {state} after {timeout} s (it keeps running; "
                        "cancel() stops it)"
                    )
                time.sleep(min(poll, left))
            else:
                time.sleep(poll)

    def _outcome(self, timeout: float | None, poll: float) -> Any:
        """Waits for the job; the value it returned, or raises what it raised."""
        state = self.wait(timeout, poll)
        self.files.check()
        outcome = self._read_result(state)
        return outcome.unwrap()

    def cancel(self) -> None:
        """Cancels the job (``scancel``); returns at once (`wait` sees it ``CANCELLED``)."""
        subprocess.run(
            ["scancel", self.job_id],
            check=True,
            capture_output=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )

    def logs(self, rank: int = 0) -> str:
        """The output of worker `rank` so far (also while the job runs); ``""`` before any.

        Raises:
            slurmrun.batch.JobFolderError: the job's folder is not yours alone.
        """
        self.files.check()
        try:
            return self.files.rank_log(rank).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _read_result(self, state: str) -> Any:
        """The job's ``(status, value)``, read once its seal is checked (`slurmrun.batch.seal`).

        Raises:
            JobFailedError: there is no result of this submission (a result an earlier job
                of this id left is not this job's).
            JobFolderTamperedError: the call or the result was not sealed by the user's key.
            JobKeyError: the user's job key cannot be used.
        """
        key = job_key(create=False)
        nonce = read_sealed(self.files.submitted_pickle, key=key).nonce
        path = self.files.result_pickle
        deadline = time.monotonic() + (RESULT_GRACE if state == "COMPLETED" else 0.0)
        while True:
            try:
                sealed: Sealed | None = read_sealed(path, key=key)
            except FileNotFoundError:
                sealed = None
            if (sealed is not None and sealed.nonce == nonce) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if sealed is None or sealed.nonce != nonce:
            tail = tail_file(str(self.files.stderr))
            raise JobFailedError(
                f"job {self.job_id} ended {state} without a result; the end of its output "
                f"({self.files.stderr}):\n{tail}",
                job_id=self.job_id,
                state=state,
                stderr_tail=tail,
            )
        status, value = pickle.loads(sealed.payload)  # noqa: S301 - sealed by this submission
        if status != "success":  # submitit itself failed (e.g. slurmrun not importable)
            raise JobFailedError(
                f"job {self.job_id} failed before the launch started:\n{value}",
                job_id=self.job_id,
                state=state,
                stderr_tail=str(value),
            )
        return value


@dataclass(frozen=True)
class SubmittedLaunch(SubmittedJob, Generic[T]):
    """A launch submitted as a SLURM batch job (`slurmrun.submit`, `slurmrun.attach`).

    Attributes:
        job_id: the SLURM job id.
        folder: the folder the job was submitted into (its files are in ``folder/job_id``).
    """

    def result(self, timeout: float | None = None, poll: float = 1.0) -> LaunchResult[T]:
        """Waits for the job and returns the launch's result, or raises what the launch raised.

        A worker's exception is raised with its own type and the worker's traceback as
        ``__cause__``, as `slurmrun.launch` raises it; so are `WorkerFailedError` and
        `AgentFailedError`.

        Args:
            timeout: seconds to wait at most (None: as long as the job takes).
            poll: seconds between two queries of SLURM.

        Raises:
            TimeoutError: the job has not ended within `timeout` (it keeps running).
            JobFailedError: the job ended without a result (cancelled, timed out...).
            slurmrun.batch.JobFolderError: the job's folder is not yours alone (nothing in it
                is read).
            slurmrun.errors.JobFolderTamperedError: the job's call or result in its folder was
                not written by your slurmrun (its seal failed): nothing of it was unpickled.
            slurmrun.errors.JobKeyError: your job key (``~/.config/slurmrun/job-key``) is
                missing, or open to others.
            Exception: what the launch raised.
        """
        value: LaunchResult[T] = self._outcome(timeout, poll)
        return value


@dataclass(frozen=True)
class SubmittedMap(SubmittedJob, Generic[T]):
    """A `Launcher.map` submitted as a SLURM batch job (`slurmrun.submit_map`).

    Attributes:
        job_id: the SLURM job id.
        folder: the folder the job was submitted into (its files are in ``folder/job_id``).
    """

    def result(self, timeout: float | None = None, poll: float = 1.0) -> list[T]:
        """Waits for the job and returns each item's value in the items' order.

        Args:
            timeout: seconds to wait at most (None: as long as the job takes).
            poll: seconds between two queries of SLURM.

        Raises:
            slurmrun.MapFailedError: items failed; its ``results`` holds every item's value
                or exception (each with its worker's traceback as ``__cause__``).
            TimeoutError, JobFailedError, slurmrun.batch.JobFolderError,
                slurmrun.errors.JobFolderTamperedError, slurmrun.errors.JobKeyError: as
                `SubmittedLaunch.result` raises them.
            Exception: what the map raised as a whole (e.g. every node lost).
        """
        values: list[T] = self._outcome(timeout, poll)
        return values

    def progress(self) -> tuple[int, int]:
        """``(finished, items)``: the items whose value the job kept so far, and how many it maps.

        Read from the job's folder (files counted, nothing unpickled), also while it runs; a
        requeued job's count includes what its earlier runs finished.
        """
        self.files.check()
        items = self.files.meta().get("items")
        count = kept_count(self.files.path)
        return count, items if isinstance(items, int) else count


def states_of(handles: Sequence[SubmittedJob]) -> dict[str, str]:
    """The states of several jobs, from one query of SLURM for all of them."""
    found = query_states(h.job_id for h in handles)
    states: dict[str, str] = {}
    for handle in handles:
        files = handle.files
        state = found.get(handle.job_id)
        if state is None:  # SLURM has forgotten it: what the folder says
            state = files.cached_state() or (
                "COMPLETED" if files.result_pickle.exists() else UNKNOWN
            )
        elif state in FINAL_STATES and files.cached_state() != state:
            files.cache_state(state)
        states[handle.job_id] = state
    return states


def attach(
    job_id: str | int, folder: str | os.PathLike[str] = "slurmrun_jobs"
) -> SubmittedLaunch[Any] | SubmittedMap[Any]:
    """The handle of a job submitted into `folder`, from any process (e.g. another terminal).

    A job of `slurmrun.submit_map` gets a `SubmittedMap`, any other a `SubmittedLaunch`.

    Args:
        job_id: the SLURM job id that `submit` gave.
        folder: the folder it was submitted into.

    Raises:
        FileNotFoundError: no job `job_id` was submitted into `folder`.
        slurmrun.batch.JobFolderError: `folder` or the job's folder is not yours alone:
            another user owns it, or others may write to it or replace it (nothing in it is
            read; the message says what to do).
    """
    job = SubmittedJob(str(job_id), base_folder(folder))
    job.files.check()
    if not job.files.submitted_pickle.exists():
        raise FileNotFoundError(
            f"no job {job_id} was submitted into {job.folder} "
            f"(there is no {job.files.submitted_pickle})"
        )
    return handle_of(job.job_id, job.folder, job.files.meta())


def handle_of(
    job_id: str, folder: Path, meta: dict[str, Any]
) -> SubmittedLaunch[Any] | SubmittedMap[Any]:
    """The handle of job `job_id` of `folder`, of the kind its recorded `meta` says."""
    if meta.get("kind") == MAP_KIND:
        return SubmittedMap(job_id, folder)
    return SubmittedLaunch(job_id, folder)
