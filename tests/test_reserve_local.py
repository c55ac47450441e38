"""A reservation's keeper outside SLURM (``--job-id``): kept workers serve launchers that are
separate processes, one after another, and nothing is left once the keeper ends.

The cluster tests (tests/slurm/test_reserve*_slurm.py) run the keeper as a job's batch step;
this one runs it on localhost, as the GPU suite does on a machine without SLURM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from slurmrun.reservations import ReservationRecord

REPO = Path(__file__).resolve().parents[1]
JOB = "424242"
WITHIN = 60.0  # the keeper's agents ready, a launcher's run, processes gone: a loaded machine

DRIVER = textwrap.dedent(
    """
    import json, os, sys

    import psutil

    import slurmrun


    def count() -> tuple[int, int, int]:
        state = slurmrun.worker_state()
        state["runs"] = state.get("runs", 0) + 1
        return os.getpid(), state["runs"], psutil.Process().parent().parent().pid


    with slurmrun.Launcher(job=sys.argv[1], keep_workers=True, backend="gloo", timeout=60) as l:
        print(json.dumps(l.run(count).values()))
    """
)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The keeper's and the launchers' environment: records of the test's own, no SLURM."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**keep, "PYTHONPATH": path, "SLURMRUN_WORKERS_PER_HOST": "2"}


def _alive(pids: set[int]) -> set[int]:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {pid for pid in pids if running(pid)}


def _wait_record(keeper: subprocess.Popen[bytes], log: Path) -> ReservationRecord:
    deadline = time.monotonic() + WITHIN
    while (record := ReservationRecord.read(JOB)) is None:
        if keeper.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the keeper did not write its record: {log.read_text()}")
        time.sleep(0.1)
    return record


def test_kept_workers_of_a_keeper_without_slurm_serve_launchers_one_after_another(
    tmp_path: Path, env: dict[str, str]
) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    log = tmp_path / "keeper.log"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "slurmrun.batch.keeper", "--job-id", JOB,
         "--folder", str(tmp_path / "jobs"), "--idle-timeout", "120"],
        env=env, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        record = _wait_record(keeper, log)
        command = [sys.executable, str(driver), JOB]
        runs = [
            json.loads(
                subprocess.run(
                    command,
                    env=env,
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=WITHIN,
                    check=True,
                ).stdout.splitlines()[-1]
            )
            for _ in range(2)
        ]
        workers = {pid for pid, _, _ in runs[0]}
        agents = {agent for _, _, agent in runs[0]}
        assert len(workers) == 2, runs
        assert runs[1] == [[pid, 2, agent] for pid, _, agent in runs[0]], (
            f"the second launcher should find the first's workers and their state: {runs}"
        )
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(WITHIN) == 0, log.read_text()
        deadline = time.monotonic() + WITHIN
        while _alive(workers | agents) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(workers | agents)
        assert not left, f"{left} left running after the keeper ended: {log.read_text()}"
        assert ReservationRecord.read(JOB) is None, "the record outlived its keeper"
        assert f"launchers attach at {record.host}:{record.port}" in log.read_text()
    finally:
        if keeper.poll() is None:
            os.killpg(keeper.pid, signal.SIGKILL)
            keeper.wait()


def test_a_keeper_outside_slurm_without_a_job_id_says_what_to_pass(
    tmp_path: Path, env: dict[str, str]
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "slurmrun.batch.keeper", "--folder", str(tmp_path),
         "--idle-timeout", "1"],
        env=env, capture_output=True, text=True, timeout=WITHIN, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--job-id is needed outside a SLURM job" in out.stderr
