"""Every rank's stacks during a run on localhost: on demand, from a stuck worker, on a stall,
on Ctrl-C and on a failure; and the flight recorder's switch on the CPU path."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import slurmrun
from slurmrun.events import Event
from slurmrun.stacks import control
from slurmrun.stacks.control import ControlError
from slurmrun.stacks.report import StackSource

REPO = Path(__file__).resolve().parents[1]
LIMIT = 120


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def _reports(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "logs").glob("2*/stacks/stacks-*.txt"))


def _wait_for(path: Path, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def hang_until(release: str, started: str) -> int:
    """Rank 1 waits for `release` in `slow_rank`; the others wait for it in all_reduce."""
    import pathlib

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()

    def slow_rank() -> None:
        while not pathlib.Path(release).exists():
            time.sleep(0.05)

    pathlib.Path(f"{started}{rank}").touch()
    if rank == 1:
        slow_rank()
    dist.all_reduce(torch.ones(1))
    return rank


def test_stacks_from_another_thread_group_the_ranks_and_show_the_odd_one(
    tmp_path: Path,
) -> None:
    launcher = slurmrun.Launcher(workers_per_host=3, backend="gloo")
    assert launcher.stacks() is None  # no run yet
    release, started = tmp_path / "release", tmp_path / "started"
    results: list[object] = []
    runner = threading.Thread(
        target=lambda: results.append(launcher.run(hang_until, (str(release), str(started))))
    )
    runner.start()
    try:
        for rank in range(3):
            _wait_for(Path(f"{started}{rank}"))
        time.sleep(0.5)  # into the all_reduce
        report = launcher.stacks(timeout=10)
    finally:
        release.touch()
        runner.join(LIMIT)
    assert report is not None
    assert [r.rank for r in report.ranks] == [0, 1, 2]
    assert all(r.source is StackSource.PYTHON for r in report.ranks)
    groups = {tuple(ranks): stacks for ranks, stacks in report.groups()}
    assert set(groups) == {(0, 2), (1,)}
    assert groups[(1,)].threads[0].frames[-1].function == "slow_rank"
    assert groups[(0, 2)].threads[0].frames[-1].function == "all_reduce"
    lines = report.summary().splitlines()
    assert lines[0].startswith("ranks 0, 2: waiting: all_reduce (distributed_c10d.py:")
    assert lines[1].startswith("rank 1 (localhost): working: slow_rank (test_stacks_launch.py:")
    assert "MainThread" in report.format()
    written = _reports(tmp_path)
    assert len(written) == 1 and "ranks 0, 2: waiting: all_reduce" in written[0].read_text()
    assert results and results[0].return_values == [[0, 1, 2]]  # type: ignore[attr-defined]


WAITING_DRIVER = """\
import pathlib
import sys
import threading
import time

import slurmrun


def waiting(flag):
    pathlib.Path(flag + ".started").touch()
    while not pathlib.Path(flag).exists():
        time.sleep(0.05)  # the line the stacks show
    return 1


if __name__ == "__main__":
    flag = sys.argv[1]
    with slurmrun.Launcher(workers_per_host=1, backend=None) as launcher:
        runner = threading.Thread(target=launcher.run, args=(waiting, (flag,)))
        runner.start()
        while not pathlib.Path(flag + ".started").exists():
            time.sleep(0.05)
        report = launcher.stacks(timeout=10)
        pathlib.Path(flag).touch()
        runner.join(60)
    print(report.format())
"""


def test_stacks_of_a_function_of_the_driver_script_name_its_file_and_line(
    tmp_path: Path,
) -> None:
    # The function is pickled by value (cloudpickle 3 renames its file "<dynamic-code>").
    driver = tmp_path / "driver.py"
    driver.write_text(WAITING_DRIVER)
    done = subprocess.run(
        [sys.executable, str(driver), str(tmp_path / "flag")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 (localhost): working: waiting (driver.py:12)" in done.stdout, done.stdout
    assert f'  File "{driver}", line 12, in waiting\n' in done.stdout, done.stdout
    assert "    time.sleep(0.05)  # the line the stacks show\n" in done.stdout, done.stdout


def hold_the_gil(started: str) -> str:
    """Seconds in C code that holds the GIL (a regex backtracking): no thread can answer."""
    import pathlib
    import re

    pathlib.Path(started).touch()
    re.match(r"(x+x+)+y", "x" * 28)  # ~6 s; signals do not interrupt it
    return "done"


def test_a_worker_holding_the_gil_is_dumped_by_faulthandler(tmp_path: Path) -> None:
    launcher = slurmrun.Launcher(workers_per_host=1, backend=None)
    started = tmp_path / "started"
    results: list[object] = []
    runner = threading.Thread(
        target=lambda: results.append(launcher.run(hold_the_gil, (str(started),)))
    )
    runner.start()
    try:
        _wait_for(started)
        time.sleep(0.3)
        report = launcher.stacks(timeout=10)
    finally:
        runner.join(LIMIT)
    assert report is not None
    (rank0,) = report.ranks
    assert rank0.source is StackSource.FAULTHANDLER, rank0
    functions = [f.function for t in rank0.threads for f in t.frames]
    assert "hold_the_gil" in functions, rank0
    assert "faulthandler" in report.format()
    assert results  # the worker went on and returned


def quiet(seconds: float) -> int:
    def silent_phase() -> None:
        time.sleep(seconds)

    silent_phase()
    return 1


def test_a_stall_dumps_every_rank_once_emits_stalled_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[Event] = []
    result = slurmrun.launch(
        quiet, (4.0,), workers_per_host=2, backend=None, stall_timeout=1.5, on_event=events.append
    )
    assert result.return_values == [[1, 1]]
    stalled = [e for e in events if e.kind == "stalled"]
    assert len(stalled) == 1, [e.kind for e in events]
    assert stalled[0].seconds == 1.5  # type: ignore[attr-defined]
    summary = stalled[0].summary  # type: ignore[attr-defined]
    assert summary.startswith("ranks 0-1: working: silent_phase (test_stacks_launch.py:"), summary
    assert "<- quiet (test_stacks_launch.py:" in summary, summary
    assert Path(stalled[0].stacks_file).is_file()  # type: ignore[attr-defined]
    assert _reports(tmp_path) == [Path(stalled[0].stacks_file)]  # type: ignore[attr-defined]
    assert "no rank wrote output, returned or failed for 1.5 s" in caplog.text


def test_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
        slurmrun.launch(quiet, (0,), workers_per_host=1, stall_timeout=0)


def fail_on_rank_0(started: str) -> None:
    import pathlib

    rank = int(os.environ["RANK"])
    pathlib.Path(f"{started}{rank}").touch()
    if rank == 0:
        while not pathlib.Path(f"{started}1").exists():
            time.sleep(0.05)
        time.sleep(0.3)
        raise ValueError("rank 0 gives up")

    def waiting_for_nothing() -> None:
        time.sleep(60)

    waiting_for_nothing()


def test_a_failed_run_notes_where_the_ranks_still_running_were(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank 0 gives up") as caught:
        slurmrun.launch(fail_on_rank_0, (str(tmp_path / "started"),), workers_per_host=2,
                        backend=None)  # fmt: skip
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "slurmrun: where the ranks still running were:" in notes, notes
    line = "rank 1 (localhost): working: waiting_for_nothing (test_stacks_launch.py:"
    assert line in notes, notes
    assert "rank 0" not in notes.split("were:")[1].split("(every")[0], notes
    assert len(_reports(tmp_path)) == 1


CTRL_C = """
import time, slurmrun

def stuck(marker):
    import pathlib
    pathlib.Path(marker).touch()
    def stuck_here():
        time.sleep(120)
    stuck_here()

slurmrun.launch(stuck, ({marker!r},), workers_per_host=2, backend=None)
"""


def test_ctrl_c_dumps_every_rank_before_the_workers_stop(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (tmp_path / "driver.py").write_text(CTRL_C.format(marker=str(marker)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "driver.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(marker)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "slurmrun: Ctrl-C: where each rank was:" in err, err
    assert "ranks 0-1: working: stuck_here (driver.py:8) <- stuck (driver.py:9)" in err, err
    assert "KeyboardInterrupt" in err
    assert len(_reports(tmp_path)) == 1


def recorder_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}


def test_the_flight_recorder_switch_reaches_workers_and_gloo_runs_on(tmp_path: Path) -> None:
    result = slurmrun.launch(recorder_env, workers_per_host=2, backend="gloo", flight_recorder=True)
    (log_dir,) = (tmp_path / "logs").glob("2*")
    where = log_dir / "flight_recorder"
    assert where.is_dir()
    for seen in result.return_values[0]:
        assert seen["TORCH_FR_BUFFER_SIZE"] == seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
        assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert seen["TORCH_FR_DUMP_TEMP_FILE"] == f"{where}/nccl_trace_rank_"
    unset = slurmrun.launch(recorder_env, workers_per_host=1, backend="gloo")
    assert "TORCH_FR_BUFFER_SIZE" not in unset.rank(0)


def test_no_quiet_spell_counts_while_the_spawner_imports_before_forking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spawner imports SLURMRUN_PRELOAD's modules before it forks the first run's workers:
    # here one that takes 3 s, longer than the stall timeout. The run is not stalled meanwhile.
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    monkeypatch.setenv("SLURMRUN_PRELOAD", "slow_preload")
    events: list[Event] = []
    result = slurmrun.launch(
        quiet, (0.5,), workers_per_host=1, backend=None, stall_timeout=1.5, on_event=events.append
    )
    assert result.return_values == [[1]]
    kinds = [e.kind for e in events]
    assert "stalled" not in kinds, kinds
    assert kinds.index("workers_started") > kinds.index("launch_started")


def wait_for_release(started: str, release: str) -> int:
    import pathlib

    pathlib.Path(started).touch()

    def held_here() -> None:
        while not pathlib.Path(release).exists():
            time.sleep(0.05)

    held_here()
    return 7


def test_a_stacks_request_with_a_bad_timeout_is_refused_during_a_run_and_later_ones_answered(
    tmp_path: Path,
) -> None:
    launcher = slurmrun.Launcher(workers_per_host=1, backend=None)
    started, release = tmp_path / "started", tmp_path / "release"
    results: list[object] = []
    runner = threading.Thread(
        target=lambda: results.append(launcher.run(wait_for_release, (str(started), str(release))))
    )
    runner.start()
    try:
        _wait_for(started)
        (entry,) = [e for e in control.launchers() if e.pid == os.getpid()]
        for bad in (math.nan, -1.0, 0, math.inf):
            with pytest.raises(ControlError, match="the request's timeout must be a number"):
                control.ask(entry, "stacks", {"timeout": bad}, timeout=10)
            with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
                launcher.stacks(bad)
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            launcher.stacks(1e9)
        # Cut to 300 s, and answered as soon as every rank answered.
        text = control.ask(entry, "stacks", {"timeout": 1e9}, timeout=20)
        assert "Python stacks of 1 rank" in text, text
        assert "rank 0 (localhost): working: held_here (test_stacks_launch.py:" in text, text
        report = launcher.stacks(10)
        assert report is not None and report.ranks[0].source is StackSource.PYTHON
    finally:
        release.touch()
        runner.join(LIMIT)
    assert results and results[0].return_values == [[7]]  # type: ignore[attr-defined]
