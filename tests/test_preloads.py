"""Learned preloads: a warm launcher's spawners import what the last run's workers imported.

Each test runs a warm launcher on localhost whose workers import packages from a directory
named ``site-packages`` under `tmp_path` (on the path of the launcher and of its agents),
and asks, at the start of a later run, whether the worker found them loaded already: forked
from a spawner that had imported them. Learning happens after a run, in the background, so
later runs are repeated until the answer comes (`later_runs`).
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from slurmrun.node import preloads

OPTIONS: dict[str, Any] = {"workers_per_host": 2, "backend": None, "timeout": 120}
# Learning takes a probe's import and the spawner's own, on a loaded 2-core machine.
LEARN_WITHIN = 60.0
NOT_LEARNED_FOR = 6.0

THREADED = """
import threading, time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``site-packages`` directory with `learnme` and `threaded`, importable everywhere."""
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "learnme.py").write_text("VALUE = 1\n")
    (packages / "threaded.py").write_text(textwrap.dedent(THREADED))
    monkeypatch.syspath_prepend(str(packages))  # the launcher's, which workers get
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")])
    )
    return packages


def loaded_then_import(names: list[str]) -> dict[str, Any]:
    """Which of `names` were loaded when this worker started; then imports them."""
    found = {name: name in sys.modules for name in names}
    for name in names:
        importlib.import_module(name)
    return found


def later_runs(
    launcher: slurmrun.Launcher, names: list[str], done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Runs `loaded_then_import(names)` until every rank's answer is `done`; the last answer."""
    deadline = time.monotonic() + LEARN_WITHIN
    while True:
        answers = launcher.run(loaded_then_import, (names,)).values()
        if all(done(a) for a in answers) or time.monotonic() > deadline:
            return answers[0]
        time.sleep(0.2)


def test_a_package_imported_by_one_run_is_loaded_when_a_later_run_starts(site: Path) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        first = launcher.run(loaded_then_import, (["learnme"],)).values()
        assert [a["learnme"] for a in first] == [False, False]
        later = later_runs(launcher, ["learnme"], lambda a: a["learnme"])
        assert later["learnme"], "the spawner never preloaded what run 1 imported"


def test_with_learning_off_every_run_imports_it_again(site: Path) -> None:
    with slurmrun.Launcher(**OPTIONS, learn_preloads=False) as launcher:
        launcher.run(loaded_then_import, (["learnme"],))
        # Learning it takes about a second here: runs for longer see whether it came.
        deadline = time.monotonic() + NOT_LEARNED_FOR
        while time.monotonic() < deadline:
            answers = launcher.run(loaded_then_import, (["learnme"],)).values()
            assert not any(a["learnme"] for a in answers), "learning is off, yet it was learned"
            time.sleep(0.2)


def test_a_package_that_starts_a_thread_at_import_is_never_preloaded(site: Path) -> None:
    names = ["threaded", "learnme"]  # the unsafe one first: the probe stops at it
    with slurmrun.Launcher(**OPTIONS) as launcher:
        launcher.run(loaded_then_import, (names,))
        later = later_runs(launcher, names, lambda a: a["learnme"])
        assert later["learnme"], "learnme was never preloaded"
        assert not later["threaded"], "the spawner imported a package that starts a thread"


def test_torch_is_preloaded_without_a_process_group(site: Path) -> None:
    with slurmrun.Launcher(**OPTIONS, learn_preloads=False) as launcher:
        later = later_runs(launcher, ["torch"], lambda a: a["torch"])
        assert later["torch"], "a later run with backend=None started without torch"


def test_the_report_is_cut_to_its_bounds_not_failed() -> None:
    many = {f"pkg{i}": f"/x/site-packages/pkg{i}/__init__.py" for i in range(1000)}
    data = preloads.encode(many)
    assert len(data) <= preloads.MAX_BYTES
    assert len(preloads.decode(data)) <= preloads.MAX_NAMES
    long = {"a" * 500: "/x/site-packages/a.py", "ok": "/x/site-packages/ok.py"}
    assert list(preloads.decode(preloads.encode(long))) == ["ok"]


def test_only_installed_top_level_packages_are_reported() -> None:
    class Module:
        def __init__(self, path: str) -> None:
            self.__file__ = path

    modules = {
        "pkg": Module("/env/lib/python3.11/site-packages/pkg/__init__.py"),
        "pkg.sub": Module("/env/lib/python3.11/site-packages/pkg/sub.py"),
        "mine": Module("/home/me/project/mine.py"),  # the user's own: may be edited
        "json": Module("/usr/lib/python3.11/json/__init__.py"),  # the standard library
        "known": Module("/env/lib/python3.11/site-packages/known.py"),
    }
    assert list(preloads.installed_top_level(modules, known=["known"])) == ["pkg"]


def test_a_package_whose_import_hangs_is_skipped_once_the_probe_is_late(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (site / "hangs.py").write_text("import time\ntime.sleep(3600)\n")
    monkeypatch.setattr(preloads, "PROBE_TIMEOUT", 1.0)
    learned = preloads.Preloads(later=[], learn=True)
    learned.pending = {"hangs": str(site / "hangs.py"), "learnme": str(site / "learnme.py")}
    learned.between_runs(idle=True)  # forks the probe, which hangs in its first import
    probe_until_done(learned)
    assert learned.probe is None, "the probe outlived its deadline"
    assert learned.skipped == {"hangs"}
    assert learned.pending == {"learnme": str(site / "learnme.py")}, "the rest waits its turn"
    assert "hangs" not in sys.modules


def probe_until_done(learned: preloads.Preloads) -> None:
    """Runs `learned`'s probe to its end, as the spawner's loop would, with a run in progress."""
    probe = learned.probe
    assert probe is not None
    deadline = time.monotonic() + 60
    while learned.probe is not None and time.monotonic() < deadline:
        select.select(learned.fds(), [], [], learned.timeout())
        learned.between_runs(idle=False)
    os.waitpid(probe.pid, 0)


def test_a_package_that_initialises_cuda_at_import_is_never_preloaded(site: Path) -> None:
    # No GPU needed: the package makes torch say what `torch.cuda.init()` would leave.
    (site / "cudainit.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    importlib.import_module("torch")  # here already, as in the spawner: its thread is no news
    learned = preloads.Preloads(later=[], learn=True)
    learned.pending = {"cudainit": str(site / "cudainit.py")}
    learned.between_runs(idle=True)
    probe_until_done(learned)
    assert learned.skipped == {"cudainit"}
    assert learned.safe == []


# ---------------------------------------------------------------- what an import changes


def log_a_record(marker: str, names: list[str]) -> dict[str, Any]:
    """Which of `names` were loaded when this worker started; imports them; logs `marker`."""
    found = loaded_then_import(names)
    logging.getLogger("user.code").warning(marker)
    return found


def test_a_package_that_configures_logging_at_import_leaves_each_record_shown_once(
    site: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # logging.basicConfig() at import: in a fresh worker, a no-op (slurmrun's handler is on
    # the root logger already); imported in the spawner, a root StreamHandler for every worker.
    (site / "configures.py").write_text("import logging\n\nlogging.basicConfig()\n")
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))
    names = ["configures", "learnme"]  # the probe judges both before learnme is preloaded
    markers = []
    with slurmrun.Launcher(**OPTIONS) as launcher:
        deadline = time.monotonic() + LEARN_WITHIN
        while True:
            markers.append(f"record of run {len(markers) + 1}.")  # run 10's has run 1's prefix
            answer = launcher.run(log_a_record, (markers[-1], names)).values()[0]
            if answer["learnme"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert answer["learnme"], "learnme was never preloaded"
    assert len(markers) >= 2
    out, err = capfd.readouterr()
    (log_file,) = (tmp_path / "logs").glob("20*/localhost.0.log")
    in_file = log_file.read_text()
    for marker in markers:
        assert (out + err).count(marker) == 1, f"{marker!r} shown {(out + err).count(marker)} times"
        assert in_file.count(marker) == 1, f"{marker!r} in the file {in_file.count(marker)} times"
    assert not answer["configures"], "a package that configured logging was preloaded"


def test_the_probe_refuses_what_an_import_changes_in_the_process(site: Path) -> None:
    changes = {
        # (basicConfig() is a no-op here: pytest's handlers are on the root logger)
        "logging": "import logging\nlogging.getLogger().addHandler(logging.StreamHandler())\n",
        "signals": "import signal\nsignal.signal(signal.SIGUSR2, lambda *a: None)\n",
        "hooks": "import sys\nsys.excepthook = lambda *a: None\n",
        "faulthandler": "import faulthandler as f\nf.disable() if f.is_enabled() else f.enable()\n",
        "cwd": "import os\nos.chdir('/')\n",
        "environ": "import os\nos.environ['SET_AT_IMPORT'] = '1'\n",
        "stdio": "import io, sys\nsys.stdout = io.StringIO()\n",
        "sys_path": "import sys\nsys.path.append('/nowhere')\n",
    }
    for what, code in changes.items():
        (site / f"changes_{what}.py").write_text(code)
    learned = preloads.Preloads(later=[], learn=True)
    for what in changes:  # one probe each: a probe stops at the first unsafe import
        learned.pending = {f"changes_{what}": str(site / f"changes_{what}.py")}
        learned.between_runs(idle=True)
        probe_until_done(learned)
        assert f"changes_{what}" in learned.skipped, f"an import that changes {what} was approved"
    learned.pending = {"learnme": str(site / "learnme.py")}
    learned.between_runs(idle=True)
    probe_until_done(learned)
    assert learned.safe == ["learnme"], "a package that changes nothing was refused"


def test_a_change_the_probe_did_not_see_is_undone_in_the_spawner_and_learning_stops(
    site: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # As if its import did something else in the probe: the spawner imports it (here).
    (site / "sometimes.py").write_text(
        "import logging, os\n"
        "os.environ['SET_AT_IMPORT'] = '1'\n"
        "logging.getLogger().addHandler(logging.StreamHandler())\n"
    )
    monkeypatch.delenv("SET_AT_IMPORT", raising=False)
    handlers = list(logging.getLogger().handlers)
    learned = preloads.Preloads(later=[], learn=True)
    learned.safe = ["sometimes"]
    learned.between_runs(idle=True)
    assert "SET_AT_IMPORT" not in os.environ
    assert logging.getLogger().handlers == handlers
    assert "sometimes" not in sys.modules, "workers must import it themselves"
    assert not learned.learn
    assert "changed logging, environ here although a probe did not" in capfd.readouterr().err
