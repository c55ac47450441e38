"""Every rank's stacks, gathered during a run: asked for, answered, reported.

A request comes from another thread (`slurmrun.launcher.watch.StacksWanted`:
``Launcher.stacks()``, ``slurmrun stacks`` through the control socket) or from the run
itself (a stall, Ctrl-C, a failure); this module is imported when first asked. The run's
loop sends ASK_STACKS to every agent, takes one STACKS answer per worker (`Gather.take`),
and once every rank answered or the request's time is up, the report is made: ranks without
an answer are in it too, saying so.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from slurmrun import protocol
from slurmrun.launcher.share import Share
from slurmrun.stacks.report import (
    RankStacks,
    StackReport,
    StackSource,
    ThreadStack,
    parse_capture,
    parse_faulthandler,
)
from slurmrun.stacks.sched import Sched

__all__ = ["ANSWER_WAIT", "Gather"]

# How long a worker has to answer itself before its agent dumps it with faulthandler.
ANSWER_WAIT = 1.0
_requests = itertools.count(1)


Done = Callable[[StackReport], None]


@dataclass
class Gather:
    """One request for every rank's stacks, while the answers come in.

    Args:
        run: the run's id.
        shares: the run's shares by node rank (every rank is expected).
        labels: each node's label (host names), by node rank.
        why: what the report says it was made for.
        started: when it was asked for (monotonic).
        deadline: when the report is made with what came (monotonic).
    """

    run: int
    shares: Mapping[int, Share]
    labels: Mapping[int, str] | list[str]
    why: str
    started: float
    deadline: float
    answer_wait: float = ANSWER_WAIT  # before the agent dumps a worker with faulthandler
    purpose: protocol.StacksPurpose = protocol.StacksPurpose.REPORT  # a sample never dumps
    request: int = field(default_factory=lambda: next(_requests))
    done: list[Done] = field(default_factory=list)  # called with the report
    got: dict[tuple[int, int], RankStacks] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._left = sum(share.workers for share in self.shares.values())

    def ask(self, agents_reachable: Callable[[Share], bool], send: Callable[[Share], None]) -> None:
        """Sends ASK_STACKS to every agent that can answer; the others' ranks say why not."""
        for node_rank, share in self.shares.items():
            if not share.workers:
                continue
            if not agents_reachable(share):
                self._none(node_rank, range(share.workers), "its agent is gone")
                continue
            send(share)

    def message(self) -> protocol.AskStacks:
        """The ASK_STACKS this request sends."""
        return protocol.AskStacks(
            run=self.run,
            request=self.request,
            answer_wait=self.answer_wait,
            purpose=self.purpose.value,
        )

    def take(self, node_rank: int, answer: protocol.Stacks, body: bytes | memoryview) -> None:
        """One STACKS answer (local rank -1: for every worker of that agent)."""
        share = self.shares.get(node_rank)
        if share is None or answer.request != self.request:
            return
        if answer.local_rank < 0:
            self._none(node_rank, range(share.workers), answer.note or "no answer")
            return
        if not 0 <= answer.local_rank < share.workers:
            return
        source, threads, note = _threads(answer, bytes(body))
        progress = answer.progress  # from the network: an int >= 0, or unknown
        known = type(progress) is int and progress >= 0
        recorder = (str(answer.recorder), str(answer.recorder_last))
        self._add(
            node_rank, answer.local_rank, threads, source, note, progress if known else None,
            recorder, _sched(answer),
        )  # fmt: skip

    def complete(self, now: float) -> bool:
        """Whether the report can be made: every rank answered, or the time is up."""
        return self._left <= 0 or now >= self.deadline

    def report(self, waited: float) -> StackReport:
        """The report: every rank, those that did not answer within `waited` s saying so."""
        for node_rank, share in self.shares.items():
            missing = [i for i in range(share.workers) if (node_rank, i) not in self.got]
            self._none(node_rank, missing, f"no answer within {waited:g} s", StackSource.SILENT)
        ranks = sorted(self.got.values(), key=lambda r: r.rank)
        return StackReport(ranks=tuple(ranks), why=self.why, when=time.time())

    def _none(
        self,
        node_rank: int,
        local_ranks: Iterable[int],
        note: str,
        source: StackSource = StackSource.NONE,
    ) -> None:
        for local_rank in local_ranks:
            self._add(node_rank, local_rank, (), source, note)

    def _add(  # noqa: PLR0917 - one rank's answer, in parts
        self,
        node_rank: int,
        local_rank: int,
        threads: tuple[ThreadStack, ...],
        source: StackSource,
        note: str,
        progress: int | None = None,
        recorder: tuple[str, str] = ("", ""),
        sched: Sched | None = None,
    ) -> None:
        key = (node_rank, local_rank)
        if key in self.got:
            return  # the first answer counts (a late one of the worker's own, after a dump)
        share = self.shares[node_rank]
        self.got[key] = RankStacks(
            rank=share.rank_offset + local_rank,
            host=self.labels[node_rank],
            local_rank=local_rank,
            threads=threads,
            source=source,
            note=note,
            progress=progress,
            recorder=recorder[0],
            recorder_last=recorder[1],
            sched=sched,
        )
        self._left -= 1


def _sched(answer: protocol.Stacks) -> Sched | None:
    """The answer's scheduler figures (from the network: two ints >= 0), or None: unknown."""
    cpu, queued = answer.cpu_ns, answer.queued_ns
    if type(cpu) is int and type(queued) is int and cpu >= 0 and queued >= 0:
        return Sched(cpu, queued)
    return None


def _threads(
    answer: protocol.Stacks, body: bytes
) -> tuple[StackSource, tuple[ThreadStack, ...], str]:
    """The stacks in an answer's body, how they were taken, and a note."""
    try:
        source = StackSource(answer.source)
    except ValueError:
        return StackSource.NONE, (), f"stacks of an unknown kind {answer.source!r}"
    try:
        if source is StackSource.PYTHON:
            return source, parse_capture(body), answer.note
        if source is StackSource.FAULTHANDLER:
            text = body.decode(errors="replace")
            return source, parse_faulthandler(text), answer.note
    except ValueError as e:
        return StackSource.NONE, (), f"unreadable stacks ({e})"
    if source is StackSource.SILENT:
        return source, (), answer.note or "no answer"
    return StackSource.NONE, (), answer.note or "no stacks"
