"""The exceptions the launcher raises for failed agents and workers, with their messages.

A message says what failed (host, rank, local rank), how (exit code, signal, srun's verdict,
SLURM's cancellation) and where to look (the last lines of the agent's or worker's output,
and its log file).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

from slurmrun import protocol
from slurmrun.errors import (
    AgentFailedError,
    RemoteTraceback,
    WorkerFailedError,
    add_note,
    signal_name,
)
from slurmrun.launcher.agents.containers import start_hint
from slurmrun.launcher.agents.starters import AgentStarter
from slurmrun.logs import tail_file
from slurmrun.pickling import loads
from slurmrun.slurm.job import SlurmAllocation, own_job_id
from slurmrun.slurm.job_end import preemption
from slurmrun.transport import Frame

__all__ = [
    "WorkerPlace",
    "agent_exit_error",
    "note_preemption",
    "srun_verdict",
    "worker_died",
    "worker_error",
]


@dataclass(frozen=True)
class WorkerPlace:
    """Where a worker ran, for messages."""

    hostname: str
    local_rank: int
    rank: int
    log_file: str | None

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.hostname}, local rank {self.local_rank})"


def agent_exit_error(
    starter: AgentStarter, node_rank: int | None, hostname: str, why: str
) -> AgentFailedError:
    """The error for an agent (node rank; None: the whole srun step) that ended too early."""
    codes = starter.exit_codes()
    # srun agents have one code, the step's (srun's own, often its SIGTERM's 143): the agent's
    # own is what srun says of its task (the verdict below).
    own = node_rank is not None and node_rank in codes
    code = codes.get(node_rank) if own else codes.get(None)
    where = f"the agent on {hostname}" if hostname else "the agents"
    if code is not None:
        how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        if 128 < code < 128 + 65:  # ssh exits 255 when its connection fails
            how += f" (128 + {signal_name(code - 128)})"
        why = f"{why}; {'it' if own else 'its srun step'} {how}"
    log_file = starter.log_file(node_rank)
    tail = tail_file(log_file)
    step_log = starter.log_file(None)
    verdict = srun_verdict(step_log, hostname) if step_log != log_file else None
    if verdict:
        why = f"{why}; srun: {verdict}"
    message = f"{where} failed: {why}."
    step_tail = tail_file(step_log) if step_log and step_log != log_file else ""
    # scancel leaves "*** STEP ... CANCELLED ***" in some agent's log and makes srun say the
    # step was aborted; an agent killed on its own (and the others then ended by
    # --kill-on-bad-exit) leaves CANCELLED lines too, but no "aborted".
    if "CANCELLED" in tail or "step aborted" in step_tail:
        message += " SLURM cancelled the step (scancel, the job's time limit, or preemption)."
    hint = start_hint(f"{tail}\n{step_tail}", hostname)
    if hint:
        message += f" {hint}"
    for path, text in ((log_file, tail), (step_log, step_tail)):
        if text:
            message += f"\nLast lines of {path}:\n{text}"
    if not tail and log_file:
        message += f" Its log: {log_file}"
    return AgentFailedError(
        message, hostname=hostname, stderr_tail=tail, log_file=log_file, node_rank=node_rank
    )


def srun_verdict(step_log: str | None, hostname: str, wait: float = 1.0) -> str | None:
    """What srun said of the host's task ("node2: task 1: Killed"), waiting for it briefly."""
    if not step_log or not hostname:
        return None
    pattern = re.compile(rf"{re.escape(hostname)}: task \d+: (.+)")
    deadline = time.monotonic() + wait
    while True:
        found = pattern.findall(tail_file(step_log, 40))
        if found:
            said = str(found[-1]).strip()
            return f"{hostname}: {said}" + (" (SIGKILL)" if said == "Killed" else "")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def worker_error(where: WorkerPlace, error: protocol.Error, frame: Frame) -> BaseException:
    """The exception a worker raised (rebuilt, with a note), or a WorkerFailedError with its text.

    The texts that come with it (message, traceback) are bounded: the worker clipped them
    (`protocol.clip`), and its whole traceback is in its log file, which the note names when it
    exists. Call only with frames from authenticated peers: the exception is unpickled.
    """
    buffers = list(frame.buffers)
    if error.full_traceback and buffers:
        buffers.pop()  # the whole traceback, for log files; the header has it clipped
    traceback_text = protocol.clip(error.traceback)
    log_file = where.log_file if where.log_file and os.path.isfile(where.log_file) else None
    exc: Any = None
    reason = protocol.clip(error.unpicklable or "")
    if frame.body:
        try:
            exc = loads(frame.body, buffers)
        except Exception as e:
            reason = protocol.clip(f"{type(e).__name__}: {e}")
    if isinstance(exc, Exception):
        exc.__cause__ = RemoteTraceback(traceback_text)
        note = f"slurmrun: raised on {where}"
        if log_file:
            note += f"; its log: {log_file}"
        add_note(exc, note)
        return exc
    exc_type = protocol.clip(error.exc_type)
    message = f"{where} raised {exc_type}: {protocol.clip(error.message)}"
    if reason:
        message += f" (it could not be rebuilt in the launcher: {reason})"
    message += f"\nRemote traceback:\n{traceback_text}"
    if log_file:
        message += f"\nIts log: {log_file}"
    return WorkerFailedError(
        message,
        hostname=where.hostname,
        local_rank=where.local_rank,
        rank=where.rank,
        log_file=log_file,
    )


def worker_died(where: WorkerPlace, died: protocol.Died) -> WorkerFailedError:
    """The error for a worker that exited or was killed before returning (its agent said so)."""
    tail = died.stderr_tail
    log_file = where.log_file
    message = f"worker {where} {died.what} before returning a result."
    if tail:
        message += f"\nLast lines of its output{f' ({log_file})' if log_file else ''}:\n{tail}"
    return WorkerFailedError(
        message,
        hostname=where.hostname,
        local_rank=where.local_rank,
        rank=where.rank,
        exitcode=died.exitcode,
        stderr_tail=tail,
        log_file=log_file,
    )


def step_ended(where: WorkerPlace, failed: BaseException) -> AgentFailedError:
    """The error for a worker that died or raised while SLURM ends its step.

    Of SLURM's SIGTERM, by exiting after it, or by raising once SIGTERM reached it or a
    process it waited for: SLURM ended the run, not a failure of the rank's own.
    """
    what = str(failed)
    if not isinstance(failed, WorkerFailedError):
        what = f"rank {where.rank} raised {type(failed).__name__}: {what}"
    error = AgentFailedError(
        f"the agent on {where.hostname} failed: SLURM is ending its step (SIGTERM: scancel, the "
        f"job's time limit, or preemption), and {what}",
        hostname=where.hostname,
        stderr_tail=getattr(failed, "stderr_tail", ""),
        log_file=where.log_file,
    )
    error.__cause__ = failed
    return error


def note_preemption(exc: BaseException, alloc: SlurmAllocation | None) -> bool:
    """Whether `exc` ended a launch in a job that SLURM preempts (a note on `exc` says so).

    With a partition's ``GraceTime``, SLURM terminates a preempted job's steps (the agents and
    workers) but lets the job run on until the grace ends: restarting the workers then is
    pointless, and the error alone (an agent killed by SIGTERM) would not say why.
    """
    job_id = own_job_id() if alloc is not None else None
    preempted = preemption(job_id) if job_id else None
    if preempted is None:
        return False
    add_note(
        exc,
        f"slurmrun: SLURM preempted job {job_id} at {preempted.time} and terminated its "
        "steps (the agents and workers among them); the launch is not restarted",
    )
    return True
