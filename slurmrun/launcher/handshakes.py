"""The handshakes in progress on the launcher's port: bounded in all, and per peer address.

Connections that have not proven the secret yet cost the launcher a socket and a slot each.
`Handshakes` keeps them oldest first, at most `limit` in all and `per_source` from one
address. An agent answers the challenge within milliseconds, so a handshake still pending
after `YOUNG` seconds is most likely a peer that will never speak: a new connection pushes
out the oldest such one of its address (or, when all slots are taken, of any address), and
a flood of silent connections cannot hold back our agents. Young handshakes are never pushed
out: thousands of agents that connect at once from one address (one machine) all get in,
and while every slot holds a young one the listener stops accepting (the kernel's backlog
holds the rest). `Tally` reports drops in a bounded number of log lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from slurmrun.launcher.incoming import Incoming

__all__ = ["Handshakes", "Tally"]

log = logging.getLogger("slurmrun")

# A handshake pending this long (seconds) may be pushed out for a newer connection.
YOUNG = 0.25


class Tally:
    """Counts one kind of dropped connection; logs at the 1st, 10th, 100th, 1000th, every 10,000th.

    Args:
        what: the warning, with ``{n}`` for the count so far.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0

    def add(self, detail: str) -> None:
        """Counts one more (`detail`: about this one, for the lines that are logged)."""
        self.count += 1
        if self._milestone():
            log.warning("slurmrun: %s (the last: %s)", self.what.format(n=self.count), detail)

    def close(self) -> None:
        """Logs the total, unless the last count was logged already."""
        if self.count and not self._milestone():
            log.warning("slurmrun: %s in all", self.what.format(n=self.count))

    def _milestone(self) -> bool:
        return self.count in {1, 10, 100, 1000} or self.count % 10000 == 0


class Handshakes:
    """The handshakes in progress, oldest first.

    Args:
        limit: the most in progress at once.
        per_source: the most in progress from one peer address.
    """

    def __init__(self, limit: int, per_source: int) -> None:
        self.limit = limit
        self.per_source = per_source
        self._all: dict[Incoming, float] = {}  # when each began (monotonic clock)
        self._by_source: dict[str, dict[Incoming, None]] = {}
        self.pushed_out = Tally(
            "{n} connection(s) silent since they connected dropped for newer ones"
        )
        self.rejected = Tally("{n} connection(s) rejected before they proved the secret")

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Incoming]:
        return iter(list(self._all))

    def full(self, now: float) -> bool:
        """Whether no other handshake may begin now (every slot holds a young one)."""
        if len(self._all) < self.limit:
            return False
        oldest = next(iter(self._all))
        return now - self._all[oldest] < YOUNG

    def add(self, incoming: Incoming, now: float) -> Incoming | None:
        """Takes in a new handshake; returns the old one it pushes out, if it does."""
        mine = self._by_source.get(incoming.source, {})
        out: Incoming | None = None
        if len(mine) >= self.per_source:
            oldest = next(iter(mine))
            if now - self._all[oldest] >= YOUNG:
                out = oldest
        if out is None and len(self._all) >= self.limit:
            out = next(iter(self._all))  # old (`full` said so): a silent peer, most likely
        if out is not None:
            self.remove(out)
        self._all[incoming] = now
        self._by_source.setdefault(incoming.source, {})[incoming] = None
        return out

    def remove(self, incoming: Incoming) -> None:
        """Forgets a handshake (done, failed, or pushed out); no error if it is not here."""
        self._all.pop(incoming, None)
        mine = self._by_source.get(incoming.source)
        if mine is not None:
            mine.pop(incoming, None)
            if not mine:
                del self._by_source[incoming.source]

    def expired(self, now: float) -> list[Incoming]:
        """The handshakes past their deadline (`now`, monotonic)."""
        late = []
        for incoming in self._all:
            if now < incoming.deadline:
                break  # oldest first: the rest are younger
            late.append(incoming)
        return late

    def clear(self) -> None:
        """Forgets every handshake, and logs how many were dropped or rejected in all."""
        self._all.clear()
        self._by_source.clear()
        self.pushed_out.close()
        self.rejected.close()
