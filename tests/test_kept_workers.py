"""Kept workers (`Launcher(keep_workers=True)`) on localhost: one set of worker processes
serves every run of a warm launcher, with its process group and `slurmrun.worker_state()`;
a failed run, a run whose settings differ or a worker that ended its group gives the next run
new workers, with a warning; nothing is left once the launcher closes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import slurmrun
from tests.test_warm import gone

OPTIONS = {"workers_per_host": 2, "backend": "gloo", "timeout": 120, "keep_workers": True}
WARNING = "has new workers on localhost"


def remember(value: int) -> tuple[int, int, int]:
    """(pid, the process group's id, the all_reduced rank sum), keeping `value`."""
    import torch
    import torch.distributed as dist

    slurmrun.worker_state()["value"] = value
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return os.getpid(), id(dist.group.WORLD), int(t.item())


def recall() -> tuple[int, int, object]:
    import torch.distributed as dist

    print(f"recall on rank {dist.get_rank()}", flush=True)
    return os.getpid(), id(dist.group.WORLD), slurmrun.worker_state().get("value")


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank one")


def test_later_runs_reuse_the_workers_their_group_and_state(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        first = launcher.run(remember, (7,)).values()
        second = launcher.run(recall).values()
        third = launcher.run(recall).values()
        pids = {pid for pid, _, _ in first}
    assert [s for _, _, s in first] == [1, 1]
    assert [(pid, group) for pid, group, _ in first] == [(p, g) for p, g, _ in second]
    assert second == third
    assert [value for _, _, value in second] == [7, 7]
    assert "recall on rank 0" in capfd.readouterr().out  # output of later runs is shown
    assert WARNING not in caplog.text
    assert gone(pids), "close() ends kept workers"


def test_a_failed_run_gives_the_next_one_new_workers_and_says_the_state_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        before = {pid for pid, _, _ in launcher.run(remember, (7,)).values()}
        with pytest.raises(KeyError, match="rank one"):
            launcher.run(fail_on_rank_1)
        after = launcher.run(recall).values()
        again = launcher.run(recall).values()
    assert before.isdisjoint(pid for pid, _, _ in after)
    assert [value for _, _, value in after] == [None, None]  # never the old state
    assert "did not end with every worker's result" in caplog.text
    assert caplog.text.count(WARNING) == 1, caplog.text
    assert {pid for pid, _, _ in after} == {pid for pid, _, _ in again}  # kept from then on


def test_a_changed_environment_gives_new_workers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with slurmrun.Launcher(**OPTIONS, extra_env_vars=("KEPT_TEST_*",)) as launcher:
        before = {pid for pid, _, _ in launcher.run(remember, (7,)).values()}
        monkeypatch.setenv("KEPT_TEST_VAR", "changed")
        after = launcher.run(lambda: (os.getpid(), os.environ["KEPT_TEST_VAR"])).values()
    assert before.isdisjoint(pid for pid, _ in after)
    assert [v for _, v in after] == ["changed", "changed"]
    assert "the run's env differ" in caplog.text


def end_the_group() -> int:
    import torch.distributed as dist

    dist.destroy_process_group()
    return os.getpid()


def test_a_worker_that_ended_its_group_is_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        ended = set(launcher.run(end_the_group).values())
        after = launcher.run(recall).values()
    assert ended.isdisjoint(pid for pid, _, _ in after)
    assert caplog.records and any(WARNING in r.getMessage() for r in caplog.records)


def start_a_sleeper() -> int:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    return child.pid


def test_close_ends_what_kept_workers_started() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        sleepers = set(launcher.run(start_a_sleeper).values())
        assert all(psutil.pid_exists(p) for p in sleepers)  # a kept worker's child lives on
    assert gone(sleepers)


def test_without_keep_workers_every_run_has_new_workers() -> None:
    options = {**OPTIONS, "keep_workers": False}
    with slurmrun.Launcher(**options) as launcher:
        first = {pid for pid, _, _ in launcher.run(remember, (7,)).values()}
        second = launcher.run(recall).values()
    assert first.isdisjoint(pid for pid, _, _ in second)
    assert [value for _, _, value in second] == [None, None]


def sleep_long() -> None:
    time.sleep(60)


def test_ctrl_c_ends_the_kept_workers_and_the_next_run_has_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        before = {pid for pid, _, _ in launcher.run(remember, (7,)).values()}
        timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                launcher.run(sleep_long)
        finally:
            timer.cancel()
        assert gone(before), "Ctrl-C ends the run's kept workers"
        after = launcher.run(recall).values()
    assert before.isdisjoint(pid for pid, _, _ in after)
    assert [value for _, _, value in after] == [None, None]
    assert caplog.text.count(WARNING) == 1, caplog.text


def test_a_kept_worker_stopped_between_runs_is_replaced_not_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SIGSTOP (Ctrl-Z of a tool, a debugger left attached) between runs: the worker is
    # alive but would never take the next run; the run must not hang on it.
    with slurmrun.Launcher(**OPTIONS) as launcher:
        before = {pid for pid, _, _ in launcher.run(remember, (7,)).values()}
        stopped = max(before)
        os.kill(stopped, signal.SIGSTOP)
        # Stopped once it is scheduled to take the signal: on a loaded machine that can be
        # after the next run began, which would then be a run the worker was not stopped for.
        deadline = time.monotonic() + 30.0
        while psutil.Process(stopped).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the worker did not stop within 30 s"
            time.sleep(0.01)
        # (a run that waited for it would go on once this lets it: with the same pid)
        timer = threading.Timer(12.0, os.kill, (stopped, signal.SIGCONT))
        timer.start()
        start = time.monotonic()
        try:
            after = launcher.run(recall).values()
        finally:
            timer.cancel()
        assert time.monotonic() - start < 12.0
        assert gone(before), "the stopped worker (and its group) is ended"
    assert before.isdisjoint(pid for pid, _, _ in after)
    assert [value for _, _, value in after] == [None, None]
    assert "is stopped" in caplog.text, caplog.text
    assert caplog.text.count(WARNING) == 1, caplog.text
