"""Launch events and timings: what a launch reports as it goes (``on_event=``).

Every event is a frozen dataclass with `kind`, `time` (``time.time()``) and `launch_id` (the
same for every event of one launch; each run of a warm launcher is a launch), plus fields of
its own. A launch always emits `LaunchStarted` first and `LaunchFinished` last, also when it
fails.

Handlers never slow a launch down: the launch puts events on a queue and returns at once; one
thread per launch calls the handlers in order. A handler that raises is logged (``slurmrun``
logger) and called again for the next event; at the end the launch waits at most
`DRAIN_TIMEOUT` seconds for the thread to catch up, and leaves a slow handler behind (a daemon
thread) rather than wait longer.

Example:
    >>> import slurmrun
    >>> seen = []
    >>> result = slurmrun.launch(lambda: 1, workers_per_host=1, on_event=seen.append)
    >>> [e.kind for e in seen][0], [e.kind for e in seen][-1]
    ('launch_started', 'launch_finished')
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "EVENTS_FILE_VAR",
    "TIMING_KEYS",
    "AgentConnected",
    "AgentFailed",
    "Event",
    "ItemFailed",
    "ItemFinished",
    "ItemStarted",
    "JsonLinesWriter",
    "LaunchFinished",
    "LaunchStarted",
    "Restarting",
    "Stalled",
    "StepEnding",
    "Straggler",
    "WorkerFailed",
    "WorkersStarted",
    "log_events",
]

EVENTS_FILE_VAR = "SLURMRUN_EVENTS_FILE"
# The launch's milestones, in the order they happen (seconds since the launch started).
TIMING_KEYS = ("agents_connected", "workers_started", "first_result", "last_result", "total")
# At the end of a launch: how long to wait for handlers to take in the events already emitted.
DRAIN_TIMEOUT = 2.0

log = logging.getLogger("slurmrun")


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has.

    An event is built with its own fields, all of them (``LaunchStarted(hosts=...,
    world_size=...)``), and `Trace.emit` stamps it with its launch and the time.

    Attributes:
        launch_id: the same for every event of one launch.
        time: when it happened (``time.time()`` seconds).
    """

    kind: ClassVar[str] = "event"
    launch_id: str = ""
    time: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The event as a JSON-ready dict, with its ``kind`` first."""
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True, kw_only=True)
class LaunchStarted(Event):
    """A launch began: its hosts, and its world size if known before the agents are asked.

    Attributes:
        hosts: the hosts, in node-rank order.
        world_size: the number of workers; None when each agent decides (``"auto"``).
    """

    kind: ClassVar[str] = "launch_started"
    hosts: tuple[str, ...]
    world_size: int | None


@dataclass(frozen=True, kw_only=True)
class AgentConnected(Event):
    """An agent connected (said hello).

    Attributes:
        host: its host.
        node_rank: its place among the hosts.
        seconds: since the launch started.
    """

    kind: ClassVar[str] = "agent_connected"
    host: str
    node_rank: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    """An agent forked its workers.

    Attributes:
        host: its host.
        node_rank: its place among the hosts.
        pids: the workers' process ids on that host, by local rank.
        seconds: since the launch started.
    """

    kind: ClassVar[str] = "workers_started"
    host: str
    node_rank: int
    pids: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(Event):
    """A worker raised, or died without a result.

    Attributes:
        host: its host.
        local_rank: its rank on that host.
        rank: its global rank.
        exitcode: its exit code (negative: the signal that killed it); None if it raised.
        signal: the signal's name if one killed it.
        error: the exception's type name if it raised.
        last_lines: the last lines of its stderr (or the traceback).
    """

    kind: ClassVar[str] = "worker_failed"
    host: str
    local_rank: int
    rank: int
    exitcode: int | None
    signal: str | None
    error: str | None
    last_lines: str


@dataclass(frozen=True, kw_only=True)
class AgentFailed(Event):
    """An agent died, went silent, or never started.

    Attributes:
        host: its host ("" if unknown).
        message: the error's message.
    """

    kind: ClassVar[str] = "agent_failed"
    host: str
    message: str


@dataclass(frozen=True, kw_only=True)
class StepEnding(Event):
    """SLURM is ending an agent's step (SIGTERM: preemption, the time limit, ``scancel``).

    Its workers got the signal too, and have until SLURM's SIGKILL (``GraceTime`` or
    ``KillWait``) to checkpoint and exit; the launch waits for them.

    Attributes:
        host: the agent's host.
        node_rank: its place among the hosts.
    """

    kind: ClassVar[str] = "step_ending"
    host: str
    node_rank: int


@dataclass(frozen=True, kw_only=True)
class Restarting(Event):
    """An attempt failed and the workers start again (``max_restarts``).

    Attributes:
        attempt: the attempt that starts now (1 for the first restart).
        error: the failed attempt's exception type name.
        hosts: the hosts the attempt runs on.
        lost: the hosts lost so far in this launch (`Launcher.min_hosts`).
    """

    kind: ClassVar[str] = "restarting"
    attempt: int
    error: str
    hosts: tuple[str, ...]
    lost: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Stalled(Event):
    """No rank wrote output, returned or failed for ``stall_timeout`` seconds.

    Every rank's stacks were dumped once (printed, and written to the log directory); the run
    goes on (its ``timeout`` still decides when a collective gives up).

    Attributes:
        seconds: the launch's ``stall_timeout``.
        summary: one line per group of ranks with the same stack (`slurmrun.stacks`).
        stacks_file: the whole report in the log directory ("" if there is none).
    """

    kind: ClassVar[str] = "stalled"
    seconds: float
    summary: str
    stacks_file: str


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A rank worked while most of the others waited for it in a collective, over a window.

    Found from every rank's stacks, sampled a few times a second (``Launcher(stragglers=...)``,
    `slurmrun.launcher.stragglers`); emitted at most once per rank per window.

    Attributes:
        rank: the straggler's global rank.
        host: its node.
        score: the share of the window's samples in which it worked while most others waited,
            less the same share of a typical rank (0 to 1).
        hot_frames: where it spent that time, most often first: ``"step (train.py:12) 85%"``.
        seconds: the window's length.
        report_file: the report in the log directory ("" if there is none).
    """

    kind: ClassVar[str] = "straggler"
    rank: int
    host: str
    score: float
    hot_frames: tuple[str, ...]
    seconds: float
    report_file: str


@dataclass(frozen=True, kw_only=True)
class ItemStarted(Event):
    """A map's item was given to a slot (`Launcher.map`).

    Attributes:
        index: the item's place in the items.
        host: the slot's node.
        local_rank: the local rank of the slot's first worker.
        attempt: 1 for its first try, 2 for its first retry, ...
    """

    kind: ClassVar[str] = "item_started"
    index: int
    host: str
    local_rank: int
    attempt: int


@dataclass(frozen=True, kw_only=True)
class ItemFinished(Event):
    """A map's item returned.

    Attributes:
        index: the item's place in the items.
        host: the slot's node.
        local_rank: the local rank of the slot's first worker.
        seconds: from its start on that slot to its value's arrival.
    """

    kind: ClassVar[str] = "item_finished"
    index: int
    host: str
    local_rank: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class ItemFailed(Event):
    """A map's item raised, its worker died, or it ran past ``item_timeout``.

    Attributes:
        index: the item's place in the items.
        host: the slot's node.
        local_rank: the local rank of the slot's first worker.
        error: the exception's type name.
        message: its first line.
        retried: it waits in the queue for another try (else it failed for good).
    """

    kind: ClassVar[str] = "item_failed"
    index: int
    host: str
    local_rank: int
    error: str
    message: str
    retried: bool


@dataclass(frozen=True, kw_only=True)
class LaunchFinished(Event):
    """The launch ended.

    Attributes:
        ok: True if every worker returned.
        error: the exception's type name otherwise.
        timings: seconds since the start for each of `TIMING_KEYS` reached.
    """

    kind: ClassVar[str] = "launch_finished"
    ok: bool
    error: str | None
    timings: Mapping[str, float]


EventHandler = Callable[[Event], object]


def log_events(
    logger: logging.Logger | str = "slurmrun.events", level: int = logging.INFO
) -> EventHandler:
    """A handler that forwards every event to Python logging.

    Each record's message is ``"<kind> <fields as JSON>"`` and the record carries the event
    as ``record.event``.

    Args:
        logger: the logger (or its name).
        level: the records' level.

    Returns:
        A callable for ``on_event=``.
    """
    target = logging.getLogger(logger) if isinstance(logger, str) else logger

    def handle(event: Event) -> None:
        fields = {k: v for k, v in event.as_dict().items() if k != "kind"}
        target.log(level, "%s %s", event.kind, json.dumps(fields, default=str),
                   extra={"event": event})  # fmt: skip

    return handle


class JsonLinesWriter:
    """Appends each event as one JSON object (with its ``kind``) per line to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, event: Event) -> None:
        """Writes `event` (opened and closed each time: the file may be rotated away)."""
        line = json.dumps(event.as_dict(), default=str)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


class Dispatcher:
    """Calls the handlers from a thread of its own, so that the launch never waits for them."""

    def __init__(self, handlers: Sequence[EventHandler]) -> None:
        self._handlers = list(handlers)
        self._queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self._handlers:
            self._thread = threading.Thread(target=self._serve, name="slurmrun-events", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        """Whether any handler takes events."""
        return self._thread is not None

    def emit(self, event: Event) -> None:
        """Queues `event`; never blocks."""
        if self._thread is not None:
            self._queue.put(event)

    def _serve(self) -> None:
        while (event := self._queue.get()) is not None:
            for handler in self._handlers:
                try:
                    handler(event)
                except Exception:
                    log.exception(
                        "slurmrun: the event handler %r failed on %s", handler, event.kind
                    )

    def close(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Lets the thread handle what was queued, waiting at most `timeout` seconds."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "slurmrun: event handlers did not finish within %.0f s; the launch goes on "
                "without waiting for them",
                timeout,
            )


class Trace:
    """One launch's events and milestones: what the launcher, pool and run report to."""

    def __init__(self, on_event: EventHandler | None) -> None:
        handlers: list[EventHandler] = [] if on_event is None else [on_event]
        path = os.environ.get(EVENTS_FILE_VAR)
        if path:
            handlers.append(JsonLinesWriter(path))
        self.launch_id = uuid.uuid4().hex[:12]
        self._start = time.monotonic()
        self._marks: dict[str, float] = {}
        self._dispatcher = Dispatcher(handlers)

    def seconds(self) -> float:
        """Seconds since the launch started."""
        return time.monotonic() - self._start

    def mark(self, name: str, *, last: bool = False) -> None:
        """Records milestone `name` now (the first time only, unless `last`)."""
        if last or name not in self._marks:
            self._marks[name] = self.seconds()

    def timings(self) -> dict[str, float]:
        """The milestones reached, in `TIMING_KEYS` order."""
        return {k: round(self._marks[k], 6) for k in TIMING_KEYS if k in self._marks}

    def emit(self, event: Event) -> None:
        """Emits `event`, stamped with this launch and now."""
        if self._dispatcher.active:
            stamped = dataclasses.replace(event, launch_id=self.launch_id, time=time.time())
            self._dispatcher.emit(stamped)

    def finish(self, error: BaseException | None) -> dict[str, float]:
        """Emits `LaunchFinished`, waits (bounded) for the handlers; returns the timings."""
        self.mark("total")
        timings = self.timings()
        self.emit(
            LaunchFinished(
                ok=error is None,
                error=None if error is None else type(error).__name__,
                timings=timings,
            )
        )
        self._dispatcher.close()
        return timings
