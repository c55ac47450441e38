"""A run's verdicts: which failure a run raises, with what it knows of the other ranks.

A worker's ERROR or DIED becomes the run's exception (`slurmrun.launcher.failures` builds it).
A communication error ("peer reset") is likely the consequence of another rank's failure: it
is held for `ROOT_CAUSE_WAIT` so that the cause, if it comes, is raised instead (with the
held one in a note); alone, it is raised with the ranks that had already returned.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from slurmrun import protocol
from slurmrun.errors import AgentFailedError, NodeUnhealthyError, add_note
from slurmrun.events import Trace, WorkerFailed
from slurmrun.launcher.failures import WorkerPlace, step_ended, worker_died, worker_error
from slurmrun.launcher.pool import AgentPool
from slurmrun.launcher.share import PoolAgent, Share
from slurmrun.logs import worker_log_path
from slurmrun.transport import Frame

__all__ = ["ROOT_CAUSE_WAIT", "Verdicts"]

# How long a communication error ("peer reset") waits for the failure that caused it.
ROOT_CAUSE_WAIT = 1.0


class Verdicts:
    """Turns a run's failure reports into the exception the run raises.

    Args:
        pool: the run's agents (whether SLURM is ending an agent's step).
        shares: the run's shares by node rank (which ranks returned).
        trace: the launch's events (`WorkerFailed`).
        labels: each node's name in log file names, by node rank.
    """

    def __init__(
        self,
        pool: AgentPool,
        shares: Mapping[int, Share],
        trace: Trace | None,
        labels: Sequence[str],
    ) -> None:
        self.pool = pool
        self.shares = shares
        self.trace = trace
        self.labels = labels
        self.held: tuple[BaseException, float] | None = None
        self._log_dir: str | None = None
        self._written_here = False
        # each failure built (by its id): it, its agent and its place (`after_end`)
        self._built: dict[int, tuple[BaseException, PoolAgent, WorkerPlace]] = {}

    def files(self, log_dir: str, *, written_here: bool) -> None:
        """The workers' log files are in `log_dir`, written by the launcher or by the agents.

        Where the launcher writes them, a failed worker's whole traceback is appended to its
        file here (agents write it themselves: `slurmrun.node.relay`).
        """
        self._log_dir = log_dir
        self._written_here = written_here

    def worker_failed(
        self,
        share: Share,
        message: protocol.Error | protocol.Died | protocol.Unhealthy,
        frame: Frame,
        now: float,
    ) -> None:
        """A worker raised or died: raises the run's exception (or holds a likely consequence).

        Raises:
            BaseException: the worker's exception, or the error for its death.
            NodeUnhealthyError: the node failed its health check (`slurmrun.node.health_check`).
        """
        if isinstance(message, protocol.Unhealthy):
            raise NodeUnhealthyError(
                f"{share.hostname} failed its health check: {message.why}",
                hostname=share.hostname,
                node_rank=share.agent.node_rank,
                log_file=self.pool.starter.log_file(share.agent.node_rank),
            )
        exc = self._failure(share, message, frame)
        if isinstance(message, protocol.Error) and message.secondary and self.held is None:
            self.held = (exc, now)  # likely a consequence: wait briefly for the cause
            return
        raise self._with_held(exc)

    def after_end(self, exc: BaseException) -> BaseException:
        """`exc`, the run's failure, judged again once the run ended (`Run._end`).

        A rank's failure that came before its agent said that SLURM ends its step (SLURM
        signalled the agent after the rank, or the rank raised of a child that SLURM killed)
        was the step's end: `step_ended`, with `exc` as its cause.
        """
        built = self._built.get(id(exc))
        if built is None or built[0] is not exc or isinstance(exc, AgentFailedError):
            return exc
        _, agent, where = built
        return step_ended(where, exc) if self.pool.endings.ending(agent) else exc

    def check_held(self, now: float) -> None:
        """Raises a held communication error whose cause did not come in time."""
        if self.held is not None and now - self.held[1] > ROOT_CAUSE_WAIT:
            raise self._without_cause(self.held[0])

    def _failure(
        self, share: Share, message: protocol.Error | protocol.Died, frame: Frame
    ) -> BaseException:
        local_rank = message.local_rank
        log_file = None
        if self._log_dir is not None:
            label = self.labels[share.agent.node_rank]
            log_file = worker_log_path(self._log_dir, label, local_rank)
            if self._written_here and isinstance(message, protocol.Error):
                _append_traceback(log_file, message, frame)
        where = WorkerPlace(share.hostname, local_rank, share.rank_offset + local_rank, log_file)
        exc: BaseException = (
            worker_died(where, message)
            if isinstance(message, protocol.Died)
            else worker_error(where, message, frame)
        )
        # SIGTERM, its own exit once it got it, or an error it raised then (the agent says the
        # step is ending before it forwards an error: `slurmrun.node.relay.Relay.before_error`)
        if self.pool.endings.ending(share.agent):
            exc = step_ended(where, exc)
        self._built[id(exc)] = (exc, share.agent, where)
        if self.trace is not None:
            if isinstance(message, protocol.Died):
                code, sig, error, text = message.exitcode, message.signal, None, message.stderr_tail
            else:
                code, sig, error, text = None, None, type(exc).__name__, message.traceback
            self.trace.emit(
                WorkerFailed(
                    host=share.hostname,
                    local_rank=local_rank,
                    rank=where.rank,
                    exitcode=code,
                    signal=sig,
                    error=error,
                    last_lines="\n".join(text.splitlines()[-20:]),
                )
            )
        return exc

    def _with_held(self, exc: BaseException) -> BaseException:
        if self.held is not None and self.held[0] is not exc:
            held = self.held[0]
            add_note(exc, f"slurmrun: another rank then failed with {type(held).__name__}: {held}")
        return exc

    def _without_cause(self, exc: BaseException) -> BaseException:
        """A communication error that no other failure explains: say who had already left."""
        returned = sorted(s.rank_offset + lr for s in self.shares.values() for lr in s.results)
        if returned:
            listed = ", ".join(map(str, returned[:10])) + (", ..." if len(returned) > 10 else "")
            add_note(
                exc,
                f"slurmrun: rank(s) {listed} had already returned and left the process group: "
                "this rank was most likely waiting in a collective that they never joined.",
            )
        return exc


def _append_traceback(path: str, error: protocol.Error, frame: Frame) -> None:
    """Appends a worker's whole traceback (its error's last buffer) to its log file.

    Lines still queued for the file's writer may land after it; the file must hold the
    traceback before the error names it.
    """
    if not error.full_traceback or not frame.buffers:
        return
    text = bytes(frame.buffers[-1]).decode(errors="replace").rstrip("\n") + "\n"
    try:
        with open(path, "a", encoding="utf-8", errors="replace") as f:
            f.write(text)
    except OSError as e:
        print(f"slurmrun: cannot write a worker's log: {e}", file=sys.stderr)
