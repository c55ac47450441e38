"""Exceptions that slurmrun raises in the launcher."""

from __future__ import annotations

import signal
import sys
from typing import Any

__all__ = [
    "AgentFailedError",
    "HangError",
    "ItemTimeoutError",
    "JobFolderTamperedError",
    "JobKeyError",
    "MapFailedError",
    "NodeUnhealthyError",
    "OptionsError",
    "OptionsTypeError",
    "OptionsValueError",
    "RemoteTraceback",
    "ReservationRequeuedError",
    "VersionMismatchError",
    "WorkerFailedError",
    "add_note",
    "signal_name",
]


class OptionsError(Exception):
    """A launch's options or call are wrong: raised before anything starts.

    Raised as `OptionsValueError` (a ValueError) or `OptionsTypeError` (a TypeError); the
    ``slurmrun`` command answers it as a usage error (exit status 2).
    """


class OptionsValueError(OptionsError, ValueError):
    """An option or argument of the launch has a wrong value (`OptionsError`)."""


class OptionsTypeError(OptionsError, TypeError):
    """An option or argument of the launch has a wrong type, or cannot be pickled."""


class WorkerFailedError(RuntimeError):
    """A worker died without returning, or raised something that could not be rebuilt.

    Attributes:
        hostname: the host the worker ran on.
        local_rank: the worker's rank within its host.
        rank: the worker's global rank, when known.
        exitcode: the exit code, negative for a signal (as in `subprocess`), or None.
        stderr_tail: the last lines the worker wrote to stderr.
        log_file: where the worker's full output went, when it was kept.
    """

    def __init__(
        self,
        message: str,
        *,
        hostname: str = "",
        local_rank: int | None = None,
        rank: int | None = None,
        exitcode: int | None = None,
        stderr_tail: str = "",
        log_file: str | None = None,
    ) -> None:
        super().__init__(message)
        self.hostname = hostname
        self.local_rank = local_rank
        self.rank = rank
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail
        self.log_file = log_file


class AgentFailedError(RuntimeError):
    """An agent (the per-node process that starts workers) died, went silent or never started.

    Attributes:
        hostname: the agent's host, when known.
        stderr_tail: the last lines of the agent's (or srun's) stderr.
        log_file: where the agent's full output went, when it was kept.
        node_rank: the agent's place among the run's hosts (`LaunchResult.hostnames`' order),
            when known: it tells apart two agents of one host (``["localhost", "localhost"]``).
    """

    def __init__(
        self,
        message: str,
        *,
        hostname: str = "",
        stderr_tail: str = "",
        log_file: str | None = None,
        node_rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.hostname = hostname
        self.stderr_tail = stderr_tail
        self.log_file = log_file
        self.node_rank = node_rank


class ReservationRequeuedError(AgentFailedError):
    """SLURM requeued (preempted) the reservation a run was on: the run is lost.

    The reservation comes back under the same job id once SLURM runs it again, with agents
    of its own: the next run on it waits for that (up to its ``timeout``).

    Attributes:
        job_id: the reservation's job id.
    """

    def __init__(self, message: str, *, job_id: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.job_id = job_id


class VersionMismatchError(AgentFailedError):
    """An agent runs another slurmrun (version or protocol) than its launcher.

    Raised when its hello arrives, before any work is sent; never retried (`max_restarts`):
    the same agents would start again. Common with containers: the image holds another
    release than the launcher's environment.
    """


class HangError(RuntimeError):
    """No rank progressed for ``hang_timeout`` while some waited in a collective.

    Every rank was in the same collective (or barrier, or synchronisation) with no new one
    started, or in the same stack as long, for longer than the launch's ``hang_timeout``
    (`slurmrun.launcher.hangs`). The run is stopped; ``max_restarts`` restarts it as any
    failure. The message names the ranks that were not waiting, where they were, and where
    the rest waited, grouped by stack.

    Attributes:
        seconds: how long nothing had progressed.
        stuck: the ranks that were not waiting in a collective (empty: all were).
        report: every rank's stacks at the end (a `slurmrun.stacks.StackReport`).
        stacks_file: the report in the log directory ("" if there is none).
        flight_recorder: each rank's flight recorder dump, where torch keeps one
            (``flight_recorder=True``; NCCL, and gloo since torch 2.6), for ``python -m
            torch.distributed.flight_recorder.fr_trace``; the message names each rank's last
            collective. Empty: none.
    """

    def __init__(
        self,
        message: str,
        *,
        seconds: float = 0.0,
        stuck: tuple[int, ...] = (),
        report: object = None,
        stacks_file: str = "",
        flight_recorder: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.seconds = seconds
        self.stuck = stuck
        self.report = report
        self.stacks_file = stacks_file
        self.flight_recorder = flight_recorder


class NodeUnhealthyError(AgentFailedError):
    """A node failed the launch's ``health_check`` before its workers started.

    An `AgentFailedError` of that node: with ``min_hosts`` or spares (``hosts``), the restart
    leaves it out, as a lost host. The message names the node, the command and its output.
    """


class MapFailedError(RuntimeError):
    """Items of a `Launcher.map` failed (raised, died, or ran past ``item_timeout``).

    Raised once every item has its outcome: the others ran to the end.

    Attributes:
        results: every item's value, or for a failed item its last exception (a worker's
            exception rebuilt, with the remote traceback as its ``__cause__``; a
            `WorkerFailedError` for a worker that died; an `ItemTimeoutError`), in the
            items' order.
        failed: the indices of the failed items, in order.
        ended: why the map ended before every item had run (e.g. a node lost below
            ``min_hosts``: its items without an outcome failed with that node's error), or
            ``""`` when every item ran.
    """

    def __init__(
        self, message: str, *, results: list[object], failed: list[int], ended: str = ""
    ) -> None:
        super().__init__(message)
        self.results = results
        self.failed = failed
        self.ended = ended

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling drops an exception's __cause__: each failed item's remote traceback goes
        # along (a submitted map's error reaches its submitter so).
        causes = [
            r.__cause__
            if isinstance(r, BaseException) and isinstance(r.__cause__, RemoteTraceback)
            else None
            for r in self.results
        ]
        return _map_failed, (str(self), self.results, self.failed, causes), self.__dict__


def _map_failed(
    message: str, results: list[object], failed: list[int], causes: list[RemoteTraceback | None]
) -> MapFailedError:
    """A `MapFailedError` unpickled: each item's exception with its remote traceback again."""
    for result, cause in zip(results, causes, strict=True):
        if cause is not None and isinstance(result, BaseException):
            result.__cause__ = cause
    return MapFailedError(message, results=results, failed=failed)


class ItemTimeoutError(TimeoutError):
    """An item of a `Launcher.map` ran longer than ``item_timeout``: its worker was killed."""


class JobFolderTamperedError(RuntimeError):
    """A file of a submitted job's folder was not written by the submitter's own slurmrun.

    Its seal (an HMAC under the submitter's job key, `slurmrun.batch.seal`) is missing or
    does not match: the file was replaced or changed by someone else, or written by
    something other than slurmrun. Nothing of it was unpickled, and nothing was run.

    Attributes:
        path: the file that failed the check.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class JobKeyError(RuntimeError):
    """The key that seals a submitted job's files cannot be used (`slurmrun.batch.seal`).

    It is missing (on a node: the home directory is not shared), readable by others, or
    not the user's own. The message says which file and what to do.

    Attributes:
        path: the key file.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; set as ``__cause__`` of a re-raised worker exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number that names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def add_note(exc: BaseException, note: str) -> None:
    """Adds `note` to ``exc.__notes__``, as ``BaseException.add_note`` does from Python 3.11.

    Python 3.10 has no ``add_note``: the note is appended to ``__notes__`` all the same, but
    3.10's tracebacks do not print notes (the remote traceback, the ``__cause__``, still prints).
    """
    if sys.version_info >= (3, 11):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        setattr(exc, "__notes__", notes)  # noqa: B010 - 3.10's BaseException declares no __notes__
    notes.append(note)
