"""Fixtures for every test: private log dirs, and no process left behind."""

from __future__ import annotations

import contextlib
import fcntl
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal gives it, even where the suite was started in the background.

    A shell without job control starts a background command with SIGINT ignored, and every
    process inherits that at exec: the Ctrl-C tests' launchers would never see their SIGINT
    (seen: every one of them failed when tests/run.sh ran from such a script). A handler,
    unlike SIG_IGN, is not inherited: pytest's children (xdist workers, the tests' launchers)
    start with the default again.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _private_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each pytest process its own XDG_RUNTIME_DIR, where launchers register for `stacks`.

    Two xdist workers start launchers on one host at once, and `slurmrun stacks` without
    `--pid` asks every launcher of the user that it finds: a test that counts its launcher's
    stack reports found one more, asked for by the other worker's test (seen).
    """
    path = tmp_path_factory.mktemp("runtime")  # mode 0700, as slurmrun requires
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(path))
        yield


@pytest.fixture(autouse=True, scope="session")
def _private_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each pytest process its own XDG_CONFIG_HOME, where submitting makes the job key.

    The submitted jobs inherit it (sbatch passes the environment), as a user's nodes see
    the home directory; the suite leaves no key in the home directory of whoever runs it.
    """
    path = tmp_path_factory.mktemp("config")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(path))
        yield


@pytest.fixture(autouse=True)
def _log_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path_factory.mktemp("logs")))


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fails a test that leaves any child process of the test process running."""
    before = {p.pid for p in descendants()}
    yield
    deadline = time.monotonic() + 5.0
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [p for p in descendants() if p.pid not in before and _alive(p)]
        if not left:
            return
        time.sleep(0.1)
    names = [f"{p.pid}:{' '.join(p.cmdline())[:80]}" for p in left if _alive(p)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if names:
        pytest.fail(f"processes left behind: {names}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


TIMES_FILE = Path(__file__).parent / "tests" / ".fault_times.json"


@pytest.fixture(scope="module")
def fault_times(request):
    """Collects a fault-matrix module's detection times; prints and saves them at the end.

    The module names its column (``FAULT_COLUMN``) and its slack on the bounds (``SLACK``).
    """
    times: dict[str, dict[str, float | None]] = {}
    yield times
    if times:
        _report_times(request.module.FAULT_COLUMN, request.module.SLACK, times, request.config)


def _report_times(column, slack, times, config) -> None:
    lines = [
        f"fault detection times, {column} column (s; bound = stated bound, checked + {slack:g})",
        f"{'fault':34} {'bound':>6} {'detected':>9} {'all gone':>9}",
    ]
    for name, t in times.items():
        gone = "-" if t["gone"] is None else f"{t['gone']:.2f}"
        lines.append(f"{name:34} {t['bound']:6.1f} {t['detected']:9.2f} {gone:>9}")
    _save_times(column, times)
    # Printed in the terminal summary: under xdist a worker's own output is not shown, so a
    # worker hands its lines to the controller (workeroutput), which prints them.
    report = _REPORTS.setdefault(config, [])
    report.extend([*lines, ""])
    if hasattr(config, "workeroutput"):
        config.workeroutput["fault_times"] = json.dumps(report)


def _save_times(column, times) -> None:
    """Merges one column into TIMES_FILE, locked: xdist workers may write theirs at once."""
    with contextlib.suppress(OSError), open(TIMES_FILE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            saved = json.loads(TIMES_FILE.read_text())
        except (OSError, ValueError):
            saved = {}
        saved[column] = times
        TIMES_FILE.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")


_REPORTS: dict[pytest.Config, list[str]] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: keeps a finished worker's fault-time tables for the summary."""
    lines = getattr(node, "workeroutput", {}).get("fault_times")
    if lines:
        _REPORTS.setdefault(node.config, []).extend(json.loads(lines))


def pytest_terminal_summary(terminalreporter, config) -> None:
    for line in _REPORTS.pop(config, []):
        terminalreporter.write_line(line)
