"""What the driver scripts share (tests/interrupt_driver.py, tests/chaos_driver.py)."""

from __future__ import annotations

import threading
import time

import psutil


def settle(timers: list[threading.Timer]) -> None:
    """Waits until no SIGINT of this round is still to come or to be raised."""
    while True:
        try:
            for timer in timers:
                timer.cancel()
                timer.join()
            time.sleep(0.05)  # a SIGINT sent just now is raised here
        except KeyboardInterrupt:
            continue
        return


def live_descendants() -> list[psutil.Process]:
    """This process's descendants that are still running (zombies are gone, only unreaped)."""
    time.sleep(0.5)  # what was stopped last has a moment to go
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
