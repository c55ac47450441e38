"""Where a run's output leaves the loop: a thread of its own shows it, and gives agents credit.

The loop (`slurmrun.launcher.pump`) never writes output itself: a terminal that stalls (Ctrl-S,
a pager, a slow ssh link) would hold back every decision of the run, failures and heartbeats
included. It hands each LOG message to the `OutputStage`, whose thread makes the records and
calls the handlers, and gives the agent credit (`Credits`) once the handlers took them. An agent
sends output only within its window (`slurmrun.protocol.OUTPUT_WINDOW`), so what waits here is
bounded by the windows of the pool's agents, and a stalled terminal slows the workers that
print, as it would slow a program that prints to it, without a line dropped.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slurmrun import protocol
from slurmrun.launcher.records import RunOutput
from slurmrun.transport import Connection

__all__ = ["Credits", "OutputStage", "output_window"]

log = logging.getLogger("slurmrun")

# What the output of all agents may hold of the launcher's memory at once (`log_cost` units),
# shared between the agents; an agent's window is never smaller than MIN_WINDOW.
OUTPUT_MEMORY = 16 << 20
MIN_WINDOW = 64 << 10
# Credit goes back once this part of a window is owed (and whenever the stage runs dry).
_CREDIT_PART = 4
_SETTLE_DELAY = 0.005


def output_window(agents: int) -> int:
    """Each agent's window when `agents` agents share `OUTPUT_MEMORY`."""
    return max(MIN_WINDOW, min(protocol.OUTPUT_WINDOW, OUTPUT_MEMORY // max(1, agents)))


class Credits:
    """What the launcher owes each agent for the LOG frames it took (shown or dropped).

    Args:
        window: every agent's window (sent in each START).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._owed: dict[tuple[int, int], tuple[Connection, int]] = {}  # (conn, run): cost
        self._lock = threading.Lock()

    def give(self, conn: Connection, run: int, cost: int, *, at_once: bool = False) -> None:
        """Owes `conn`'s agent `cost` for frames of `run`; sends it once it is enough.

        Enough: a good part of the window, or `at_once`.

        Args:
            conn: the agent's connection.
            run: the run the frames belong to (an agent counts only its current run's).
            cost: the frames' cost (`slurmrun.protocol.log_cost`).
            at_once: send it now (a frame dropped outside any run: no output stage may run
                dry to settle the rest, and the agent may wait for all of it, to send a frame
                larger than its window).
        """
        key = (id(conn), run)
        with self._lock:
            owed = self._owed.get(key, (conn, 0))[1] + cost
            if owed < self.window // _CREDIT_PART and not at_once:
                self._owed[key] = (conn, owed)
                return
            self._owed.pop(key, None)
        _send(conn, run, owed)

    def settle(self) -> None:
        """Sends every debt now."""
        with self._lock:
            owed, self._owed = self._owed, {}
        for (_, run), (conn, cost) in owed.items():
            _send(conn, run, cost)


def _send(conn: Connection, run: int, cost: int) -> None:
    """Sends credit; a connection that cannot take it is ended, so that its agent sees that.

    The agent waits for this credit: a failed send must not leave it waiting (its window
    closes when the connection ends), nor the launcher a half-sent frame on the connection.
    """
    try:
        conn.send(protocol.Credit(cost=cost, run=run).header())
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True)
class _Item:
    conn: Connection
    cost: int
    log: protocol.Log
    body: Any
    label: str
    rank: int | None
    handlers: Sequence[logging.Handler]


class OutputStage:
    """Hands one run's LOG messages to its handlers on a thread of its own, in order.

    Args:
        output: the run's unfinished lines (`slurmrun.launcher.records.RunOutput`).
        credits: where the cost of what was shown goes back to its agent.
    """

    def __init__(self, output: RunOutput, credits: Credits) -> None:
        self._output = output
        self._credits = credits
        self._items: deque[_Item] = deque()
        self._changed = threading.Condition()
        self._put = 0
        self._shown = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def put(
        self,
        conn: Connection,
        log: protocol.Log,
        body: Any,
        *,
        label: str,
        rank: int | None,
        handlers: Sequence[logging.Handler],
    ) -> None:
        """Queues one LOG message of `conn`'s agent for the handlers (never waits)."""
        item = _Item(conn, protocol.log_cost(len(body)), log, body, label, rank, handlers)
        with self._changed:
            self._items.append(item)
            self._put += 1
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._show, name="slurmrun-output", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        """Waits until the handlers took every message queued before now.

        No time limit: a handler that waits is the user's terminal or file taking the output,
        as a program's own print would wait for it (Ctrl-C ends the wait).
        """
        with self._changed:
            target = self._put
            while self._shown < target and self._thread is not None and self._thread.is_alive():
                self._changed.wait(1.0)

    def close(self) -> None:
        """Shows what is queued (`flush`), then ends the thread."""
        self.flush()
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        self._credits.settle()

    def _show(self) -> None:
        while True:
            with self._changed:
                # Run dry: the rest of the credit goes back unless more comes at once (a
                # credit per message would cost as much as the message itself).
                dry = not self._items and not self._stop
                dry = dry and not self._changed.wait(_SETTLE_DELAY)
            if dry:
                self._credits.settle()
            with self._changed:
                while not self._items and not self._stop:
                    self._changed.wait()
                if not self._items:
                    return
                item = self._items.popleft()
            try:
                self._output.dispatch(item.log, item.body, item.label, item.rank, item.handlers)
            except Exception:  # a handler's own errors are reported by dispatch: this is ours
                log.exception("slurmrun: could not show a line of output")
            self._credits.give(item.conn, item.log.run, item.cost)
            with self._changed:
                self._shown += 1
                self._changed.notify_all()
