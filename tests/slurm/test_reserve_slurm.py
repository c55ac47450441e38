"""slurmrun.reserve: a job that keeps agents for launchers outside it, from the login side.

The launchers here run where pytest runs (the root namespace, no SLURM_* variables): the
test process itself, and processes of their own after it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import slurmrun
from slurmrun.authentication import client_handshake
from slurmrun.reservations import ReservationError, ReservationRecord
from slurmrun.slurm.queue import FINAL_STATES

JOB_NAME = "slurmrun-test"  # the conftest's: its clean-state check knows it
NOBODY = 65534


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config directory of the test's own: reservation records go there (the job's too).

    The test runs in tmp_path: the jobs it submits, and their processes on the nodes, are
    this session's for conftest (their SLURM_SUBMIT_DIR), which checks that none are left.
    """
    path = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
    monkeypatch.chdir(tmp_path)
    return path


def _reserve(tmp_path: Path, **kwargs: object) -> slurmrun.Reservation:
    params = {"job_name": JOB_NAME}
    return slurmrun.reserve(folder=tmp_path / "jobs", slurm_parameters=params, **kwargs)  # type: ignore[arg-type]


def where(scale: int) -> tuple[str, int]:
    print("rank", os.environ["RANK"], "on", os.environ["SLURMD_NODENAME"])
    return os.environ["SLURMD_NODENAME"], int(os.environ["RANK"]) * scale


def _two_nodes(result: slurmrun.LaunchResult[object]) -> tuple[str, str]:
    """The reservation's 2 nodes, in the run's order: SLURM's choice (node1 and node2 when they
    have room; another test's jobs may fill node1 a moment)."""
    first, second = result.hostnames
    assert first != second and {first, second} <= {"node1", "node2", "node3"}, result.hostnames
    return first, second


def fails() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 fails")  # the raising line


def pid() -> int:
    return os.getpid()


_SECOND_LAUNCHER = """
import sys, time
sys.path.insert(0, {tests!r})
import slurmrun
from test_reserve_slurm import where
started = time.monotonic()
print(slurmrun.launch(where, (5,), job={job!r}, timeout=60).values())
print("seconds", time.monotonic() - started)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
@pytest.mark.usefixtures("slurm_cluster", "config")
def test_launchers_outside_the_job_run_on_its_agents_until_it_is_released(
    tmp_path, run_cmd, node_processes, capfd
):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        assert reservation.state == "RUNNING"
        result = slurmrun.launch(where, (3,), job=reservation.job_id, timeout=60, show_ranks="all")
        one, two = _two_nodes(result)
        assert result.values() == [(one, 0), (two, 3)]
        assert f"rank 1 on {two}" in capfd.readouterr().out
        with pytest.raises(KeyError, match="rank 1 fails") as info:
            slurmrun.launch(fails, job=reservation.job_id, timeout=60)
        assert 'raise KeyError("rank 1 fails")  # the raising line' in str(info.value.__cause__)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60, keep_workers=True) as warm:
            first = warm.run(pid).values()
            assert warm.run(pid).values() == first  # the same workers: a warm run
        script = _SECOND_LAUNCHER.format(tests=str(Path(__file__).parent), job=reservation.job_id)
        out = run_cmd([sys.executable, "-c", script], timeout=90).stdout
        assert f"[({one!r}, 0), ({two!r}, 5)]" in out, out
        assert float(out.split("seconds")[1]) < 1.0, out  # its first run, past its imports
        started = time.monotonic()
    assert reservation.state in FINAL_STATES
    assert time.monotonic() - started < 10
    assert node_processes() == {}
    with pytest.raises(ReservationError, match=f"no reservation {reservation.job_id} of yours"):
        slurmrun.launch(where, (1,), job=reservation.job_id)


def large(n: int) -> bytes:
    return b"x" * n


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_large_results_come_on_connections_of_their_own_through_the_keeper(
    tmp_path, node_processes
):
    # A result of 4 MiB or more comes on a worker's own connection, which the keeper bridges to
    # the launcher; were it refused, the agent would try for 2 s before relaying it itself.
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60) as launcher:
            launcher.run(large, (10,))
            started = time.monotonic()
            values = launcher.run(large, (8 << 20,)).values()
            seconds = time.monotonic() - started
    assert values == [b"x" * (8 << 20)] * 2
    assert seconds < 1.5
    assert node_processes() == {}


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_a_launch_waits_for_a_pending_reservation_saying_why(tmp_path, capfd, node_processes):
    params = {"job_name": JOB_NAME, "hold": True}  # pending until released below
    reservation = slurmrun.reserve(
        nodes=2, time_min=5, idle_timeout=120, folder=tmp_path / "jobs", slurm_parameters=params
    )
    with reservation:
        held = lambda: subprocess.run(["scontrol", "release", reservation.job_id], check=True)  # noqa: E731
        timer = threading.Timer(2.0, held)
        timer.start()
        try:
            result = slurmrun.launch(where, (1,), job=reservation.job_id, timeout=60)
        finally:
            timer.cancel()
        first, second = _two_nodes(result)
        assert result.values() == [(first, 0), (second, 1)]
    err = capfd.readouterr().err
    assert f"waiting for reservation {reservation.job_id}: PENDING (JobHeldUser" in err, err
    assert node_processes() == {}


_BUSY = """
import slurmrun, time
started = time.monotonic()
try:
    slurmrun.launch(print, job={job!r}, timeout=3)
except Exception as e:
    print(type(e).__name__, e)
print("seconds", time.monotonic() - started)
"""


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_one_launcher_at_a_time_the_next_waits_up_to_its_timeout(tmp_path, run_cmd, node_processes):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60) as first:
            first.run(pid)
            out = run_cmd([sys.executable, "-c", _BUSY.format(job=reservation.job_id)]).stdout
            first.run(pid)  # still its own
        assert out.startswith(
            f"ReservationBusy reservation {reservation.job_id}: a launcher (pid {os.getpid()} on "
        ), out
        assert 3 <= float(out.split("seconds")[1]) < 8, out
        assert len(slurmrun.launch(pid, job=reservation.job_id, timeout=60).values()) == 2
    assert node_processes() == {}


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_through_srun_overlap_where_the_keepers_port_is_not_used(
    tmp_path, monkeypatch, capfd, node_processes
):
    # What a launcher does where nodes and login node cannot reach each other's ports: its
    # connections to the keeper go through the stdin and stdout of srun --jobid --overlap.
    monkeypatch.setenv("SLURMRUN_RESERVE_VIA", "srun")
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        result = slurmrun.launch(where, (3,), job=reservation.job_id, timeout=60)
        first, second = _two_nodes(result)
        assert result.values() == [(first, 0), (second, 3)]
        with pytest.raises(KeyError, match="rank 1 fails"):
            slurmrun.launch(fails, job=reservation.job_id, timeout=60)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60) as launcher:
            assert launcher.run(large, (5 << 20,)).values() == [b"x" * (5 << 20)] * 2
            assert len(launcher.run(pid).values()) == 2
    assert "does not answer" not in capfd.readouterr().err  # asked for, not fallen back to
    assert node_processes() == {}  # the relays' steps too


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_a_launcher_quiet_between_runs_keeps_the_agents_past_the_heartbeat_timeout(
    tmp_path, node_processes
):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120, heartbeat_timeout=2)
    with reservation:
        reservation.wait(60)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60) as launcher:
            launcher.run(pid)
            time.sleep(4)  # twice the reservation's heartbeat timeout without a run
            assert len(launcher.run(pid).values()) == 2
        log = reservation.log.read_text()
    assert log.count("attached (session") == 1, log
    assert node_processes() == {}


_NAPPER = """
import time
import slurmrun
def nap():
    print("napping", flush=True)
    time.sleep(6)
    return "rested"
print(slurmrun.launch(nap, job={job!r}, timeout=60, heartbeat_timeout=2).values(), flush=True)
"""


@pytest.mark.usefixtures("slurm_cluster", "config")
def test_a_stopped_launcher_keeps_its_run_until_it_goes_on(tmp_path, node_processes):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120, heartbeat_timeout=2)
    with reservation:
        reservation.wait(60)
        launcher = subprocess.Popen(
            [sys.executable, "-c", _NAPPER.format(job=reservation.job_id)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert launcher.stdout is not None
            assert "napping" in launcher.stdout.readline()
            launcher.send_signal(signal.SIGSTOP)  # Ctrl-Z, for twice both heartbeat timeouts
            time.sleep(4)
            launcher.send_signal(signal.SIGCONT)
            out, _ = launcher.communicate(timeout=30)
        finally:
            launcher.kill()
        assert "['rested', 'rested']" in out, out
    assert node_processes() == {}


def test_a_reservation_without_launchers_ends_itself_after_its_idle_timeout(
    slurm_cluster, tmp_path, config, node_processes
):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=3)
    with reservation:
        reservation.wait(60)
        ready = time.monotonic()
        while reservation.state not in FINAL_STATES and time.monotonic() - ready < 3 + 15:
            time.sleep(0.5)
        assert reservation.state in FINAL_STATES, "still running after idle_timeout + 15 s"
    assert "no launcher attached for 3 s (idle_timeout)" in reservation.log.read_text()
    assert node_processes() == {}


def test_the_command_reserves_printing_the_bare_job_id_and_releases(
    slurm_cluster, tmp_path, config, run_cmd, node_processes
):
    reserve = [sys.executable, "-m", "slurmrun", "reserve", "--nodes", "2", "--time-min", "10"]
    more = ["--folder", str(tmp_path / "jobs"), "--job-name", JOB_NAME, "--wait", "60"]
    job_id = run_cmd([*reserve, *more], timeout=90).stdout.strip()
    try:
        assert job_id.isdigit(), job_id
        script = tmp_path / "train.py"
        script.write_text(
            "import os\nprint('rank', os.environ['RANK'], os.environ['SLURMD_NODENAME'])\n"
        )
        run = [
            sys.executable,
            "-m",
            "slurmrun",
            "--job",
            job_id,
            "--show-ranks",
            "all",
            str(script),
        ]
        nodes = []
        for _ in range(2):  # the second, as the first, on the agents the job keeps
            out = run_cmd(run, timeout=60).stdout
            ran = sorted(
                re.findall(r"^\[(node\d):0\] rank (\d) (node\d)$", out, re.M), key=lambda x: x[1]
            )
            assert [r for _, r, _ in ran] == ["0", "1"] and all(a == b for a, _, b in ran), out
            assert nodes in ([], [a for a, _, _ in ran]), out  # the same 2 nodes both times
            nodes = [a for a, _, _ in ran]
        listed = run_cmd([sys.executable, "-m", "slurmrun", "jobs", "--folder", str(tmp_path)])
        line = next(x for x in listed.stdout.splitlines() if x.startswith(job_id)).split()
        assert line[1:3] == ["RUNNING", ",".join(nodes)] and line[-4:-2] == ["none", "for"], line
        with slurmrun.Launcher(job=job_id, timeout=60) as launcher:
            launcher.run(pid)
            listed = run_cmd([sys.executable, "-m", "slurmrun", "jobs", "--folder", str(tmp_path)])
        assert f"pid {os.getpid()} on " in listed.stdout, listed.stdout
    finally:
        released = run_cmd([sys.executable, "-m", "slurmrun", "release", job_id], timeout=60)
    assert released.stdout.strip() == f"{job_id} CANCELLED"
    assert node_processes() == {}


def _as_nobody(attempt: Callable[[], str]) -> str:
    """What `attempt` says when it runs as uid 65534 (a fork of this process: its imports
    are done, so no interpreter of nobody's is needed), within 10 s."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, attempt().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read) as out:
            return out.read()
    finally:
        os.waitpid(child, 0)


def _refused(what: Callable[[], object]) -> Callable[[], str]:
    def attempt() -> str:
        started = time.monotonic()
        try:
            what()
        except Exception as e:
            return f"{type(e).__name__} after {time.monotonic() - started:.1f} s: {e}"
        return "not refused"

    return attempt


@pytest.mark.usefixtures("slurm_cluster")
def test_another_user_is_refused_within_seconds_and_runs_nothing(
    tmp_path, config, monkeypatch, node_processes
):
    reservation = _reserve(tmp_path, nodes=1, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        record = ReservationRecord.read(reservation.job_id)
        assert record is not None
        job = reservation.job_id
        said = _as_nobody(_refused(lambda: slurmrun.launch(print, job=job, timeout=30)))
        assert said.startswith("ReservationError after 0."), said
        assert "only the user who reserved it can use it" in said
        monkeypatch.delenv("XDG_CONFIG_HOME")  # their own config (HOME is ours, unreadable)
        said = _as_nobody(_refused(lambda: slurmrun.launch(print, job=job, timeout=30)))
        assert said.startswith("ReservationError after 0."), said

        # Knowing where the keeper listens is not enough: the secret is what it asks.
        def guess() -> None:
            with socket.create_connection((record.host, record.port), timeout=5) as sock:
                client_handshake(sock, os.urandom(32), 5)

        said = _as_nobody(_refused(guess))
        assert said.startswith(("AuthenticationError", "HandshakeBrokeOff")), said
        assert "attached (session" not in reservation.log.read_text()
    assert node_processes() == {}


_SLEEPER = """
import os, sys, time
import slurmrun
def sleep():
    print("sleeping", flush=True)
    time.sleep(300)
slurmrun.launch(sleep, job={job!r}, timeout=60)
"""


@pytest.mark.parametrize("via", ["direct", "srun"])
def test_a_sigkilled_launcher_costs_its_run_on_every_node_and_frees_the_reservation(
    slurm_cluster, tmp_path, config, node_processes, via
):
    reservation = _reserve(tmp_path, nodes=2, time_min=5, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        launcher = subprocess.Popen(
            [sys.executable, "-c", _SLEEPER.format(job=reservation.job_id)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "SLURMRUN_RESERVE_VIA": via},  # srun: its relay goes too
        )
        try:
            assert launcher.stdout is not None
            assert "sleeping" in launcher.stdout.readline()
            workers = lambda: [  # noqa: E731
                p for ps in node_processes(wait=0).values() for p in ps if " rank " in p.cmdline
            ]
            deadline = time.monotonic() + 10
            while len(workers()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(workers()) == 2
        finally:
            launcher.send_signal(signal.SIGKILL)
            launcher.wait(10)
        killed = time.monotonic()
        while workers() and time.monotonic() - killed < 15 + 5:
            time.sleep(0.2)
        assert not workers(), "workers still running heartbeat_timeout + 5 s after the kill"
        result = slurmrun.launch(where, (2,), job=reservation.job_id, timeout=60)
        first, second = _two_nodes(result)
        assert result.values() == [(first, 0), (second, 2)]
    assert node_processes() == {}
