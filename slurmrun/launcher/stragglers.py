"""Stragglers: the rank that works while the others wait for it, found from sampled stacks.

The launcher samples every rank's stack a few times a second (`slurmrun.launcher.sampling`) and
hands each sample here. In each sample, a rank that works (`slurmrun.stacks.classify`) while
most of the others wait in a collective holds them back; over a sliding window, a rank that
does so in a clearly larger share of the samples than a typical rank is a straggler. The share
less the typical rank's is its score: balanced ranks take turns at being last, so theirs stay
near 0, while a rank 30 % slower than the others is last in about a quarter of the samples.

A rank can also be last because it waited for a CPU: on a busy core (the launcher, its agent,
other jobs) a balanced rank is runnable but descheduled, and the others wait for it in bursts
that no count of samples tells from a slow rank's. Its return from a collective is late too,
and the others, already working, look like the ones it waits for. Each answer carries its main
thread's time on the run queue (`slurmrun.stacks.sched`): a rank that spent a clearly larger
share of the time between its answers there than a typical rank (`STARVED`) is starved of CPU,
and is left out of every sample since its wait may have begun, as if it were not in the run.
An answer counts a wait once it ended, seconds later for a rank that shares its core with busy
processes: so a sample stays open for `HOLD` s, and until a rank that held the others back in
it is seen on a CPU since (its answers' CPU time grew), that sample does not count against it.
A rank that sleeps or waits for I/O is not on the run queue: it still counts.

Pure: samples in, findings out (the caller emits, warns and writes them).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Set
from dataclasses import dataclass, field

from slurmrun.stacks.classify import Activity, activity, hot_frame
from slurmrun.stacks.report import RankStacks, StackReport, StackSource, where
from slurmrun.stacks.sched import Sched

__all__ = ["HOLD", "SCORE", "STARVED", "WINDOW", "Found", "StragglerJudge"]

WINDOW = 15.0  # seconds of samples judged together
SCORE = 0.15  # the least score of a straggler
_FILLED = 0.8  # a window is judged once its samples span this share of it
_MIN_SAMPLES = 10
_SUSPECT_SAMPLES = 4  # before this, no rank is suspected
# How far a score must stand above the noise of the window's samples (in standard errors of
# the difference of two shares), to suspect a rank and to name it: balanced ranks that take
# turns at being last, in few samples, can score high by chance.
_Z_SUSPECT = 1.0
_Z_FOUND = 2.5
_HOT_FRAMES = 3
# A rank that spent this share of an interval between samples on the run queue more than a
# typical rank did was starved of CPU then. Measured on 2 shared cores: a sleeping rank 30 %
# slower, in the samples where it held the others back, under 2 % in 9 of 10; a balanced
# rank that shares its core with busy processes (tests/test_stragglers.py), 69-79 %.
STARVED = 0.05
# How long a sample stays open to a rank's wait for a CPU: an answer counts a wait once it
# ended, and a rank may wait for a second or more (a core shared with busy processes).
HOLD = 5.0


@dataclass(frozen=True)
class Found:
    """A straggler found: its rank and node, score, where it spent its time, the window."""

    rank: int
    host: str
    score: float
    lone: float  # the share of the window's samples in which it alone held the others back
    typical: float  # the same share of a typical rank (the median of the others)
    hot_frames: tuple[str, ...]
    samples: int
    seconds: float


@dataclass(frozen=True)
class _Sample:
    when: float
    lone: frozenset[int]  # the ranks that worked while most others waited
    hot: dict[int, str]  # where each of those was


@dataclass
class _Open:
    """A sample that a starved rank's wait, reported late, may still change."""

    when: float
    doing: dict[int, Activity]  # what each rank did
    hot: dict[int, str]  # where each working rank was, if any rank waited
    cpu: dict[int, int]  # each working rank's CPU time then (where known)
    starved: set[int] = field(default_factory=set)
    ran: set[int] = field(default_factory=set)  # working ranks seen on a CPU since
    judged: _Sample | None = None  # for `starved` as it is now

    def judge(self) -> _Sample:
        if self.judged is None:
            self.judged = _lone_workers(self.doing, self.hot, self.when, self.starved)
        return self.judged

    def settled(self) -> _Sample:
        """`judge()`, less the ranks whose wait, if any, may not be counted yet.

        Those not seen on a CPU since: an answer counts a wait once it ended.
        """
        sample = self.judge()
        lone = frozenset(r for r in sample.lone if r in self.ran or r not in self.cpu)
        return sample if lone == sample.lone else _Sample(sample.when, lone, sample.hot)


class StragglerJudge:
    """Judges the samples of one run (see the module's docstring).

    Args:
        window: seconds of samples judged together; a rank is reported at most once per window.
        score: the least score of a straggler.
    """

    def __init__(self, window: float = WINDOW, score: float = SCORE) -> None:
        self.window = window
        self.score = score
        self._samples: deque[_Sample] = deque()
        self._ranks: dict[int, str] = {}  # every rank seen, and its host
        self._reported: dict[int, float] = {}  # when each rank was last reported
        self._sched: dict[int, tuple[float, Sched]] = {}  # each rank's last figures, and when
        self._open: deque[_Open] = deque()  # the last `HOLD` s of samples, judged provisionally
        self.lone: frozenset[int] = frozenset()  # the last sample's ranks that held others back
        # Whether some rank's score so far is at least half a straggler's: sample more often.
        self.suspect = False

    def add(self, report: StackReport, now: float) -> list[Found]:
        """Takes one sample (every rank's stacks at `now`); returns the stragglers found."""
        doing = {stacks.rank: _doing(stacks) for stacks in report.ranks}
        cpu = {s.rank: s.sched.cpu_ns for s in report.ranks if s.sched is not None}
        for one in self._open:
            one.ran.update(r for r, then in one.cpu.items() if cpu.get(r, then) > then)
        hot = _where_working(report, doing)
        self._open.append(_Open(now, doing, hot, {r: cpu[r] for r in hot if r in cpu}))
        for rank, since in self._starved(report, now).items():
            for one in self._open:
                if one.when >= since and rank not in one.starved:
                    one.starved.add(rank)
                    one.judged = None
        while self._open and self._open[0].when < now - HOLD:
            self._samples.append(self._open.popleft().judge())
        self.lone = self._open[-1].judge().lone
        open_ = [one.settled() for one in self._open]
        for stacks in report.ranks:
            self._ranks[stacks.rank] = stacks.host
        while self._samples and self._samples[0].when < now - self.window:
            self._samples.popleft()
        samples = [*self._samples, *open_]
        if len(self._ranks) < 2:
            return []
        counts = Counter(rank for one in samples for rank in one.lone)
        shares = {rank: counts[rank] / len(samples) for rank in self._ranks}
        scores = _scores(shares)
        n = len(samples)
        self.suspect = n >= _SUSPECT_SAMPLES and any(
            score >= self.score / 2 and _z(score, shares[rank], n) >= _Z_SUSPECT
            for rank, score in scores.items()
        )
        spanned = samples[-1].when - samples[0].when
        if len(samples) < _MIN_SAMPLES or spanned < _FILLED * self.window:
            return []
        found = []
        for rank, share in shares.items():
            typical = share - scores[rank]
            if scores[rank] < self.score or _z(scores[rank], share, n) < _Z_FOUND:
                continue
            if now - self._reported.get(rank, -self.window) < self.window:
                continue
            self._reported[rank] = now
            found.append(
                Found(
                    rank=rank,
                    host=self._ranks[rank],
                    score=scores[rank],
                    lone=share,
                    typical=typical,
                    hot_frames=_hot_frames(samples, rank),
                    samples=len(samples),
                    seconds=samples[-1].when - samples[0].when,
                )
            )
        return found

    def _starved(self, report: StackReport, now: float) -> dict[int, float]:
        """The ranks of `report` starved of CPU since their last answer (`STARVED`).

        Each with the earliest time its wait may have begun: an answer counts a wait once it
        ended, so the wait may have begun before the rank's last answer.
        """
        queued: dict[int, float] = {}  # each rank's share of the time on the run queue
        since: dict[int, float] = {}
        for stacks in report.ranks:
            if stacks.sched is None:
                continue
            last = self._sched.get(stacks.rank)
            self._sched[stacks.rank] = (now, stacks.sched)
            if last is not None and now > last[0]:
                waited = max(0, stacks.sched.queued_ns - last[1].queued_ns) / 1e9
                queued[stacks.rank] = waited / (now - last[0])
                since[stacks.rank] = last[0] - waited
        if len(queued) < 2:
            return {}
        ordered = sorted(queued.values())
        return {  # a clearly larger share than the median of the others'
            rank: since[rank]
            for rank, share in queued.items()
            if share > STARVED and share - _others_median(ordered, share) > STARVED
        }


def _z(score: float, share: float, samples: int) -> float:
    """`score` in standard errors of a difference of two shares of `samples` samples."""
    mean = share - score / 2  # of the rank's share and the typical one
    error = math.sqrt(2 * mean * (1 - mean) / samples)
    return score / error if error > 0 else math.inf


def _scores(shares: dict[int, float]) -> dict[int, float]:
    """Each rank's share less the median of the others' (sorted once: a large run has many)."""
    ordered = sorted(shares.values())
    n = len(ordered)
    index = {value: i for i, value in enumerate(ordered)}  # a value's last place: the same value

    def others_median(i: int) -> float:
        def at(j: int) -> float:  # the j-th of the others (`ordered` without its i-th)
            return ordered[j if j < i else j + 1]

        half = (n - 1) // 2
        return at(half) if (n - 1) % 2 else (at(half - 1) + at(half)) / 2

    return {rank: share - others_median(index[share]) for rank, share in shares.items()}


def _others_median(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` without one `value` (of at least 2)."""
    rest = ordered.copy()
    del rest[bisect.bisect_left(rest, value)]
    half = len(rest) // 2
    return rest[half] if len(rest) % 2 else (rest[half - 1] + rest[half]) / 2


def _doing(stacks: RankStacks) -> Activity:
    # A rank silent in a sample holds its GIL in C code (it is not dumped): it works.
    return Activity.WORKING if stacks.source is StackSource.SILENT else activity(stacks)


def _where_working(report: StackReport, doing: dict[int, Activity]) -> dict[int, str]:
    """Where each working rank of `report` is, if any rank waits (else none can hold it back)."""
    if Activity.WAITING not in doing.values():
        return {}
    hot: dict[int, str] = {}
    for stacks in report.ranks:
        if doing[stacks.rank] is not Activity.WORKING:
            continue
        frame = hot_frame(stacks)
        if stacks.source is StackSource.SILENT:
            hot[stacks.rank] = "no answer (C code holding the GIL)"
        else:
            hot[stacks.rank] = where(frame) if frame is not None else "no Python frame"
    return hot


def _lone_workers(
    doing: dict[int, Activity], hot: dict[int, str], now: float, starved: Set[int]
) -> _Sample:
    """The ranks of a sample that work while most of the others wait, and where each is.

    `doing`: what each rank does; `hot`: where each working one is. The `starved` ranks are
    left out, as if they were not in the run.
    """
    known = [
        r
        for r, a in doing.items()
        if a in (Activity.WAITING, Activity.WORKING) and r not in starved
    ]
    working = {r for r in known if doing[r] is Activity.WORKING}
    others = len(known) - 1  # of a working rank
    if others < 1 or 2 * (len(known) - len(working)) <= others:  # most of the others wait
        return _Sample(now, frozenset(), {})
    return _Sample(now, frozenset(working), {r: hot[r] for r in working})


def _hot_frames(samples: list[_Sample], rank: int) -> tuple[str, ...]:
    """Where `rank` was when it held the others back, most often first, with its share."""
    places = Counter(s.hot[rank] for s in samples if rank in s.hot)
    total = sum(places.values())
    return tuple(f"{place} {count / total:.0%}" for place, count in places.most_common(_HOT_FRAMES))
