"""Helpers of the SLURM tests that are plain functions, not fixtures (those are in conftest.py).

Imported as ``from tests.slurm.slurm_helpers import ...``, as the tests import conftest's.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import slurmrun

REPO = Path(__file__).resolve().parents[2]


def project_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str, source: str
) -> Iterator[ModuleType]:
    """Yields `source` as a module importable here only through sys.path, for a fixture.

    Its name is `prefix` and a suffix of this test's own; jobs are submitted from tmp_path (the
    job's working directory: it counts as this session's) and import this checkout's slurmrun.
    """
    project = tmp_path / "project"
    project.mkdir()
    name = f"{prefix}_{abs(hash(str(tmp_path)))}"
    (project / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


@contextlib.contextmanager
def cancelled_on_failure(*jobs: slurmrun.SubmittedLaunch[object]) -> Iterator[None]:
    """Cancels `jobs` when the block raises (and re-raises)."""
    try:
        yield
    except BaseException:
        for job in jobs:
            with contextlib.suppress(Exception):
                job.cancel()
        raise


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    every: float = 0.2,
    job_id: str | None = None,
    output: Callable[[], str] | None = None,
) -> None:
    """Polls `predicate` every `every` s until it is true; fails the test after `timeout` s.

    The failure says that `what` did not happen; with `job_id`, the job is cancelled first, and
    with `output`, what it returns (the job's output) is shown.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            message = f"{what} did not happen within {timeout} s"
            if job_id is not None:
                subprocess.run(["scancel", job_id], check=False, timeout=30)
                message += f" (job {job_id} cancelled)"
            if output is not None:
                message += f"\n--- job output\n{output()}"
            pytest.fail(message)
        time.sleep(every)


# The end of a driver script run in an allocation (it has `os`, `subprocess`, `time` and
# `emit`): waits, 60 s at most, until the job's agents' steps have ended (the agents' step
# ends long before the heartbeat timeout), and emits the steps left (``STEPS_LEFT``).
EMIT_STEPS_LEFT = """
job = os.environ["SLURM_JOB_ID"]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"],
                           capture_output=True, text=True).stdout.split()
    left = [s for s in steps if s.split(".")[-1].isdigit()]
    if not left:
        break
    time.sleep(0.2)
emit("STEPS_LEFT", left)
"""


def emitted_lines(cp: subprocess.CompletedProcess[str], name: str) -> list[object]:
    """The values a driver's ``emit(name, value)`` printed (JSON after the name), at least one."""
    found = [json.loads(x[len(name) + 1 :]) for x in cp.stdout.splitlines() if x.startswith(name)]
    assert found, f"no {name} line\n--- stdout\n{cp.stdout}\n--- stderr\n{cp.stderr}"
    return found
