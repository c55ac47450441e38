"""Fixtures for every test: private log dirs, and no process left behind."""

from __future__ import annotations

import contextlib
import time

import psutil
import pytest


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
