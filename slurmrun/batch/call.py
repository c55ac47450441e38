"""What a submitted job runs: the submitter's call, unpickled where the submitter's imports work.

The job's call file holds a pickled `JobCall` (sealed: `slurmrun.batch.sealed_job`), whose
class lives here (importable in the job wherever slurmrun is installed). The user's call
travels inside it as bytes, unpickled only after the job has restored the submitter's
``sys.path`` and working directory: a function from the submitter's project folder then
imports in the job as it did on the login node.

The job returns an `Outcome` rather than raising, so that submitit records a result either
way and the handle re-raises the launch's own exception (submitit would wrap it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slurmrun.batch.folder import JobFolder
from slurmrun.batch.map_done import DoneItems
from slurmrun.batch.requeue import (
    REQUEUE_COUNT_VAR,
    REQUEUE_FLAG_VAR,
    Requeue,
    RequeueLimitError,
    RequeueWatch,
    requeue_this_job,
)
from slurmrun.batch.seal import job_key, read_sealed
from slurmrun.errors import MapFailedError, RemoteTraceback
from slurmrun.handlers import _FileHandler, stream_handler
from slurmrun.launcher import Launcher
from slurmrun.launcher.mapping import failure_message
from slurmrun.log_dirs import LOG_DIR_VAR
from slurmrun.pickling import dumps_inband, loads
from slurmrun.private import PRIVATE_UMASK, SLURM_UMASK_VAR
from slurmrun.slurm.job import own_job_id
from slurmrun.slurm.job_end import preemption
from slurmrun.variables import IGNORED_SIGNALS_VAR, WORKER_UMASK_VAR

__all__ = ["JobCall", "MapJob", "Outcome"]

# In the job's folder once a run ended the job at its requeue cap (`RequeueLimitError`'s text).
CAPPED_FILE = "requeue.capped"


@dataclass
class Outcome:
    """What the job returns: the launch's result, or what it raised.

    Attributes:
        value: pickled `LaunchResult` (bytes), or None after an error.
        error: the pickled exception, or None.
        error_type: the exception's type name (for when it cannot be unpickled here).
        error_message: its ``str()``.
        traceback: the remote traceback: the worker's, else the job's own.
    """

    value: bytes | None = None
    error: bytes | None = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""

    @classmethod
    def of_error(cls, exc: BaseException) -> Outcome:
        """The outcome of a launch that raised `exc` (with a `RemoteTraceback` cause or not)."""
        cause = exc.__cause__
        text = cause.text if isinstance(cause, RemoteTraceback) else traceback.format_exc()
        pickled: bytes | None
        try:
            pickled = dumps_inband(exc)
        except Exception:
            pickled = None
        return cls(
            error=pickled,
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            error_message=str(exc),
            traceback=text,
        )

    def unwrap(self) -> Any:
        """The `LaunchResult`, or raises the exception with the remote traceback as cause."""
        if self.error_type == "":
            return loads(self.value or b"")
        exc: object = None
        if self.error is not None:
            try:
                exc = loads(self.error)
            except Exception:  # e.g. its __init__ takes other arguments than its args
                exc = None
        if not isinstance(exc, BaseException):
            exc = RuntimeError(
                f"the submitted launch raised {self.error_type}: {self.error_message} (it could "
                "not be rebuilt here)"
            )
        raise exc from RemoteTraceback(self.traceback)


@dataclass(frozen=True)
class MapJob:
    """A submitted map: the job calls `Launcher.map` over its items with these options."""

    workers_per_item: int = 1
    retries: int = 0
    item_timeout: float | None = None

    def run(self, launcher: Launcher, func: Any, items: list[Any], done: DoneItems) -> list[Any]:
        """The map, in the job; its values in the items' order.

        Items that an earlier run of this job finished (it was requeued) are not run again;
        each value is kept in `done` as it comes.

        Raises:
            MapFailedError: items failed (``results`` holds every item's outcome).
        """
        results: dict[int, Any] = done.read(len(items))
        todo = [index for index in range(len(items)) if index not in results]
        if len(results) > 0:
            print(
                f"slurmrun: {len(results)} of the map's {len(items)} items were finished by an "
                f"earlier run of this job: {len(todo)} left",
                file=sys.stderr,
                flush=True,
            )
        options = {"workers_per_item": self.workers_per_item, "retries": self.retries}
        try:
            for j, value in launcher.imap(
                func, [items[i] for i in todo], **options, item_timeout=self.item_timeout
            ):
                results[todo[j]] = value
                done.write(todo[j], value)
        except MapFailedError as e:
            for j, outcome in enumerate(e.results):
                results.setdefault(todo[j], outcome)
            merged = [results[i] for i in range(len(items))]
            failed = sorted(todo[j] for j in e.failed)
            message = failure_message(merged, failed)
            if e.ended:
                message = f"{e.ended}\n{message}"
            raise MapFailedError(
                message, results=merged, failed=failed, ended=e.ended
            ) from e.__cause__
        return [results[i] for i in range(len(items))]


@dataclass
class JobCall:
    """The call a submitted job runs (pickled by submitit).

    Attributes:
        payload: ``(launcher, func, args, kwargs, workers_per_node, map_job)``, pickled by
            cloudpickle; with a `MapJob`, ``args`` is ``(items,)`` and the job maps them.
        sys_path: the submitter's ``sys.path`` (``""`` resolved to its working directory).
        cwd: the submitter's working directory.
        folder: the folder the job was submitted into; its files are in ``<folder>/<job id>``.
        existing: the entries of `sys_path` that existed on the submitter's machine.
        requeue: how the job is requeued when SLURM signals it; None: never.
        umask: the submitter's umask, which the workers take; None: the job's.
    """

    payload: bytes
    sys_path: list[str]
    cwd: str
    folder: str
    existing: list[str] = field(default_factory=list)
    requeue: Requeue | None = None
    umask: int | None = None

    def __call__(self) -> Outcome:
        """Runs the launch in the job; returns its `Outcome` (never raises for the launch)."""
        # What the job writes into its folder (logs, results, requeue flags) is the
        # submitter's alone: here, in the agents' steps (srun passes SLURM_UMASK on) and
        # after this returns (submitit's result). The workers take the submitter's umask.
        os.umask(PRIVATE_UMASK)
        os.environ[SLURM_UMASK_VAR] = f"{PRIVATE_UMASK:04o}"
        os.environ[WORKER_UMASK_VAR] = "" if self.umask is None else f"{self.umask:04o}"
        # SLURM signals USR2 ahead of the time limit (submitit's `--signal=USR2@90`): no part
        # of the job may die of it, and workers get it only if their function asks for it.
        policy = self.requeue
        name = policy.signal_name if policy is not None else "SIGUSR2"
        signal.signal(signal.Signals[name], signal.SIG_IGN)
        os.environ[IGNORED_SIGNALS_VAR] = name
        job_id = own_job_id() or ""  # `<array id>_<task id>` for an array task, as %j/%A_%a
        job_dir = os.path.join(self.folder, job_id)
        count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        os.environ[REQUEUE_COUNT_VAR] = str(count)
        os.environ[REQUEUE_FLAG_VAR] = os.path.join(job_dir, f"requeue.{count}")
        watch = None if policy is None else RequeueWatch(policy, Path(os.environ[REQUEUE_FLAG_VAR]))
        outcome: Outcome | None = None
        try:
            capped = _capped_before(job_dir, job_id) if policy is not None else None
            if capped is not None:
                return capped
            self._restore()
            launcher, func, args, kwargs, workers, mapped = self._unpickle()
            launcher = _job_launcher(launcher, workers, job_dir)
            os.environ.setdefault(LOG_DIR_VAR, os.path.join(job_dir, "logs"))
            with watch or contextlib.nullcontext():
                if mapped is None:
                    result: Any = launcher.run(func, args, kwargs)
                else:
                    result = mapped.run(launcher, func, args[0], _done_items(job_dir, job_id))
                outcome = Outcome(value=dumps_inband(result))
        except Exception as exc:
            outcome = Outcome.of_error(exc)
        if watch is None or not (watch.requested or _preempted(outcome, job_id)):
            assert outcome is not None  # noqa: S101 - only an abandoned launch leaves it unset
            return outcome
        # Signalled or preempted: this run's outcome is not the job's (it was cut short).
        if count >= watch.policy.max_requeues:
            why = f"signalled ({name})" if watch.requested else "preempted"
            error = RequeueLimitError(
                f"job {job_id} was {why} after {count} requeues "
                f"(max_requeues={watch.policy.max_requeues}): not requeued again"
            )
            # SLURM 24.05+ requeues a preempted job itself when its batch script ends in the
            # grace (22.05 ends it COMPLETED; `requeued_when_batch_ends`): the run it starts
            # then ends with this error.
            with contextlib.suppress(OSError):  # then that run launches again
                Path(job_dir, CAPPED_FILE).write_text(str(error), encoding="utf-8")
            return _error(error)
        return _error(RuntimeError(requeue_this_job(job_id)))

    def _restore(self) -> None:
        if not os.path.isdir(self.cwd):
            raise FileNotFoundError(
                f"the submitter's working directory {self.cwd} does not exist on "
                f"{socket.gethostname()}: submit from a directory that the compute nodes share"
            )
        os.chdir(self.cwd)
        sys.path[:] = [*self.sys_path, *(p for p in sys.path if p not in self.sys_path)]

    def _unpickle(
        self,
    ) -> tuple[Launcher, Any, tuple[Any, ...], dict[str, Any], int | None, MapJob | None]:
        try:
            # (a job submitted by a slurmrun without maps has no sixth item)
            launcher, func, args, kwargs, workers, *mapped = loads(self.payload)
        except ImportError as e:
            missing = [p for p in self.existing if not os.path.exists(p)]
            if not missing:
                raise
            raise ModuleNotFoundError(
                f"{e} (in the submitted job on {socket.gethostname()}). The submitter's "
                f"sys.path has {', '.join(missing)}, which does not exist there: put the "
                "project on a filesystem the compute nodes share"
            ) from e
        return launcher, func, tuple(args), dict(kwargs), workers, (mapped or [None])[0]


def _done_items(job_dir: str, job_id: str) -> DoneItems:
    """Where this job's map keeps its finished items, sealed as this submission's call is."""
    key = job_key(create=False)
    nonce = read_sealed(JobFolder(Path(job_dir), job_id).submitted_pickle, key=key).nonce
    return DoneItems(job_dir, key, nonce)


def _preempted(outcome: Outcome | None, job_id: str) -> bool:
    """Whether a launch failed because SLURM preempts the job (its steps got SIGTERM)."""
    if outcome is None or not outcome.error_type:
        return False
    preempted = preemption(job_id)
    if preempted is not None:
        print(
            f"slurmrun: job {job_id} was preempted at {preempted.time} (the launch failed with "
            f"{outcome.error_type}): this run will be requeued",
            file=sys.stderr,
            flush=True,
        )
    return preempted is not None


def _capped_before(job_dir: str, job_id: str) -> Outcome | None:
    """The error of an earlier run of this job that ended it at its requeue cap, if any.

    A run SLURM starts after that (it requeued the preempted job itself) launches nothing.
    """
    try:
        message = Path(job_dir, CAPPED_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    print(
        f"slurmrun: SLURM requeued job {job_id} after an earlier run ended it at its requeue "
        "cap: this run launches nothing",
        file=sys.stderr,
        flush=True,
    )
    return _error(RequeueLimitError(message))


def _error(exc: Exception) -> Outcome:
    """The outcome of a job that raised `exc` itself (no launch traceback to show)."""
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return Outcome(
        error=dumps_inband(exc),
        error_type=name,
        error_message=str(exc),
        traceback=f"{name}: {exc} (on {socket.gethostname()})",
    )


class _RankFiles(logging.Handler):
    """Each worker's output into ``<folder>/rank<N>.log``, appended as it comes."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self._files: dict[int, _FileHandler] = {}

    def emit(self, record: logging.LogRecord) -> None:
        rank = getattr(record, "rank", None)
        if rank is None:
            return
        handler = self._files.get(rank)
        if handler is None:
            path = os.path.join(self.folder, f"rank{int(rank)}.log")
            handler = self._files[rank] = _FileHandler(path)
        handler.emit(record)

    def close(self) -> None:
        for handler in self._files.values():
            handler.close()
        super().close()


def _job_launcher(launcher: Launcher, workers: int | None, folder: str) -> Launcher:
    """`launcher` as the job runs it: its workers, rank logs, and the ignored signals."""
    handlers = launcher.log_handlers
    if handlers is None:  # the job's output keeps what a terminal would show: local rank 0
        handlers = [stream_handler(None, 0)]
    extra = launcher.extra_env_vars
    job_vars = (IGNORED_SIGNALS_VAR, REQUEUE_COUNT_VAR, REQUEUE_FLAG_VAR, WORKER_UMASK_VAR)
    if isinstance(extra, Mapping):
        extra = {**extra, **{var: os.environ[var] for var in job_vars}}
    else:
        extra = (*extra, *job_vars)
    changes: dict[str, Any] = {
        "log_handlers": [*handlers, _RankFiles(folder)],
        "extra_env_vars": extra,
    }
    if workers is not None:
        changes["workers_per_host"] = workers
    return replace(launcher, **changes)
