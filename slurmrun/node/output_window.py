"""The agent's output window: how much LOG it may have sent that the launcher has not taken.

The launcher gives credit (`slurmrun.protocol.Credit`) for the LOG frames it has shown or
dropped. A sender that finds the window full waits for credit, and so stops reading its
worker's pipe: the worker's writes then wait, as they would on a slow terminal, and nothing is
dropped anywhere. Heartbeats, results and failures do not go through the window: a launcher
whose terminal stalls still hears that its agents are alive, and of their failures.

The window counts the frames of the run in progress: each START begins it afresh (`begin`),
and credit for another run is ignored. What a run left in flight (the frames a Ctrl-C cut
short, which the launcher may never take) then never shrinks a later run's window; late
frames of an ended run are few (its workers were stopped) and go uncounted.
"""

from __future__ import annotations

import threading

from slurmrun import protocol

__all__ = ["OutputWindow", "WindowClosed"]

# A waiting sender looks again this often (it is woken by credit, resize and close anyway).
_WAKE = 1.0


class WindowClosed(ConnectionError):
    """The connection to the launcher ended: no credit will come."""


class OutputWindow:
    """A byte budget for LOG frames in flight, given back by the launcher's credit.

    Args:
        capacity: the window, in `slurmrun.protocol.log_cost` units.
    """

    def __init__(self, capacity: int = protocol.OUTPUT_WINDOW) -> None:
        self._capacity = max(1, capacity)
        self._run = 0
        self._in_flight = 0
        self._closed = False
        self._waiting = 0
        self._changed = threading.Condition()

    @property
    def in_flight(self) -> int:
        """The cost sent and not yet given back."""
        return self._in_flight

    @property
    def waiting(self) -> bool:
        """Whether a sender waits for credit (its worker's output waits for the launcher)."""
        return self._waiting > 0

    def acquire(self, cost: int, run: int) -> None:
        """Takes `cost` from the window for a frame of `run`, waiting for credit while it is full.

        A frame larger than the whole window goes alone (when nothing else is in flight); one
        of another run than the window's goes uncounted.

        Raises:
            WindowClosed: the connection to the launcher ended.
        """
        with self._changed:
            if run != self._run:
                if self._closed:
                    raise WindowClosed("the connection to the launcher ended")
                return
            self._waiting += 1
            try:
                while not self._closed and not self._fits(cost):
                    self._changed.wait(_WAKE)
            finally:
                self._waiting -= 1
            if self._closed:
                raise WindowClosed("the connection to the launcher ended")
            self._in_flight += cost

    def _fits(self, cost: int) -> bool:
        return self._in_flight == 0 or self._in_flight + cost <= self._capacity

    def release(self, cost: int, run: int) -> None:
        """The launcher took frames of `run` of this cost (a CREDIT)."""
        with self._changed:
            if run == self._run:
                self._in_flight = max(0, self._in_flight - cost)
                self._changed.notify_all()

    def begin(self, run: int, capacity: int) -> None:
        """Counts the frames of `run` from now on, in a window of `capacity` (0: as it is)."""
        with self._changed:
            self._run = run
            self._in_flight = 0
            if capacity > 0:
                self._capacity = capacity
            self._changed.notify_all()

    def close(self) -> None:
        """No credit will come: every waiting sender raises `WindowClosed`, and later ones."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
