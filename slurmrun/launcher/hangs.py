"""Hangs: every rank stuck, some in a collective, for longer than ``hang_timeout``.

Each sample of every rank's stacks (`slurmrun.launcher.sampling`) gives each rank a place:
what it does (`slurmrun.stacks.classify`), its main thread's frames, and how many collectives
it began (`slurmrun.stacks.report.RankStacks.progress`: a rank seen in ``all_reduce`` twice
has not progressed only if no new one began). A rank's place unchanged since a time is a rank
stuck since then; when every rank is stuck and at least one waits in a collective for longer
than the timeout, the run hangs: `slurmrun.HangError`.

``hang_timeout="auto"`` calibrates on the run's own rhythm: `AUTO_FACTOR` times the longest
gap between two collectives begun by a rank seen so far (at least `AUTO_FLOOR` seconds), from
the second collective on; before that, nothing is judged.

Pure: samples in, the error out.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from slurmrun.errors import HangError
from slurmrun.stacks.classify import Activity, activity
from slurmrun.stacks.report import RankStacks, StackReport, StackSource, rank_ranges

__all__ = ["AUTO_FACTOR", "AUTO_FLOOR", "HangJudge", "hang_error"]

AUTO_FACTOR = 4.0
AUTO_FLOOR = 5.0


def _place(stacks: RankStacks) -> tuple[Any, ...]:
    frames = stacks.threads[0].frames if stacks.threads else ()
    return (
        activity(stacks),
        tuple((f.filename, f.lineno, f.function) for f in frames),
        stacks.progress,
    )


class HangJudge:
    """Judges the samples of one run (see the module's docstring).

    Args:
        timeout: seconds every rank may be stuck; ``"auto"``: calibrated.
    """

    def __init__(self, timeout: float | Literal["auto"]) -> None:
        self.timeout = timeout
        self._place: dict[int, tuple[Any, ...]] = {}
        self._since: dict[int, float] = {}  # when each rank was first seen at its place
        self._progress: dict[int, tuple[int, float]] = {}  # last count of collectives, and when
        self.longest_gap: float | None = None  # between two collectives of a rank
        # Whether the last sample found every rank where it was, some waiting: sample more often.
        self.suspect = False

    def reset(self, now: float) -> None:
        """Nothing counts as stuck before `now` (a debugger session held the ranks)."""
        for rank in self._since:
            self._since[rank] = now

    def limit(self) -> float | None:
        """The timeout in seconds (None: ``"auto"`` not calibrated yet)."""
        if self.timeout != "auto":
            return self.timeout
        if self.longest_gap is None:
            return None
        return max(AUTO_FLOOR, AUTO_FACTOR * self.longest_gap)

    def add(self, report: StackReport, now: float) -> None:
        """Takes one sample (every rank's stacks at `now`).

        Raises:
            HangError: every rank has been stuck, some waiting in a collective, for longer
                than the timeout.
        """
        waiting = False
        for stacks in report.ranks:
            rank = stacks.rank
            self._count(rank, stacks.progress, now)
            if stacks.source is StackSource.SILENT:
                continue  # it could not say (C code holds its GIL): where it was last seen stands
            doing = activity(stacks)
            waiting = waiting or doing is Activity.WAITING
            place = _place(stacks)
            if self._place.get(rank) != place:
                self._place[rank], self._since[rank] = place, now
        limit = self.limit()
        known = len(self._since) >= len(report.ranks)
        stuck_for = now - max(self._since.values(), default=now)
        self.suspect = waiting and known and stuck_for > 0
        if not waiting or limit is None or not known:
            return
        if stuck_for >= limit:
            raise hang_error(report, stuck_for, limit)

    def _count(self, rank: int, progress: int | None, now: float) -> None:
        if progress is None:
            return
        last = self._progress.get(rank)
        if last is None or last[0] != progress:
            if last is not None:
                gap = now - last[1]
                self.longest_gap = max(self.longest_gap or 0.0, gap)
            self._progress[rank] = (progress, now)


def hang_error(report: StackReport, seconds: float, limit: float) -> HangError:
    """The error of a hang: who waits, who does not, and where (`report`), grouped by stack."""
    doing = {r.rank: activity(r) for r in report.ranks}
    stuck = tuple(sorted(r for r, a in doing.items() if a is not Activity.WAITING))
    waiting = [r for r, a in doing.items() if a is Activity.WAITING]
    if stuck:
        who = (
            f"rank{'s' * (len(waiting) != 1)} {rank_ranges(waiting)} waited in a collective "
            f"while rank{'s' * (len(stuck) != 1)} {rank_ranges(stuck)} did not join it"
        )
    else:
        who = "every rank waited in a collective"
    recorded = [r for r in report.ranks if r.recorder_last]
    dumps = tuple(r.recorder for r in recorded if r.recorder)
    recorder = ""
    if recorded:
        folder = os.path.dirname(dumps[0]) if dumps else ""
        recorder = (
            f"\nThe last collective each rank began, by its flight recorder"
            f"{f' (dumps: {folder})' if folder else ''}:\n"
            + "\n".join(f"rank {r.rank}: {r.recorder_last}" for r in recorded)
        )
    return HangError(
        f"the run hung: for {seconds:.0f} s (hang_timeout {limit:g} s) no rank progressed: "
        f"{who}. Where each rank was:\n{report.summary()}{recorder}",
        seconds=seconds,
        stuck=stuck,
        report=report,
        flight_recorder=dumps,
    )


def check_hang_timeout(value: object) -> None:
    """Raises ValueError unless `value` is a positive number of seconds, "auto" or None."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"hang_timeout must be a number of seconds, 'auto' or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"hang_timeout must be a positive number of seconds, got {value!r}")
