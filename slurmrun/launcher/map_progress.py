"""What a map says on the terminal while it runs, and its last line (`Launcher.map`).

On a terminal (stderr), with the default handlers at ``SLURMRUN_LOG_LEVEL`` INFO or below, a
line every `EVERY` seconds says how many items are done, running, failed and queued, and
when the map should end; elsewhere nothing, so that a batch job's log holds only the map's
last line, which says the same once it ended (as a run's summary does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun.launcher.map_book import MapBook

__all__ = ["EVERY", "Progress", "progress_line"]

EVERY = 5.0  # seconds between two progress lines


def progress_line(book: MapBook, slots: int, seconds: float, *, final: bool = False) -> str:
    """The map's state in one line: done, running, failed, queued, time and ETA."""
    total = len(book.outcomes)
    settled = total - book.left
    failed = len(book.failed)
    queued = len(book.queue)
    running = total - settled - queued
    line = (
        f"slurmrun: map of {total} item{'s' * (total != 1)} on {slots} slot"
        f"{'s' * (slots != 1)}: {settled - failed} done, "
    )
    if not final:
        line += f"{running} running, "
    line += f"{failed} failed"
    if not final:
        line += f", {queued} queued"
    line += f", {seconds:.1f} s"
    if not final and settled:
        line += f", about {seconds / settled * (running + queued):.0f} s left"
    return line


@dataclass
class Progress:
    """Says `progress_line` through `say` every `EVERY` s (None: never)."""

    say: Callable[[str], None] | None
    started: float = field(default_factory=time.monotonic)
    _last: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._last = self.started

    def tick(self, book: MapBook, slots: int, now: float) -> None:
        """Says the map's state if `EVERY` s went by since the last line (or the start)."""
        if self.say is not None and now - self._last >= EVERY and not book.finished:
            self._last = now
            self.say(progress_line(book, slots, now - self.started))
