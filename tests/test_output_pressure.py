"""Output under pressure: nothing dropped, the launcher stays small, failures still get through.

Workers print far faster than a terminal takes lines; the launcher's stdout may stall (Ctrl-S,
a pager, a slow ssh link). Every line still arrives, in order, in the first run of a launch as
in any other; what the launcher holds meanwhile is bounded (the agents' windows), because the
workers' writes wait, as on a slow terminal; and a failure is acted on while the terminal is
stalled. The launchers here are real (localhost agents, gloo), their stdout a real pipe.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import slurmrun

REPO = Path(__file__).resolve().parent.parent
MILLION = 1_000_000
LINE_WIDTH = 100  # bytes per line in the 50 MB test, newline included
STALL = 12.0  # seconds the launcher's stdout stays unread
# What the launcher may hold at its peak (resident memory): 34 MiB here. Today's main held
# 497 MiB in this test (and 1.5 GB with 150 MB printed): the queue took every line.
PEAK_LIMIT = 100 << 20


class CountInOrder(logging.Handler):
    """Counts rank 0's lines, and those that did not come in the order they were written."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.out_of_order = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() != str(self.count):
            self.out_of_order += 1
        self.count += 1


def print_numbers(n: int) -> int:
    """Rank 0 prints 0..n-1, a line each, as fast as Python writes."""
    if os.environ["RANK"] == "0":
        write = sys.stdout.write
        for i in range(n):
            write(f"{i}\n")
        sys.stdout.flush()
    return n


@pytest.mark.timeout(240)
def test_a_cold_launch_hands_a_counting_handler_all_of_a_million_lines_in_order() -> None:
    counter = CountInOrder()
    counter.addFilter(lambda record: getattr(record, "rank", None) == 0)
    result = slurmrun.launch(
        print_numbers,
        (MILLION,),
        hostnames=["localhost"],
        workers_per_host=2,
        backend="gloo",
        log_handlers=[counter],
    )
    assert result.values() == [MILLION, MILLION]
    assert (counter.count, counter.out_of_order) == (MILLION, 0)


def _launcher_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(body))
    return script


def _start(script: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def _status(pid: int, field: str) -> int:
    """A size from /proc/<pid>/status, in bytes (0 once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


FLOOD = """
    import os, sys
    import slurmrun

    def flood(lines, width, done, pid_file):
        if os.environ["RANK"] == "0":
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            filler = "x" * (width - 12)
            write = sys.stdout.write
            i = 0
            while lines < 0 or i < lines:
                write(f"{i:010d} {filler}\\n")
                i += 1
            sys.stdout.flush()
            open(done, "w").close()
        elif lines < 0:
            import time
            time.sleep(1.0)
            raise ValueError("rank 1 fails while rank 0 floods")
        return 0

    def warm_up():
        return 0

    lines, done, pid_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # The flood is a warm launcher's second run: today's main dropped lines only in a first.
    with slurmrun.Launcher(
        hostnames=["localhost"], workers_per_host=2, backend="gloo", heartbeat_timeout=5
    ) as launcher:
        launcher.run(warm_up)
        launcher.run(flood, (lines, WIDTH, done, pid_file))
""".replace("WIDTH", str(LINE_WIDTH))


def _check_numbered(out: bytes, complete: int | None) -> int:
    """Rank 0's lines on the launcher's stdout: numbered from 0, none missing or doubled."""
    lines = [line for line in out.split(b"\n") if line.startswith(b"[localhost:0] ")]
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(len(numbers))), "a line was lost or doubled"
    if complete is not None:
        assert len(numbers) == complete
    return len(numbers)


@pytest.mark.timeout(180)
def test_a_stalled_stdout_holds_the_workers_back_loses_nothing_and_keeps_the_launcher_small(
    tmp_path: Path,
) -> None:
    lines = 50_000_000 // LINE_WIDTH
    done, pid_file = tmp_path / "done", tmp_path / "pid"
    launcher = _start(_launcher_script(tmp_path, FLOOD), str(lines), str(done), str(pid_file))
    try:
        time.sleep(STALL)  # nobody reads the launcher's stdout meanwhile
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
        peak = _status(launcher.pid, "VmHWM")
        held_back = not done.exists()
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0, err.decode()[-3000:]
    assert held_back, "the worker printed 50 MB while nothing read the launcher's stdout"
    assert 0 < peak <= PEAK_LIMIT, f"the launcher's peak memory: {peak >> 20} MiB"
    _check_numbered(out, lines)


@pytest.mark.timeout(120)
def test_a_failure_stops_the_workers_while_the_launchers_stdout_is_stalled(
    tmp_path: Path,
) -> None:
    done, pid_file = tmp_path / "done", tmp_path / "pid"
    launcher = _start(_launcher_script(tmp_path, FLOOD), "-1", str(done), str(pid_file))
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "rank 0 never started"
            time.sleep(0.1)
        flooder = int(pid_file.read_text())
        # Rank 1 fails after a second; rank 0 prints forever, and nothing reads the launcher.
        while _alive(flooder) and time.monotonic() < deadline:
            time.sleep(0.2)
        stopped_while_stalled = not _alive(flooder)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.wait()
    assert stopped_while_stalled, "the failure waited for the stalled terminal"
    assert launcher.returncode != 0
    assert b"rank 1 fails while rank 0 floods" in err, err.decode()[-3000:]
    assert b"sent nothing" not in err, err.decode()[-3000:]
    _check_numbered(out, None)


def flood_forever() -> int:
    """Rank 0 prints until it is stopped; the others wait."""
    if os.environ["RANK"] == "0":
        write = sys.stdout.write
        i = 0
        while True:
            write(f"{i} {'x' * 80}\n")
            i += 1
    time.sleep(60)
    return 0


def log_huge(size: int) -> int:
    """Rank 0 logs one record of `size` characters: a frame larger than its agent's window."""
    if os.environ["RANK"] == "0":
        logging.getLogger("huge").warning("y" * size)
    return size


@pytest.mark.timeout(120)
def test_after_a_run_cut_short_in_a_flood_a_record_larger_than_the_window_still_goes() -> None:
    # Output of the cut run that arrives after it ended is dropped, and given back at once:
    # the next run's frame larger than the whole window waits for all of it.
    counter = CountInOrder()
    sizes: list[int] = []
    counter.emit = lambda record: sizes.append(len(record.getMessage()))  # type: ignore[method-assign]
    with slurmrun.Launcher(
        hostnames=["localhost"], workers_per_host=2, backend="gloo", log_handlers=[counter]
    ) as launcher:
        for _ in range(3):
            timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                launcher.run(flood_forever)
            timer.join()
            sizes.clear()
            assert launcher.run(log_huge, (9 << 20,)).values() == [9 << 20, 9 << 20]
            assert sizes.count(9 << 20) == 1
