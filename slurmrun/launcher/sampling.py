"""Every rank's stacks, sampled a few times a second while a run goes on: stragglers, hangs.

`Sampling` belongs to a run's `slurmrun.launcher.watch.RunWatch`: from its ticks it asks every
rank for its stacks (once the run's workers all started, never while a debugger session holds
them, one sample at a time), and hands each sample to the judges:
`slurmrun.launcher.stragglers` (a `slurmrun.events.Straggler` event, a warning, a report in
the log directory) and `slurmrun.launcher.hangs` (`slurmrun.HangError`, raised from the tick,
which fails the run).

The rate: each `INTERVAL` seconds when stragglers are judged, and with ``hang_timeout="auto"``
(which calibrates on the gaps that the samples see). With a ``hang_timeout`` in seconds alone, a
sample each `CALM` seconds while nothing looks wrong, each `INTERVAL` seconds for a window once
the hang judge suspects something (every rank where the last sample found it, some waiting).

A worker answers a sample from its own thread (`slurmrun.stacks.report.capture`: well under a
millisecond of its time; docs/stuck.md has the measured cost). One that does not answer within
`SAMPLE_WAIT` (C code holding its GIL) is silent in that sample: a sample never dumps a worker
with faulthandler (`slurmrun.protocol.StacksPurpose`). A hang's report, asked for once the
judge found the hang, does: its error shows where every rank is, and each rank's flight
recorder (`slurmrun.node.recorder`) where torch keeps one.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from slurmrun import protocol
from slurmrun.errors import HangError
from slurmrun.events import Straggler, Trace
from slurmrun.launcher.hangs import HangJudge, hang_error
from slurmrun.launcher.pool import AgentPool
from slurmrun.launcher.share import Share
from slurmrun.launcher.stacks_gather import Gather
from slurmrun.launcher.stragglers import WINDOW, Found, StragglerJudge

if TYPE_CHECKING:
    from slurmrun.stacks.report import StackReport

__all__ = ["INTERVAL", "Sampling"]

log = logging.getLogger("slurmrun")

INTERVAL = 0.25  # seconds between samples once a judge suspects something, up to 500 ranks
CALM = 1.0  # seconds between samples while nothing looks wrong
# More ranks are sampled less often, so that the launcher parses at most ~2000 answers a second;
# the stragglers' window then grows to hold as many samples.
PER_RANK = 0.0005
# A worker that has not answered a sample within this is silent in it (C code holds its GIL):
# the agent only passes a sample on, the launcher waits.
SAMPLE_WAIT = 1.0
ANSWER_WAIT = 0.5  # a hang's report: how long a worker has before its agent dumps it
HANG_REPORT_WAIT = 6.0  # the most a hang's report waits (the silent ranks are dumped)
_KEPT = 8  # the last samples in which some rank held the others back, for the reports


class Sampling:
    """Samples one run's ranks for its judges (see the module's docstring).

    Args:
        run: the run's id.
        shares: the run's shares by node rank.
        labels: each node's label, by node rank.
        pool: the run's agents.
        stragglers: whether stragglers are looked for.
        hang_timeout: `slurmrun.launcher.hangs.HangJudge`'s; None: no hang is looked for.
        trace: the launch's events (None: none).
        log_dir: where reports are written (None: nowhere).
    """

    def __init__(
        self,
        run: int,
        shares: Mapping[int, Share],
        labels: list[str],
        pool: AgentPool,
        *,
        stragglers: bool,
        hang_timeout: float | Literal["auto"] | None,
        trace: Trace | None,
        log_dir: str | None,
    ) -> None:
        self.run = run
        self.shares = shares
        self.labels = labels
        self.pool = pool
        ranks = sum(share.workers for share in shares.values())
        self.interval = max(INTERVAL, PER_RANK * ranks)
        # Stragglers are named from many samples: at the calm rate, a rank 30 % slower was
        # sometimes named only after 25 s (its first samples happened to find nothing).
        fast = stragglers or hang_timeout == "auto"
        self.calm = self.interval if fast else max(CALM, self.interval)
        window = WINDOW * self.interval / INTERVAL
        self._alert_until = 0.0  # sample each `interval` s until then, else each `calm` s
        self.stragglers = StragglerJudge(window) if stragglers else None
        self.hangs = HangJudge(hang_timeout) if hang_timeout is not None else None
        self.trace = trace
        self.log_dir = log_dir
        self.gather: Gather | None = None
        self._hang: tuple[Gather, HangError] | None = None  # a hang's report, dumping the silent
        self._next = 0.0
        self.samples = 0
        self._paused = False
        self._lone: deque[tuple[frozenset[int], StackReport]] = deque(maxlen=_KEPT)
        self._warned: dict[int, int] = {}  # how often each rank was found

    def on_tick(self, now: float, paused: bool) -> None:
        """Takes a sample whose answers are in; asks for the next when it is time.

        Args:
            now: the time (monotonic).
            paused: a debugger session holds ranks: no sample, and no rank is stuck meanwhile.

        Raises:
            HangError: the run hangs (`slurmrun.launcher.hangs`).
        """
        self._finish(now)
        self._finish_hang(now)
        if paused:
            self._paused = True
            return
        if self._paused and self.hangs is not None:
            self.hangs.reset(now)
        self._paused = False
        if self.gather is not None or self._hang is not None or now < self._next:
            return
        if not all(share.started for share in self.shares.values()):
            return
        self._next = now + (self.interval if now < self._alert_until else self.calm)
        self.gather = self._ask("sampled", now, SAMPLE_WAIT, protocol.StacksPurpose.SAMPLE)

    def _ask(self, why: str, now: float, wait: float, purpose: protocol.StacksPurpose) -> Gather:
        gather = Gather(
            self.run, self.shares, self.labels, why, now, now + wait,
            answer_wait=ANSWER_WAIT, purpose=purpose,
        )  # fmt: skip
        header = gather.message().header()
        gather.ask(
            lambda share: not share.agent.closed and share.agent.node_rank not in self.pool.dead,
            lambda share: self.pool.send(share.agent, header),
        )
        return gather

    def on_stacks(self, node_rank: int, message: protocol.Stacks, body: bytes) -> None:
        """A STACKS answer (of a sample, or not: the request's id tells)."""
        if self.gather is not None:
            self.gather.take(node_rank, message, body)
        if self._hang is not None:
            self._hang[0].take(node_rank, message, body)

    def _finish(self, now: float) -> None:
        gather = self.gather
        if gather is None or not gather.complete(now):
            return
        self.gather = None
        report = gather.report(now - gather.started)
        self.samples += 1
        if self.stragglers is not None:
            found = self.stragglers.add(report, now)
            if self.stragglers.lone:
                self._lone.append((self.stragglers.lone, report))
            for one in found:
                # The report shows a sample in which the straggler held the others back.
                shown = next((r for lone, r in reversed(self._lone) if one.rank in lone), report)
                self._straggler(one, shown)
        if self.hangs is not None:
            try:
                self.hangs.add(report, now)
            except HangError as e:
                # The hang's own report: the silent ranks dumped (a sample never dumps), and
                # each rank's flight recorder where torch keeps one.
                gather = self._ask("hang", now, HANG_REPORT_WAIT, protocol.StacksPurpose.HANG)
                self._hang = (gather, e)
        if (self.stragglers is not None and self.stragglers.suspect) or (
            self.hangs is not None and self.hangs.suspect
        ):
            self._alert_until = now + (self.stragglers.window if self.stragglers else WINDOW)

    def _finish_hang(self, now: float) -> None:
        if self._hang is None or not self._hang[0].complete(now):
            return
        gather, found = self._hang
        report = gather.report(now - gather.started)
        limit = self.hangs.limit() if self.hangs is not None else None
        error = hang_error(report, found.seconds + now - gather.started, limit or found.seconds)
        raise self._hang_error(error, report) from None

    def _hang_error(self, error: HangError, report: StackReport) -> HangError:
        """`error`, naming the file its report was written to (in the log directory)."""
        path = _write(report, self.log_dir, "stacks")
        if path is None:
            return error
        return HangError(
            f"{error}\n(every thread's stacks: {path})",
            seconds=error.seconds, stuck=error.stuck, report=error.report, stacks_file=str(path),
            flight_recorder=error.flight_recorder,
        )  # fmt: skip

    def _straggler(self, found: Found, report: StackReport) -> None:
        text = (
            f"straggler: rank {found.rank} ({found.host}) worked while most of the others "
            f"waited for it in {found.lone:.0%} of the last {found.seconds:.0f} s "
            f"(a typical rank: {found.typical:.0%}), at {', '.join(found.hot_frames) or '?'}"
        )
        path = _write_straggler(text, report, self.log_dir)
        count = self._warned[found.rank] = self._warned.get(found.rank, 0) + 1
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th... time: a long run stays readable
            later = "" if count == 1 else f" (found {count} times; the event comes every time)"
            log.warning("slurmrun: %s%s%s", text, f" (report: {path})" if path else "", later)
        if self.trace is not None:
            self.trace.emit(
                Straggler(
                    rank=found.rank,
                    host=found.host,
                    score=round(found.score, 3),
                    hot_frames=found.hot_frames,
                    seconds=round(found.seconds, 1),
                    report_file=str(path or ""),
                )
            )


def _write(report: StackReport, log_dir: str | None, folder: str) -> Path | None:
    if log_dir is None:
        return None
    try:
        return report.write(os.path.join(log_dir, folder))
    except OSError as e:
        log.warning("slurmrun: could not write the stacks report: %s", e)
        return None


def _write_straggler(text: str, report: StackReport, log_dir: str | None) -> Path | None:
    """Writes the finding and the sample's stacks to stragglers/ in the log directory."""
    if log_dir is None:
        return None
    folder = Path(log_dir) / "stragglers"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(report.when))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1001):
            path = folder / (f"straggler-{stamp}.txt" if n == 1 else f"straggler-{stamp}-{n}.txt")
            try:
                with path.open("x", encoding="utf-8") as f:
                    f.write(text + "\n\n" + report.format())
            except FileExistsError:
                continue
            return path
    except OSError as e:
        log.warning("slurmrun: could not write the straggler report: %s", e)
    return None
