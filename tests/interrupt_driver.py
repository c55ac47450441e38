"""Ctrl-C at random moments of a warm launcher's runs (run by tests/test_failure_path.py).

    python tests/interrupt_driver.py ROUNDS SEED

Each round starts a run whose workers catch SIGTERM (a checkpoint of 0.3 s), sends this
process SIGINT once or twice at random moments of its start, work and end, and then runs a
check that must succeed. Prints one line: ``REPORT interrupted=N checks_ok=N foreign_lines=N
slowest_check=S left=N`` (``left``: processes of the launch still alive after close).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time

import slurmrun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver_common import live_descendants, settle


class Collect(logging.Handler):
    """Remembers which run's token each line carried, and during which run it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.expected = ""
        self.foreign = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("token ") and text != f"token {self.expected}":
            self.foreign += 1


def work(token: str, seconds: float) -> str:
    import signal as sig

    def checkpoint(*_: object) -> None:
        time.sleep(0.3)
        os._exit(0)

    sig.signal(sig.SIGTERM, checkpoint)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        print(f"token {token}", flush=True)
        time.sleep(0.02)
    return token


def main() -> int:
    rounds, seed = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    handler = Collect()
    launcher = slurmrun.Launcher(workers_per_host=2, backend=None, log_handlers=[handler])
    launcher.open()
    interrupted = checks_ok = 0
    slowest = 0.0
    pid = os.getpid()
    try:
        for i in range(rounds):
            moments = sorted(rng.uniform(0.0, 1.2) for _ in range(rng.choice([1, 1, 2, 3])))
            timers = [threading.Timer(t, os.kill, (pid, signal.SIGINT)) for t in moments]
            handler.expected = f"r{i}"
            try:
                try:
                    for timer in timers:
                        timer.start()
                    launcher.run(work, (f"r{i}", 0.4))
                finally:
                    settle(timers)
            except KeyboardInterrupt:
                interrupted += 1
            except slurmrun.AgentFailedError:
                pass  # a Ctrl-C while agents start: the next run starts new ones
            handler.expected = f"c{i}"
            start = time.monotonic()
            if launcher.run(work, (f"c{i}", 0.05)).rank(0) == f"c{i}":
                checks_ok += 1
            slowest = max(slowest, time.monotonic() - start)
    finally:
        launcher.close()
    left = live_descendants()
    print(
        f"REPORT interrupted={interrupted} checks_ok={checks_ok} "
        f"foreign_lines={handler.foreign} slowest_check={slowest:.2f} left={len(left)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
