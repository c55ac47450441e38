"""When a run goes wrong: what a run leaves behind, huge last words, and warm runs' environment.

Real launches on localhost (issue 24): a process a worker started ends with its run, and none
of its output is shown as a later run's; a worker that dies after printing a 1.2 MB line fails
the run at once (its agent's DIED header is bounded); a warm launcher's workers see the
environment as it is at each run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun.errors import WorkerFailedError

HERE = Path(__file__).parent


class Collect(logging.Handler):
    """Keeps every record's message, with the run it arrived during."""

    def __init__(self) -> None:
        super().__init__()
        self.run = 0
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.run, record.getMessage()))


def leave_a_ticker(new_session: bool) -> int:
    """Starts a child that prints forever (in a session of its own: a daemon) and returns."""
    child = subprocess.Popen(
        ["sh", "-c", "while true; do echo tick; sleep 0.02; done"],
        start_new_session=new_session,
    )
    time.sleep(0.2)  # it has printed
    return child.pid


def say(word: str) -> str:
    print(word, flush=True)
    return word


@pytest.mark.parametrize("new_session", [False, True], ids=["child", "daemon"])
def test_a_process_left_by_a_warm_run_ends_with_it_and_stays_out_of_the_next(new_session):
    handler = Collect()
    with slurmrun.Launcher(workers_per_host=1, backend=None, log_handlers=[handler]) as launcher:
        handler.run = 1
        pid = launcher.run(leave_a_ticker, (new_session,)).rank(0)
        # The run is over: what its worker started is gone (not merely reparented).
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        handler.run = 2
        assert launcher.run(say, ("second",)).rank(0) == "second"
    first = [line for run, line in handler.lines if run == 1]
    second = [line for run, line in handler.lines if run == 2]
    assert "tick" in first, "the run's own lines are its own"
    assert second == ["second"], f"lines of an earlier run shown as the next one's: {second}"


def print_a_huge_line_and_die() -> None:
    sys.stderr.write("é" * 1_200_000)  # no newline: the last line, 7 MB once JSON-escaped
    sys.stderr.flush()
    os._exit(3)


@pytest.mark.timeout(60)
def test_a_worker_that_dies_after_a_huge_line_fails_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="exited with code 3") as info:
        slurmrun.launch(print_a_huge_line_and_die, workers_per_host=1, backend=None)
    assert time.monotonic() - start < 30
    assert info.value.exitcode == 3
    assert "more characters" in info.value.stderr_tail  # the line, cut in the failure's tail
    assert len(info.value.stderr_tail) < 64 * 1024


def read_variables() -> dict[str, str | None]:
    return {n: os.environ.get(n) for n in ("SLURMRUN_TEST_SEEN", "SLURMRUN_TEST_GONE")}


def test_warm_runs_see_the_environment_as_it_is_at_each_run(monkeypatch):
    monkeypatch.setenv("SLURMRUN_TEST_SEEN", "1")
    monkeypatch.setenv("SLURMRUN_TEST_GONE", "here")
    with slurmrun.Launcher(
        workers_per_host=1, backend=None, extra_env_vars=("SLURMRUN_TEST_*",)
    ) as launcher:
        first = launcher.run(read_variables).rank(0)
        monkeypatch.setenv("SLURMRUN_TEST_SEEN", "2")
        monkeypatch.delenv("SLURMRUN_TEST_GONE")
        second = launcher.run(read_variables).rank(0)
    assert first == {"SLURMRUN_TEST_SEEN": "1", "SLURMRUN_TEST_GONE": "here"}
    assert second == {"SLURMRUN_TEST_SEEN": "2", "SLURMRUN_TEST_GONE": None}


@pytest.mark.timeout(240)
def test_ctrl_c_at_random_moments_of_warm_runs_never_hangs_nor_leaks():
    """SIGINT, once or twice, at 20 random moments of a warm launcher's runs (start, run, end;
    workers that catch SIGTERM to checkpoint), each followed by a run that must succeed (or
    fail with a clear error) in bounded time, with no line of an interrupted run in it."""
    driver = HERE / "interrupt_driver.py"
    done = subprocess.run(
        [sys.executable, str(driver), "20", "7"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    report = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and report, done.stdout[-3000:] + done.stderr[-3000:]
    fields = dict(item.split("=") for item in report[0].split()[1:])
    assert int(fields["interrupted"]) >= 5, report  # the moments did land inside runs
    assert int(fields["checks_ok"]) == 20, report
    assert int(fields["foreign_lines"]) == 0, report
    assert float(fields["slowest_check"]) < 15.0, report
    assert int(fields["left"]) == 0, report


def test_a_closed_worker_log_drops_a_late_write_and_holds_no_descriptor(tmp_path):
    from slurmrun.logs import WorkerLog

    log = WorkerLog(str(tmp_path), "node", 0, logging.INFO)
    log.write("stdout", logging.INFO, "", "during the run")
    log.close()
    before = len(os.listdir("/proc/self/fd"))
    log.write("stdout", logging.INFO, "", "after the run")  # a reader thread that was late
    assert len(os.listdir("/proc/self/fd")) == before
    assert (tmp_path / "node.0.log").read_text() == "during the run\n"
