"""Chaos: warm runs with a random fault at a random moment, each followed by a clean run.

    python tests/chaos_driver.py ROUNDS SEED [WORKERS_PER_HOST]

Run by tests/test_chaos.py on localhost and, inside ``salloc -N3``, on the SLURM test cluster.
Faults: a worker raising with a 3 MB message, SIGKILL, SIGSEGV, a child (or a daemon) left
running, Ctrl-C, a log handler that fails, 300 silent connections to the launcher's port, a
flood of output (`FLOOD_LINES` lines at once), and that flood while the terminal's pipe stalls
(`STALL` s unread). A flood must arrive whole and in order. Every clean run must return every
rank's value with every line it printed and no line of another run, within a bound. Prints
``REPORT`` with the counts, and a ``PROBLEM`` line for each thing that went wrong.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from typing import Any

import slurmrun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver_common import live_descendants, settle

LINES = 20
FAULTS = (
    "raise_huge",
    "sigkill",
    "sigsegv",
    "child_left",
    "daemon_left",
    "ctrl_c",
    "failing_handler",
    "flood",
    "output_flood",
    "stdout_stall",
)
CLEAN_BOUND = 20.0  # seconds a clean run may take after any fault
FLOOD_LINES = 100_000
STALL = 3.0  # seconds the terminal's pipe stays unread in "stdout_stall"


class StallingPipe:
    """A terminal stand-in: a pipe read (and thrown away) by a thread, except while stalled."""

    def __init__(self) -> None:
        read, write = os.pipe()
        self.stream = os.fdopen(write, "w")
        self._read = read
        self.reading = threading.Event()
        self.reading.set()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while self.reading.wait() and os.read(self._read, 1 << 16):
            pass

    def stall(self, seconds: float) -> threading.Timer:
        """Stops reading for `seconds` (the returned timer resumes it)."""
        self.reading.clear()
        timer = threading.Timer(seconds, self.reading.set)
        timer.start()
        return timer


class Collect(logging.Handler):
    """Every worker line of the run in progress: (rank, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int | None, str]] = []
        self.fail = False

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((getattr(record, "rank", None), record.getMessage()))


class Failing(logging.Handler):
    """A handler whose emit raises (a full disk, a bug) while `on` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.on:
            raise OSError(28, "No space left on device")

    def handleError(self, record: logging.LogRecord) -> None:
        pass  # reported by slurmrun once; the driver's output stays readable


def work(token: str, fault: str, target: int, delay: float) -> str:
    """On a worker: prints LINES lines; rank `target` meets `fault` after `delay` s."""
    import subprocess

    rank = int(os.environ["RANK"])
    start = time.monotonic()
    for i in range(LINES):
        print(f"token {token} {rank} {i}", flush=True)
        if rank == target and time.monotonic() - start >= delay:
            break
        time.sleep(0.01)
    if rank == target:
        if fault in ("output_flood", "stdout_stall"):
            write = sys.stdout.write
            for i in range(FLOOD_LINES):
                write(f"token {token} {rank} flood {i}\n")
            sys.stdout.flush()
        if fault == "raise_huge":
            raise ValueError("x" * 3_000_000)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "sigsegv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault in ("child_left", "daemon_left"):
            subprocess.Popen(
                ["sh", "-c", f"while true; do echo token {token}-child; sleep 0.01; done"],
                start_new_session=fault == "daemon_left",
            )
        for i in range(LINES):  # the rest of its lines, after the fault
            print(f"token {token} {rank} {i}", flush=True)
    return token


def flood(host: str, port: int, n: int, stop: threading.Event) -> None:
    """Opens `n` connections to the launcher that never say a word, until `stop`."""
    socks = []
    try:
        for _ in range(n):
            if stop.is_set():
                break
            try:
                socks.append(socket.create_connection((host, port), timeout=2))
            except OSError:
                break
        stop.wait(10)
    finally:
        for s in socks:
            s.close()


def main() -> int:  # noqa: PLR0912, PLR0915 - one scenario, read top to bottom
    rounds, seed = int(sys.argv[1]), int(sys.argv[2])
    per_host: Any = int(sys.argv[3]) if len(sys.argv) > 3 else "auto"
    rng = random.Random(seed)
    collect, failing, pipe = Collect(), Failing(), StallingPipe()
    terminal = slurmrun.stream_handler(stdout=pipe.stream, stderr=pipe.stream)
    launcher = slurmrun.Launcher(
        workers_per_host=per_host, backend="gloo", log_handlers=[collect, failing, terminal]
    )
    launcher.open()
    problems: list[str] = []
    counts = {"faults": 0, "clean_ok": 0, "results_lost": 0, "lines_lost": 0, "foreign": 0}
    slowest = 0.0
    world = 0
    pid = os.getpid()

    def check_clean(token: str, values: list[str] | None, took: float) -> None:
        nonlocal slowest
        slowest = max(slowest, took)
        if values is None or values != [token] * world:
            counts["results_lost"] += 1
            problems.append(f"clean run {token}: values {values}")
            return
        counts["clean_ok"] += 1
        mine = {(r, t) for r, t in collect.lines if t.startswith(f"token {token} ")}
        expected = {(r, f"token {token} {r} {i}") for r in range(world) for i in range(LINES)}
        foreign = [
            t
            for _, t in collect.lines
            if t.startswith("token ") and t not in {e[1] for e in expected}
        ]
        if mine != expected:
            counts["lines_lost"] += 1
            problems.append(f"clean run {token}: {len(expected - mine)} lines missing")
        if foreign:
            counts["foreign"] += len(foreign)
            problems.append(f"clean run {token}: lines of other runs: {foreign[:3]}")
        if took > CLEAN_BOUND:
            problems.append(f"clean run {token} took {took:.1f} s")

    try:
        world = len(launcher.run(work, ("warmup", "none", -1, 0.0)).values())
        for i in range(rounds):
            fault = FAULTS[i % len(FAULTS)] if i < len(FAULTS) else rng.choice(FAULTS)
            target, delay = rng.randrange(world), rng.uniform(0.0, 0.2)
            token = f"f{i}"
            collect.lines = []
            failing.on = fault == "failing_handler"
            timers: list[threading.Timer] = []
            stop = threading.Event()
            flooder = None
            if fault == "ctrl_c":
                timers = [threading.Timer(rng.uniform(0.0, 0.5), os.kill, (pid, signal.SIGINT))]
            resume = pipe.stall(STALL) if fault == "stdout_stall" else None
            if fault == "flood":
                warm = launcher._warm
                assert warm is not None and warm.pool is not None
                host, port = warm.pool.server.getsockname()[:2]
                host = "127.0.0.1" if host == "0.0.0.0" else host
                flooder = threading.Thread(target=flood, args=(host, port, 300, stop))
                flooder.start()
            outcome = "returned"
            try:
                try:
                    for timer in timers:
                        timer.start()
                    launcher.run(work, (token, fault, target, delay))
                finally:
                    settle(timers)
            except KeyboardInterrupt:
                outcome = "KeyboardInterrupt"
            except Exception as e:
                outcome = type(e).__name__
            finally:
                stop.set()
                if flooder is not None:
                    flooder.join()
                if resume is not None:
                    resume.join()
                failing.on = False
            counts["faults"] += 1
            want = {
                "raise_huge": {"ValueError"},
                "sigkill": {"WorkerFailedError"},
                "sigsegv": {"WorkerFailedError"},
                "ctrl_c": {"KeyboardInterrupt", "returned"},
            }.get(fault, {"returned"})
            if outcome not in want:
                problems.append(f"round {i} ({fault}): {outcome}, expected {sorted(want)}")
            if outcome == "returned" and fault != "ctrl_c":
                lines = {t for _, t in collect.lines}
                missing = [
                    (r, n)
                    for r in range(world)
                    for n in range(LINES)
                    if f"token {token} {r} {n}" not in lines
                ]
                if missing:
                    counts["lines_lost"] += 1
                    problems.append(f"round {i} ({fault}): lines missing {missing[:3]}")
            if outcome == "returned" and fault in ("output_flood", "stdout_stall"):
                flooded = [t for r, t in collect.lines if r == target and " flood " in t]
                if flooded != [f"token {token} {target} flood {n}" for n in range(FLOOD_LINES)]:
                    counts["lines_lost"] += 1
                    problems.append(
                        f"round {i} ({fault}): {len(flooded)} of {FLOOD_LINES} flood lines"
                    )
            clean = f"c{i}"
            collect.lines = []
            start = time.monotonic()
            values: list[str] | None = None
            try:
                values = launcher.run(work, (clean, "none", -1, 0.0)).values()
            except Exception as e:
                problems.append(f"clean run {clean} after {fault}: {type(e).__name__}: {e}")
            check_clean(clean, values, time.monotonic() - start)
    finally:
        launcher.close()
    left = live_descendants()
    for problem in problems:
        print(f"PROBLEM {problem}", flush=True)
    print(
        f"REPORT seed={seed} world={world} faults={counts['faults']} "
        f"clean_ok={counts['clean_ok']} results_lost={counts['results_lost']} "
        f"lines_lost={counts['lines_lost']} foreign={counts['foreign']} "
        f"slowest_clean={slowest:.2f} left={len(left)} problems={len(problems)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
