"""What a run shows of itself while it lasts: every rank's stacks, stalls, debugger sessions.

A `RunWatch` belongs to one `slurmrun.launcher.run.Run` and sees its messages and ticks:

- stacks on demand (`slurmrun.launcher.stacks_gather`): one request at a time; others that come
  meanwhile share its report;
- a stall (``Launcher(stall_timeout=...)``): when no rank wrote output, returned or failed for
  that long, every rank's stacks are dumped once (printed, written to the log directory, a
  `slurmrun.events.Stalled` event), and the run goes on;
- stacks sampled a few times a second, for stragglers and hangs (`slurmrun.launcher.sampling`);
- debugger sessions in the launcher's terminal (`slurmrun.launcher.console`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slurmrun import protocol
from slurmrun.errors import HangError, add_note
from slurmrun.events import Stalled
from slurmrun.launcher.console import (
    CompletionWanted,
    LineTyped,
    Sessions,
    TerminalReader,
    has_terminal,
)
from slurmrun.launcher.pool import AgentPool
from slurmrun.launcher.pump import Local, pump
from slurmrun.launcher.run_setup import Watching
from slurmrun.launcher.share import Share

if TYPE_CHECKING:
    from slurmrun.launcher.sampling import Sampling
    from slurmrun.launcher.stacks_gather import Gather
    from slurmrun.stacks.report import StackReport

__all__ = ["RunWatch", "StacksWanted"]

log = logging.getLogger("slurmrun")
# How long the stacks asked for by the run itself (a stall) may take to come in.
STALL_DUMP_WAIT = 10.0
# Ctrl-C or a failure: how long the stacks of the ranks still running may take.
DUMP_WAIT = 3.0
MAX_STACKS_WAIT = 24 * 3600.0  # the longest a request for stacks may wait (`StacksWanted`)


@dataclass(frozen=True)
class StacksWanted(Local):
    """Another thread wants every rank's stacks.

    `answer` gets the report and where it was written, or None when no run took the request.
    """

    why: str
    timeout: float
    answer: Future[tuple[StackReport, Path | None] | None] = field(default_factory=Future)

    def __post_init__(self) -> None:
        # Checked here, on the asking thread: a NaN deadline would keep the run's gather open
        # (no stall noticed, every later request joining it) until every rank answered.
        if not (math.isfinite(self.timeout) and 0 < self.timeout <= MAX_STACKS_WAIT):
            raise ValueError(
                f"timeout must be a number of seconds > 0 and at most {MAX_STACKS_WAIT:g}, "
                f"got {self.timeout!r}"
            )

    def unowned(self) -> None:
        """No run is in progress: there are no stacks to show."""
        if not self.answer.done():
            self.answer.set_result(None)


class RunWatch:
    """Stacks, stalls and debugger sessions of one run (see the module's docstring).

    Args:
        pool: the run's agents.
        shares: the run's shares by node rank.
        labels: each node's label, by node rank.
        watching: the launch's events, and the run's ``stall_timeout`` (seconds without a
            word from any rank that make a stall; None: off).
        log_dir: where reports are written; None: nowhere.
    """

    def __init__(
        self,
        pool: AgentPool,
        shares: Mapping[int, Share],
        labels: list[str],
        watching: Watching,
        log_dir: str | None,
    ) -> None:
        self.pool = pool
        self.shares = shares
        self.labels = labels
        self.stall_timeout = watching.stall_timeout
        self.watching = watching
        self.sampling: Sampling | None = None
        self.log_dir = log_dir
        self.trace = watching.trace
        self.run = 0
        self.gather: Gather | None = None
        self.last_word = math.inf  # when a rank last started, wrote, returned or failed
        self._stalled_at: float | None = None  # the quiet spell already reported
        self.sessions = Sessions(
            self._send_input, TerminalReader(pool.events) if has_terminal() else None
        )

    def begin(self, run: int) -> None:
        """The run's workers were handed out.

        No quiet spell counts before they start: an agent may still be importing what its
        workers need (torch) and fork them seconds later. Its ``started`` is a first word.
        """
        self.run = run
        self.last_word = math.inf
        watching = self.watching
        # One rank is no one's straggler: it is not sampled for that.
        stragglers = watching.stragglers and sum(s.workers for s in self.shares.values()) > 1
        if stragglers or watching.hang_timeout is not None:
            from slurmrun.launcher.sampling import Sampling  # noqa: PLC0415 - only when on

            self.sampling = Sampling(
                run,
                self.shares,
                self.labels,
                self.pool,
                stragglers=stragglers,
                hang_timeout=watching.hang_timeout,
                trace=self.trace,
                log_dir=self.log_dir,
            )

    def heard(self, now: float) -> None:
        """A rank wrote, returned or failed: the run is not stalled."""
        self.last_word = now

    # ------------------------------------------------------------------ stacks
    def want(self, why: str, timeout: float, done: Callable[[StackReport], None]) -> None:
        """Asks every rank for its stacks (or joins the request in progress)."""
        if self.gather is not None:
            self.gather.done.append(done)
            return
        # (imported when first used: a launch that never looks pays nothing for it)
        from slurmrun.launcher.stacks_gather import Gather  # noqa: PLC0415

        now = time.monotonic()
        gather = Gather(self.run, self.shares, self.labels, why, now, now + timeout, done=[done])
        self.gather = gather
        header = gather.message().header()
        gather.ask(
            lambda share: not share.agent.closed and share.agent.node_rank not in self.pool.dead,
            lambda share: self.pool.send(share.agent, header),
        )
        self._finish_gather(now)

    def on_stacks(self, node_rank: int, message: protocol.Stacks, body: bytes) -> None:
        """A STACKS answer."""
        if self.sampling is not None:
            self.sampling.on_stacks(node_rank, message, body)
        if self.gather is not None:
            self.gather.take(node_rank, message, body)
            self._finish_gather(time.monotonic())

    def _finish_gather(self, now: float) -> None:
        gather = self.gather
        if gather is None or not gather.complete(now):
            return
        self.gather = None
        report = gather.report(now - gather.started)
        for done in gather.done:
            done(report)

    # ------------------------------------------------------------------ events and ticks
    def on_local(self, event: Local) -> None:
        """A request of another thread, or a line typed for a debugger."""
        if isinstance(event, StacksWanted):
            answer = event.answer
            self.want(event.why, event.timeout, lambda report: _answer(answer, report, self))
        elif isinstance(event, LineTyped):
            self.sessions.on_line(event)
        elif isinstance(event, CompletionWanted):
            self.sessions.on_complete(event)
        else:
            event.unowned()

    def on_debugger(self, node_rank: int, message: protocol.Debugger, body: bytes) -> None:
        """A worker's debugger spoke."""
        self.last_word = time.monotonic()
        self.sessions.on_message(self.run, (node_rank, message.local_rank), message, body)

    def on_completions(self, node_rank: int, message: protocol.DebugCompletions) -> None:
        """A worker's debugger answered Tab."""
        self.sessions.on_completions((node_rank, message.local_rank), message)

    def on_tick(self, now: float) -> None:
        """Makes the report whose time is up; notices a stall; samples (raises `HangError`)."""
        self._finish_gather(now)
        if self.sampling is not None:
            self.sampling.on_tick(now, paused=self.sessions.open)
        if self.stall_timeout is None or self.gather is not None or self.sessions.open:
            return
        if now - self.last_word < self.stall_timeout:
            return
        if self._stalled_at == self.last_word:
            return  # this quiet spell was reported
        self._stalled_at = self.last_word
        quiet = now - self.last_word
        self.want(f"no output for {quiet:.0f} s", STALL_DUMP_WAIT, self._stalled)

    def _stalled(self, report: StackReport) -> None:
        path = self.write(report)
        seconds = self.stall_timeout or 0.0
        log.warning(
            "slurmrun: no rank wrote output, returned or failed for %g s. Where each rank "
            "is:\n%s%s",
            seconds,
            report.summary(),
            f"\n(every thread's stacks: {path})" if path else "",
        )
        if self.trace is not None:
            self.trace.emit(
                Stalled(
                    seconds=seconds,
                    summary=report.summary(),
                    stacks_file=str(path or ""),
                )
            )

    def before_stop(self, error: BaseException) -> None:
        """Ctrl-C or a failure, before the workers stop: where every rank still running is.

        Shown as a warning (Ctrl-C) or as a note on the run's `error`, and written to the
        log directory. The run's outcome stands: whatever the wait raises is dropped, except
        a second Ctrl-C.
        """
        self.sampling = None
        if self.pool.broken or not self.shares or isinstance(error, HangError):
            return  # (a hang's error holds the stacks already)
        interrupted = isinstance(error, KeyboardInterrupt)
        why = "Ctrl-C" if interrupted else "the run failed"
        reports: list[StackReport] = []
        self.want(why, DUMP_WAIT, reports.append)
        with contextlib.suppress(Exception):
            deadline = time.monotonic() + DUMP_WAIT + 1.0
            pump(self.pool.events, self.pool.router, lambda: bool(reports), deadline)
        if not reports:
            return
        running = dataclasses.replace(
            reports[0], ranks=tuple(r for r in reports[0].ranks if r.threads)
        )
        if not running.ranks:
            return  # every rank had ended: nothing to show
        path = self.write(reports[0])
        text = running.summary() + (f"\n(every thread's stacks: {path})" if path else "")
        if interrupted:
            log.warning("slurmrun: %s: where each rank was:\n%s", why, text)
        else:
            add_note(error, f"slurmrun: where the ranks still running were:\n{text}")

    def write(self, report: StackReport) -> Path | None:
        """Writes `report` into the launch's log directory, if it has one."""
        if self.log_dir is None:
            return None
        try:
            return report.write(os.path.join(self.log_dir, "stacks"))
        except OSError as e:
            log.warning("slurmrun: could not write the stacks report: %s", e)
            return None

    def close(self) -> None:
        """The run is over: answer what still waits, end the debugger sessions."""
        gather, self.gather = self.gather, None
        self.sampling = None
        if gather is not None:
            report = gather.report(time.monotonic() - gather.started)
            for done in gather.done:
                done(report)
        self.sessions.close()

    def _send_input(self, node_rank: int, message: protocol.Message, line: bytes) -> None:
        share = self.shares.get(node_rank)
        if share is not None and not share.agent.closed:
            self.pool.send(share.agent, message.header(), line)


def _answer(
    answer: Future[tuple[StackReport, Path | None] | None], report: StackReport, watch: RunWatch
) -> None:
    if not answer.done():
        answer.set_result((report, watch.write(report)))
