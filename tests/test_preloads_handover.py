"""Learned preloads never hold a run: a successor imports them, then takes the spawner's place.

Each test runs a warm launcher on localhost whose workers import packages from a directory
named ``site-packages`` under `tmp_path` (see `tests/test_preloads.py`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import slurmrun
from slurmrun.node import import_notes, preloads

OPTIONS: dict[str, Any] = {"workers_per_host": 2, "backend": None, "timeout": 120}
SLOW_IMPORT = 2.0  # seconds `sleepy`'s import takes
GONE_WITHIN = 10.0


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``site-packages`` directory with `learnme` and `sleepy`, importable everywhere."""
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "learnme.py").write_text("VALUE = 1\n")
    (packages / "sleepy.py").write_text(f"import time\n\ntime.sleep({SLOW_IMPORT})\n")
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")])
    )
    return packages


def import_then_wait(name: str, wait: float) -> dict[str, Any]:
    """Whether `name` was loaded when this worker started; imports it, then waits `wait` s."""
    loaded = name in sys.modules
    importlib.import_module(name)
    time.sleep(wait)
    return {"loaded": loaded, "spawner": os.getppid()}


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended; its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_package_a_run_imported_early_is_loaded_when_the_next_run_starts(site: Path) -> None:
    # gloo: torch is the spawner's from its start. With backend None the fork would import
    # torch as well before it may serve (`SLURMRUN_PRELOAD_LATER`): on a busy machine, more
    # than run 1's 3 s (seen beside the test command), and run 2 would not wait for it.
    with slurmrun.Launcher(**{**OPTIONS, "backend": "gloo"}) as launcher:
        # The import is first thing; the run goes on for longer than a fork's import of it.
        first = launcher.run(import_then_wait, ("learnme", 3.0)).values()
        second = launcher.run(import_then_wait, ("learnme", 0.0)).values()
    assert [a["loaded"] for a in first] == [False, False]
    assert [a["loaded"] for a in second] == [True, True], "run 2 had to import it again"


def test_no_run_waits_for_the_import_of_a_learned_preload(site: Path) -> None:
    times, loaded = [], []
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for _ in range(5):  # back to back: the import takes SLOW_IMPORT, wherever it is made
            start = time.monotonic()
            answers = launcher.run(import_then_wait, ("sleepy", 0.0)).values()
            times.append(time.monotonic() - start)
            loaded.append(all(a["loaded"] for a in answers))
    assert loaded[-1], f"never preloaded: {loaded}"
    # A run that found it loaded, yet took as long as its import, waited for a spawner's.
    for run, took in enumerate(times[1:], start=2):
        assert loaded[run - 1] <= (took < SLOW_IMPORT / 2), f"run {run} took {took:.2f} s"


def import_if_it_can(name: str, wait: float) -> bool:
    """Whether `name` was loaded when this worker started; tries to import it, waits `wait` s."""
    loaded = name in sys.modules
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
    time.sleep(wait)
    return loaded


def test_a_package_whose_import_fails_in_the_workers_is_never_preloaded(site: Path) -> None:
    # It imports in the spawner (no RANK there) and fails in every worker.
    (site / "workerless.py").write_text(
        "import os\n\nif 'RANK' in os.environ:\n    raise ImportError('not in a worker')\n"
    )
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for wait in (2.0, 0.0, 0.0, 0.0):  # the first lets the fork finish its import
            loaded = launcher.run(import_if_it_can, ("workerless", wait)).values()
            assert not any(loaded), "a package whose import failed in the workers was preloaded"


def test_what_a_spawner_handed_over_to_dies_with_the_agent(site: Path) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        before = launcher.run(import_then_wait, ("learnme", 3.0)).values()[0]["spawner"]
        after = launcher.run(import_then_wait, ("learnme", 0.0)).values()[0]["spawner"]
        assert after != before, "the spawner was not succeeded"
        assert not alive(before), "the spawner that handed over lives on"
        agent = psutil.Process(after).ppid()  # the agent adopted its successor
        assert "agent" in " ".join(psutil.Process(agent).cmdline()), "adopted by another"
        os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + GONE_WITHIN
        while alive(after) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(after), "the successor outlived its agent"
        with contextlib.suppress(Exception):  # the launcher finds its agent gone
            launcher.run(import_then_wait, ("learnme", 0.0))


def test_a_look_for_a_package_is_not_noted_as_its_import(site: Path) -> None:
    read_end, write_end = os.pipe()
    notes = import_notes.Notes(write_end, set(sys.modules), early=True)
    try:
        assert importlib.util.find_spec("learnme") is not None  # transformers asks so
        importlib.import_module("learnme")
        notes.report()
        os.set_blocking(read_end, False)
        lines = os.read(read_end, preloads.MAX_BYTES).decode().splitlines()
    finally:
        os.close(read_end)
        sys.modules.pop("learnme", None)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(notes)  # type: ignore[arg-type]
    origin = str(site / "learnme.py")
    assert lines == [f"{preloads.STARTED}learnme\t{origin}", f"learnme\t{origin}"]


def import_then_look(name: str, wait: float) -> list[int]:
    """Imports `name`, then looks up to `wait` s for a fork of this worker's spawner (the
    successor that would import it too): their pids."""
    importlib.import_module(name)
    spawner = psutil.Process(os.getppid())
    deadline = time.monotonic() + wait
    while True:
        forks = [p.pid for p in spawner.children() if p.name() == "slurmrun-spawn"]
        if forks or time.monotonic() > deadline:
            return forks
        time.sleep(0.05)


def test_a_cold_launch_forks_no_successor_and_a_warm_launcher_does(site: Path) -> None:
    # No run follows on a cold launch's agents: a fork importing what its workers import would
    # only take CPU and memory from the run.
    cold = slurmrun.launch(import_then_look, ("learnme", 2.0), **OPTIONS).values()
    assert cold == [[], []], "a one-shot launch's spawner forked a successor"
    with slurmrun.Launcher(**OPTIONS) as launcher:
        warm = launcher.run(import_then_look, ("learnme", 10.0)).values()
    assert all(warm), warm  # the same probe works where a run may follow
