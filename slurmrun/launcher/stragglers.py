"""Stragglers: the rank that works while the others wait for it, found from sampled stacks.

The launcher samples every rank's stack a few times a second (`slurmrun.launcher.sampling`) and
hands each sample here. In each sample, a rank that works (`slurmrun.stacks.classify`) while
most of the others wait in a collective holds them back; over a sliding window, a rank that
does so in a clearly larger share of the samples than a typical rank is a straggler. The share
less the typical rank's is its score: balanced ranks take turns at being last, so theirs stay
near 0, while a rank 30 % slower than the others is last in about a quarter of the samples.

Pure: samples in, findings out (the caller emits, warns and writes them).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass

from slurmrun.stacks.classify import Activity, activity, hot_frame
from slurmrun.stacks.report import RankStacks, StackReport, StackSource, where

__all__ = ["SCORE", "WINDOW", "Found", "StragglerJudge"]

WINDOW = 15.0  # seconds of samples judged together
SCORE = 0.15  # the least score of a straggler
_FILLED = 0.8  # a window is judged once its samples span this share of it
_MIN_SAMPLES = 10
_HOT_FRAMES = 3


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
        self.lone: frozenset[int] = frozenset()  # the last sample's ranks that held others back

    def add(self, report: StackReport, now: float) -> list[Found]:
        """Takes one sample (every rank's stacks at `now`); returns the stragglers found."""
        sample = _lone_workers(report, now)
        self.lone = sample.lone
        self._samples.append(sample)
        for stacks in report.ranks:
            self._ranks[stacks.rank] = stacks.host
        while self._samples and self._samples[0].when < now - self.window:
            self._samples.popleft()
        samples = list(self._samples)
        if (
            len(self._ranks) < 2
            or len(samples) < _MIN_SAMPLES
            or samples[-1].when - samples[0].when < _FILLED * self.window
        ):
            return []
        counts = Counter(rank for sample in samples for rank in sample.lone)
        shares = {rank: counts[rank] / len(samples) for rank in self._ranks}
        found = []
        for rank, share in shares.items():
            typical = statistics.median(s for r, s in shares.items() if r != rank)
            if share - typical < self.score:
                continue
            if now - self._reported.get(rank, -self.window) < self.window:
                continue
            self._reported[rank] = now
            found.append(
                Found(
                    rank=rank,
                    host=self._ranks[rank],
                    score=share - typical,
                    lone=share,
                    typical=typical,
                    hot_frames=_hot_frames(samples, rank),
                    samples=len(samples),
                    seconds=samples[-1].when - samples[0].when,
                )
            )
        return found


def _doing(stacks: RankStacks) -> Activity:
    # A rank silent in a sample holds its GIL in C code (it is not dumped): it works.
    return Activity.WORKING if stacks.source is StackSource.SILENT else activity(stacks)


def _lone_workers(report: StackReport, now: float) -> _Sample:
    """The ranks of a sample that work while most of the others wait, and where each is."""
    doing = {stacks.rank: _doing(stacks) for stacks in report.ranks}
    known = [r for r, a in doing.items() if a in (Activity.WAITING, Activity.WORKING)]
    waiting = sum(doing[r] is Activity.WAITING for r in known)
    lone: set[int] = set()
    hot: dict[int, str] = {}
    for stacks in report.ranks:
        rank = stacks.rank
        if doing[rank] is not Activity.WORKING:
            continue
        others = len(known) - 1
        if others >= 1 and 2 * waiting > others:  # most of the others wait
            lone.add(rank)
            frame = hot_frame(stacks)
            if stacks.source is StackSource.SILENT:
                hot[rank] = "no answer (C code holding the GIL)"
            else:
                hot[rank] = where(frame) if frame is not None else "no Python frame"
    return _Sample(now, frozenset(lone), hot)


def _hot_frames(samples: list[_Sample], rank: int) -> tuple[str, ...]:
    """Where `rank` was when it held the others back, most often first, with its share."""
    places = Counter(s.hot[rank] for s in samples if rank in s.hot)
    total = sum(places.values())
    return tuple(f"{place} {count / total:.0%}" for place, count in places.most_common(_HOT_FRAMES))
