"""The launcher's one loop: typed events from the network threads, handed to their owner.

The listener's threads (`slurmrun.launcher.listener`) only move bytes: they put a `Received`
for every whole frame and a `Closed` when a connection ends on one queue; this process's own
threads put `Local` events there (a request for every rank's stacks, a line typed for a
debugger). `pump` is the only
loop that reads it: the owner of the phase at hand (the pool while agents connect, between
runs and while they close; the run while it lasts) gets every event, and a tick on a clock
(not when the queue runs dry: steady output must not postpone what time alone reveals, like
a silent agent).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from slurmrun.transport import Connection, Frame

__all__ = [
    "TICK",
    "Closed",
    "Event",
    "Events",
    "Local",
    "Owner",
    "Received",
    "all_of",
    "drain",
    "pump",
]

TICK = 0.05  # seconds between ticks
T = TypeVar("T")


@dataclass(frozen=True, slots=True)  # slots: a 4096-node run queues ~50,000 of them
class Received:
    """A whole frame arrived on `conn` (authenticated)."""

    conn: Connection
    frame: Frame


@dataclass(frozen=True, slots=True)
class Closed:
    """`conn` ended; `why` is empty for a clean close between frames."""

    conn: Connection
    why: str


class Local:
    """An event of this process (another thread, the terminal), not of a connection."""

    def unowned(self) -> None:
        """Nobody takes it: no run is in progress (answer what waits for it)."""


Event = Received | Closed | Local
Events = queue.SimpleQueue[Event]


class Owner(Protocol):
    """What the pump hands events and ticks to."""

    def on_event(self, event: Event, now: float) -> None:
        """Takes one event (may raise: the pump lets it through)."""

    def on_tick(self, now: float) -> None:
        """Judges what time alone reveals (may raise)."""


def pump(
    events: Events,
    owner: Owner,
    until: Callable[[], bool],
    deadline: float | None = None,
    tick: float = TICK,
) -> bool:
    """Hands `owner` every event and a tick every `tick` s until `until()` or `deadline`.

    Returns:
        True once `until()` held; False when `deadline` (monotonic) came first.
    """
    next_tick = 0.0
    while not until():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        if now >= next_tick:
            owner.on_tick(now)
            next_tick = now + tick
            if until():
                break
        wait = next_tick - now if deadline is None else min(next_tick, deadline) - now
        try:
            event = events.get(timeout=max(0.0, wait))
        except queue.Empty:
            continue
        owner.on_event(event, time.monotonic())
    return True


def drain(events: Events, owner: Owner) -> None:
    """Hands `owner` every event already queued, without waiting."""
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        owner.on_event(event, time.monotonic())


def all_of(items: Iterable[T], done: Callable[[T], bool]) -> Callable[[], bool]:
    """An `until` for `pump`: whether `done` holds for every item (once true, it stays true).

    Items are dropped as they are found done, from the end, not rescanned: asked after every
    event, a rescan of 4096 agents would make the wait quadratic.
    """
    left = list(items)

    def check() -> bool:
        while left and done(left[-1]):
            left.pop()
        return not left

    return check
