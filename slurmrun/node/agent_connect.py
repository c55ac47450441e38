"""How an agent reaches its launcher: tries again with a jittered backoff, for a budget.

A launcher whose listen backlog is full (thousands of agents at once, or strangers crowding
its port) refuses or drops connections; agents that met it together must not come back
together.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable

from slurmrun.authentication import AuthenticationError, HandshakeBrokeOff

__all__ = ["BACKOFF_CAP", "BACKOFF_FIRST", "Backoff", "connect_with_backoff"]

BACKOFF_FIRST = 0.05
BACKOFF_CAP = 2.0


class Backoff:
    """When an agent tries to reach its launcher again, for at most `budget` seconds.

    After each failed try (refused, reset, timed out) it waits a random time between half and
    all of a delay that doubles from `BACKOFF_FIRST` to `BACKOFF_CAP`: agents that met a full
    backlog together do not come back together.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.tries = 0  # tries that failed so far
        self._deadline = time.monotonic() + budget
        self._delay = BACKOFF_FIRST

    def failed(self, error: BaseException) -> float:
        """Counts a failed try; returns how long to wait before the next one.

        Raises:
            ConnectionError: `error`, once the budget is spent (the message says how many
                tries over how long).
        """
        self.tries += 1
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(
                f"{self.tries} tries over {self.budget:g} s failed, the last with "
                f"{type(error).__name__}: {error}"
            ) from error
        wait = min(left, random.uniform(self._delay / 2, self._delay))  # noqa: S311 - jitter
        self._delay = min(BACKOFF_CAP, self._delay * 2)
        return wait


def connect_with_backoff(
    connect_once: Callable[[], socket.socket], budget: float
) -> tuple[socket.socket, int]:
    """Calls `connect_once` until it succeeds, for at most `budget` seconds (see `Backoff`).

    A handshake that timed out or broke off (`HandshakeBrokeOff`: a launcher crowded by
    strangers drops pending handshakes) is retried; a wrong proof (`AuthenticationError`) is
    not: a wrong secret stays wrong. (A launcher closes on a wrong proof of ours without a
    word, so an agent with a wrong secret tries until its budget is spent.)

    Returns:
        The connected socket and the number of tries it took.

    Raises:
        ConnectionError: the last failure, once `budget` is spent (the message says how many
            tries over how long).
        AuthenticationError: the launcher rejected our proof, or failed its own.
    """
    backoff = Backoff(budget)
    while True:
        try:
            return connect_once(), backoff.tries + 1
        except HandshakeBrokeOff as e:  # HandshakeTimeout too: crowded, or cut short
            time.sleep(backoff.failed(e))
        except AuthenticationError:
            raise
        except (OSError, EOFError) as e:
            time.sleep(backoff.failed(e))
