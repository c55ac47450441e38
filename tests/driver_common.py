"""What the driver scripts (tests/interrupt_driver.py, tests/chaos_driver.py) and the tests
of hostile peers (tests/test_launch.py, tests/test_fuzz.py) share."""

from __future__ import annotations

import os
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


def launcher_seen_from_a_worker() -> tuple[str, int]:
    """Where the launcher listens, as any process of the node can find it: the far end of the
    worker's agent's connection (its grandparent's: worker, spawner, agent). Workers are not
    told (their environment holds no launcher address), so a hostile one looks there."""
    agent = psutil.Process(os.getppid()).parent()
    for conn in agent.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_ESTABLISHED and conn.raddr:
            return conn.raddr.ip, conn.raddr.port
    raise RuntimeError(f"agent {agent.pid} has no established connection")
