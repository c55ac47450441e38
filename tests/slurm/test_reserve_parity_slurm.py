"""A launch through a reservation does what a launch does: files, events, preloads, stacks, pdb.

Every test here runs on ONE reservation of 3 nodes (`reservation`, reserved once for the
file), from the login side: no SLURM_* variables, as a user on the login node. Each checks one
thing the issue lists as "the same through it" that a launch inside a job does: per-rank log
files and events, learned preloads (also across launchers: the reservation's spawners stay),
`stacks()` of a running run (from Python and from `slurmrun stacks JOB_ID`), `breakpoint()`
in rank 1 driven through a pseudo-terminal, `stall_timeout`, and `min_hosts`.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pexpect
import pytest

import slurmrun
from slurmrun import events
from slurmrun.batch.reserve import reservations
from slurmrun.reservations import ReservationError
from tests.slurm.conftest import JOB_NAME

REPO = Path(__file__).resolve().parents[2]
NODES = ("node1", "node2", "node3")
LEARN_WITHIN = 60.0  # a probe's import and the spawner's own, on a loaded 2-core machine


@dataclass(frozen=True)
class Shared:
    """The file's reservation, and the directory its launchers run in."""

    job_id: str
    work: Path  # the launchers' working directory (their ./slurmrun_logs)
    env: dict[str, str]  # a login-side process's environment (XDG_CONFIG_HOME, PYTHONPATH)


@pytest.fixture(scope="module")
def reservation(
    share_job: Any, tmp_path_factory: pytest.TempPathFactory, module_turn: None
) -> Iterator[Shared]:
    """A reservation of the 3 nodes for the file's tests, released at its end.

    Its agents import from ``site-packages`` under the work directory (`learnme`: an
    installed package, as the spawners learn them), which is on their PYTHONPATH.
    """
    work = tmp_path_factory.mktemp("reserve_parity")
    site = work / "site-packages"
    site.mkdir()
    (site / "learnme.py").write_text("VALUE = 1\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(work / "config"))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
        mp.syspath_prepend(str(site))
        mp.chdir(work)  # the job is this session's (its submit dir), as its launchers are
        reserved = slurmrun.reserve(
            nodes=3, time_min=5, idle_timeout=120, folder=work / "jobs",
            slurm_parameters={"job_name": JOB_NAME},
        )  # fmt: skip
        with share_job(reserved.job_id), reserved:  # released, then nothing may be left
            reserved.wait(90)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
            yield Shared(reserved.job_id, work, env)


def where(scale: int) -> tuple[str, int]:
    rank = int(os.environ["RANK"])
    print(f"rank {rank} says hello", flush=True)
    if rank == 2 and scale < 0:
        raise ValueError("rank 2 fails on purpose")
    return os.environ["SLURMD_NODENAME"], rank * scale


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_per_rank_files_and_events_are_a_launchs(reservation: Shared) -> None:
    seen: list[events.Event] = []
    result = slurmrun.launch(where, (2,), job=reservation.job_id, timeout=60, on_event=seen.append)
    assert result.values() == [("node1", 0), ("node2", 2), ("node3", 4)]
    kinds = [e.kind for e in seen]
    assert kinds[0] == "launch_started" and kinds[-1] == "launch_finished", kinds
    assert kinds.count("agent_connected") == 3 and kinds.count("workers_started") == 3, kinds
    started = [e for e in seen if isinstance(e, events.WorkersStarted)]
    assert sorted(e.host for e in started) == list(NODES), started
    assert all(len(e.pids) == 1 and e.pids[0] > 0 for e in started), started
    finished = seen[-1]
    assert isinstance(finished, events.LaunchFinished) and finished.ok, finished
    assert len({e.launch_id for e in seen}) == 1, seen
    # Each rank's file, written by its agent on its node into the launcher's log folder.
    logs = Path(os.environ["SLURMRUN_LOG_DIR"], "latest")
    for rank, node in enumerate(NODES):
        text = (logs / f"{node}.0.log").read_text()
        assert re.match(r"=== slurmrun run 1, .*, func where ===\n", text), text
        assert f"rank {rank} says hello\n" in text, text
    with pytest.raises(ValueError, match="rank 2 fails on purpose"):
        slurmrun.launch(where, (-1,), job=reservation.job_id, timeout=60)
    failed = (logs / "node3.0.log").read_text()
    assert "Traceback (most recent call last)" in failed, failed
    assert failed.rstrip().endswith("ValueError: rank 2 fails on purpose"), failed


def loaded_then_import(name: str) -> bool:
    """Whether `name` was loaded when this worker started; then imports it."""
    found = name in sys.modules
    importlib.import_module(name)
    return found


def test_learned_preloads_stay_with_the_reservation_for_the_next_launcher(
    reservation: Shared,
) -> None:
    with slurmrun.Launcher(job=reservation.job_id, timeout=60) as launcher:
        assert launcher.run(loaded_then_import, ("learnme",)).values() == [False] * 3
        deadline = time.monotonic() + LEARN_WITHIN
        while not all(launcher.run(loaded_then_import, ("learnme",)).values()):
            assert time.monotonic() < deadline, "the spawners never preloaded what run 1 imported"
            time.sleep(0.3)
    # A launcher of its own (a later script): its first run's workers find it imported.
    again = slurmrun.launch(loaded_then_import, ("learnme",), job=reservation.job_id, timeout=60)
    assert again.values() == [True] * 3


_RERUN = """
import os, sys, slurmrun
def load():
    slurmrun.worker_state().setdefault("model", f"loaded by {{os.getpid()}}")
    return os.getpid()
def evaluate():  # the script's edited function: the same workers serve it, state and all
    print("evaluated by", os.getpid())
    return os.getpid(), slurmrun.worker_state().get("model")
with slurmrun.Launcher(job={job!r}, timeout=60, keep_workers=True) as launcher:
    print(launcher.run(load if sys.argv[1] == "first" else evaluate).values())
"""


def test_a_script_rerun_after_an_edit_finds_its_kept_workers_and_their_state(
    reservation: Shared,
) -> None:
    script = reservation.work / "rerun.py"
    script.write_text(_RERUN.format(job=reservation.job_id))

    def run(which: str) -> Any:
        done = subprocess.run(
            [sys.executable, str(script), which],
            capture_output=True, text=True, timeout=90, check=False,
            env={**os.environ, "SLURMRUN_LOG_DIR": str(reservation.work / f"logs-{which}")},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return eval(done.stdout.strip().splitlines()[-1])  # the values' repr

    pids = run("first")
    assert run("again") == [(pid, f"loaded by {pid}") for pid in pids]
    # Their log files are the second launcher's now (its own folder).
    log = reservation.work / "logs-again" / "latest" / "node1.0.log"
    assert f"evaluated by {pids[0]}\n" in log.read_text()
    # Another call is not a kept worker's: the next launcher's first run stops them.
    fresh = slurmrun.launch(where, (1,), job=reservation.job_id, timeout=60).values()
    assert len(fresh) == len(pids)


def waits_in_a_named_function(seconds: float, until: str = "") -> int:
    """Waits `seconds`, or (`until`) until that file exists, at most `seconds`."""

    def deep_in_the_reservation() -> None:
        deadline = time.monotonic() + seconds
        # One line and no Python callee: every rank is on it, sleeping or looking (one group).
        while time.monotonic() < deadline and not (until and os.access(until, os.F_OK)): time.sleep(0.05)  # noqa: E701, E501  # fmt: skip

    print("waiting", flush=True)
    deep_in_the_reservation()
    return int(os.environ["RANK"])


def _in_thread(launcher: slurmrun.Launcher, until: Path) -> tuple[threading.Thread, list]:
    out: list[Any] = []
    args = (60.0, str(until))
    thread = threading.Thread(
        target=lambda: out.append(launcher.run(waits_in_a_named_function, args).values())
    )
    thread.start()
    return thread, out


def test_stacks_of_a_running_run_from_python_and_from_slurmrun_stacks_job_id(
    reservation: Shared,
) -> None:
    with slurmrun.Launcher(job=reservation.job_id, timeout=60) as launcher:
        launcher.run(where, (1,))
        go = reservation.work / "stacks_seen"
        thread, out = _in_thread(launcher, go)
        try:
            report = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                report = launcher.stacks(timeout=10)
                if report is not None and "deep_in_the_reservation" in report.summary():
                    break
                time.sleep(0.2)
            assert report is not None, "no stacks while the run went on"
            summary = report.summary()
            assert "ranks 0-2: working: deep_in_the_reservation" in summary, summary
            # Another terminal on the login node, with the reservation's id.
            cp = subprocess.run(
                [sys.executable, "-m", "slurmrun", "stacks", reservation.job_id],
                env=reservation.env, cwd="/", capture_output=True, text=True, timeout=60,
                check=False,
            )  # fmt: skip
            assert cp.returncode == 0, cp.stderr
            assert "ranks 0-2: working: deep_in_the_reservation" in cp.stdout, cp.stdout
        finally:
            go.touch()  # the run returns
            thread.join(60)
    assert out == [[0, 1, 2]]


BREAKS = """
import os, slurmrun

def stop_on_rank_1():
    x = int(os.environ["RANK"]) * 10 + 7
    if x == 17:
        breakpoint()
    return x

print("values", slurmrun.launch(stop_on_rank_1, job={job!r}, timeout=60).values(), flush=True)
"""


def test_breakpoint_in_rank_1_through_a_terminal(reservation: Shared) -> None:
    env = {k: v for k, v in reservation.env.items() if k != "PYTHONBREAKPOINT"}
    child = pexpect.spawn(
        sys.executable, ["-c", BREAKS.format(job=reservation.job_id)], cwd=str(reservation.work),
        env=env, encoding="utf-8", timeout=60, dimensions=(50, 200),
    )  # fmt: skip
    try:
        child.expect_exact("(Pdb) [node2 rank 1] ")
        child.sendline("p x")
        child.expect_exact("17")
        child.expect_exact("(Pdb) [node2 rank 1] ")
        child.sendline("c")
        child.expect_exact("values [7, 17, 27]")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_stall_timeout_dumps_every_ranks_stacks_once_and_the_run_goes_on(
    reservation: Shared, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[events.Event] = []
    with slurmrun.Launcher(
        job=reservation.job_id, timeout=60, stall_timeout=2, on_event=seen.append
    ) as launcher:
        assert launcher.run(waits_in_a_named_function, (5.0,)).values() == [0, 1, 2]
    stalled = [e for e in seen if isinstance(e, events.Stalled)]
    assert len(stalled) == 1, [e.kind for e in seen]
    assert "ranks 0-2: working: deep_in_the_reservation" in stalled[0].summary, stalled[0]
    assert Path(stalled[0].stacks_file).is_file(), stalled[0]
    assert "no rank wrote output, returned or failed for 2 s" in caplog.text, caplog.text


def _agent_pid(job_id: str, node: str) -> int:
    """The pid of the reservation's agent on `node` (nodes share this machine's pid space)."""
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if title == f"slurmrun agent ({node})" and f"SLURM_JOB_ID={job_id}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no agent of job {job_id} on {node}")


def world_then_wait(wait: float) -> tuple[str, int, int, int]:
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        time.sleep(wait)  # the first attempt: until node2's agent is lost
    return (
        os.environ["SLURMD_NODENAME"],
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["SLURMRUN_RESTART_COUNT"]),
    )


# Last in the file: the reservation has 2 nodes left after it.
def test_min_hosts_a_node_lost_mid_run_restarts_on_the_survivors_and_the_reservation_keeps_them(
    reservation: Shared,
) -> None:
    seen: list[events.Event] = []
    options: dict[str, Any] = {"timeout": 60, "min_hosts": 2, "max_restarts": 1}
    with slurmrun.Launcher(job=reservation.job_id, on_event=seen.append, **options) as launcher:
        out: list[Any] = []

        def run() -> None:
            try:
                out.append(launcher.run(world_then_wait, (60,)))
            except Exception as e:
                out.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while sum(isinstance(e, events.WorkersStarted) for e in seen) < 3 and not out:
                assert time.monotonic() < deadline, [e.kind for e in seen]
                time.sleep(0.1)
            os.kill(_agent_pid(reservation.job_id, "node2"), signal.SIGKILL)
        finally:
            thread.join(90)
        assert out and isinstance(out[0], slurmrun.LaunchResult), out
        result = out[0]
        assert result.values() == [("node1", 0, 2, 1), ("node3", 1, 2, 1)]
        assert list(result.lost_hosts) == ["node2"], result.lost_hosts
        # The same launcher's next run, on the hosts left.
        assert launcher.run(world_then_wait, (0,)).values() == [
            ("node1", 0, 2, 0),
            ("node3", 1, 2, 0),
        ]
    assert [e.kind for e in seen].count("restarting") == 1, [e.kind for e in seen]
    # A later launcher: with min_hosts it runs on the two left; without, it is told why not.
    again = slurmrun.launch(world_then_wait, (0,), job=reservation.job_id, **options)
    assert again.values() == [("node1", 0, 2, 0), ("node3", 1, 2, 0)]
    with pytest.raises(ReservationError, match="lost node2") as info:
        slurmrun.launch(world_then_wait, (0,), job=reservation.job_id, timeout=60)
    assert "min_hosts" in str(info.value), info.value
    listed = next(r for r in reservations() if r.job_id == reservation.job_id)
    assert listed.hostnames == ["node1", "node3"], listed  # as `slurmrun jobs` shows it
    # The survivors' agents are the reservation's still: their step was not ended with node2's.
    jobs = reservation.work / "jobs"
    said = (jobs / f"{reservation.job_id}.log").read_text()
    assert "the agent on node2 is gone: " in said and "going on with node1, node3" in said, said
    for node in ("node1", "node3"):
        log = (jobs / reservation.job_id / "logs" / "latest" / f"{node}.agent.log").read_text()
        assert "SLURM is ending this step" not in log, log
