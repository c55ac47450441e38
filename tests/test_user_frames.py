"""The exception a run raises shows the user's call line and the worker's traceback, not slurmrun's.

Issue 46, item 6: a worker's error, or a Ctrl-C while a run waits, printed ten frames of the
launcher's machinery (driver.py, attempts.py, warm.py, run.py, pump.py, pool.py, verdicts.py)
before the user's error. They are hidden now, and kept as ``slurmrun_traceback`` and in the
DEBUG log.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import slurmrun
from slurmrun.errors import RemoteTraceback, WorkerFailedError
from slurmrun.launcher.boundary import hide_internal_frames

PACKAGE = str(Path(slurmrun.__file__).parent)

DRIVER = """\
import sys
import time

import slurmrun


def helper(table):
    return table["missing"]  # the raising line


def work(mode):
    if mode == "sleep":
        print("ready", flush=True)
        time.sleep(60)
    return helper({})  # the worker call


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "warm":
        with slurmrun.Launcher(workers_per_host=2, backend=None) as launcher:
            launcher.run(work, ("raise",))  # the warm call line
    else:
        slurmrun.launch(work, (mode,), workers_per_host=2, backend=None)  # the call line
"""


def _driver(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(Path(PACKAGE).parent)}
    return subprocess.Popen(
        [sys.executable, "driver.py", mode],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(marker: str) -> int:
    """The line of `DRIVER` that carries the comment `marker`."""
    return next(n for n, line in enumerate(DRIVER.splitlines(), 1) if f"# {marker}" in line)


def _file_lines(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.splitlines() if line.strip().startswith("File ")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "call"), [("raise", "the call line"), ("warm", "the warm call line")]
)
def test_a_workers_error_prints_the_call_line_and_remote_frames_only(tmp_path, mode, call):
    process = _driver(tmp_path, mode)
    _, stderr = process.communicate(timeout=50)
    assert process.returncode == 1, stderr
    files = _file_lines(stderr)
    assert not [line for line in files if PACKAGE in line], stderr
    script = tmp_path / "driver.py"
    assert files == [
        f'File "{script}", line {_line("the worker call")}, in work',  # the remote traceback
        f'File "{script}", line {_line("the raising line")}, in helper',
        f'File "{script}", line {_line(call)}, in <module>',  # the call site
    ], stderr
    assert f"# {call}" in stderr  # with its source line
    assert stderr.rstrip().splitlines()[-2] == "KeyError: 'missing'"
    assert "The above exception was the direct cause of the following exception" in stderr


@pytest.mark.timeout(60)
def test_ctrl_c_while_a_run_waits_prints_the_call_line_only(tmp_path):
    process = _driver(tmp_path, "sleep")
    assert process.stdout is not None
    assert "ready" in process.stdout.readline()  # rank 0 is sleeping: the run waits
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGINT, stderr
    files = _file_lines(stderr)
    assert files == [f'File "{tmp_path / "driver.py"}", line {_line("the call line")}, in <module>']
    assert stderr.rstrip().endswith("KeyboardInterrupt")


def _raise_in_helper() -> None:
    raise KeyError("missing")


def _exit_quietly() -> None:
    os._exit(3)


@pytest.mark.timeout(60)
def test_the_whole_traceback_is_kept_on_the_exception_and_logged_at_debug(caplog):
    at_debug = caplog.at_level(logging.DEBUG, logger="slurmrun")
    with at_debug, pytest.raises(KeyError) as info:  # the worker's type, caught as before
        slurmrun.launch(_raise_in_helper, workers_per_host=1, backend=None)
    exc = info.value
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "_raise_in_helper" in exc.__cause__.text
    shown = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    assert shown == [__file__], shown  # this test's frame only
    whole = exc.slurmrun_traceback  # the frames hidden, as text (the exception still pickles)
    assert whole.startswith("Traceback (most recent call last):"), whole
    assert os.path.join("launcher", "verdicts.py") in whole, whole  # from `run` in
    assert type(pickle.loads(pickle.dumps(exc))) is KeyError
    logged = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert logged and logged[0].exc_info is not None and logged[0].exc_info[1] is exc
    text = logging.Formatter().formatException(logged[0].exc_info)
    assert "verdicts.py" in text and "pump.py" in text


@pytest.mark.timeout(60)
def test_a_worker_that_dies_raises_workerfailederror_without_slurmrun_frames():
    with pytest.raises(WorkerFailedError) as info:
        slurmrun.Launcher(workers_per_host=1, backend=None).run(_exit_quietly)
    shown = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert shown == [__file__], shown


def test_an_internal_bug_keeps_its_whole_traceback():
    # Only what the user meets is trimmed: slurmrun's own bug keeps the frames that find it.
    with pytest.raises(AttributeError) as info:  # a bug inside slurmrun: no __traceback__
        hide_internal_frames(None)  # type: ignore[arg-type]
    exc = info.value
    before = traceback.extract_tb(exc.__traceback__)
    assert any(frame.filename.startswith(PACKAGE) for frame in before), before
    hide_internal_frames(exc)
    assert traceback.extract_tb(exc.__traceback__) == before
    assert not hasattr(exc, "slurmrun_traceback")
