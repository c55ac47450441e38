"""Warm launchers on localhost: agents kept between runs, every run with fresh workers.

Each test checks one rule of `Launcher.close`'s docstring with real agents, spawners and gloo.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun.errors import AgentFailedError, WorkerFailedError

# Bounds for processes to disappear: generous, for a loaded 2-core machine.
GONE_WITHIN = 30.0
OPTIONS = {"workers_per_host": 2, "backend": "gloo", "timeout": 120, "heartbeat_timeout": 30}


def pids() -> tuple[int, int]:
    """(this worker's pid, its agent's pid): a worker's parent is the spawner, a fork of it."""
    import torch.distributed as dist

    dist.barrier()
    return os.getpid(), psutil.Process().parent().parent().pid


def agent_pids(result: slurmrun.LaunchResult[tuple[int, int]]) -> set[int]:
    return {agent for _, agent in result.return_values[0]}


def worker_pids(result: slurmrun.LaunchResult[tuple[int, int]]) -> set[int]:
    return {worker for worker, _ in result.return_values[0]}


def gone(pid_set: set[int], within: float = GONE_WITHIN) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pid_set
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_runs_share_agents_and_fork_fresh_workers_each_time() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        results = [launcher.run(pids) for _ in range(3)]
        agents = set().union(*(agent_pids(r) for r in results))
        assert len(agents) == 1, "one agent for all runs"
        workers = [worker_pids(r) for r in results]
        assert all(len(w) == 2 for w in workers)
        assert len(set().union(*workers)) == 6, "fresh workers every run"
        assert gone(workers[0] | workers[1]), "a run's workers are gone once it returned"
        assert launcher.run(lambda x: x + 1, (41,)).rank(1) == 42
    assert gone(agents), "close() ends the agents"
    assert psutil.Process().children() == []


def test_open_keeps_the_agents_without_a_with_block_until_close() -> None:
    # A notebook's way: the launcher is opened in one cell and used in the next ones.
    launcher = slurmrun.Launcher(**OPTIONS).open()
    try:
        first, second = launcher.run(pids), launcher.run(pids)
        assert agent_pids(first) == agent_pids(second), "the same agent for both runs"
        assert worker_pids(first).isdisjoint(worker_pids(second))
    finally:
        launcher.close()
    assert gone(agent_pids(first)), "close() ends the agents"
    cold = slurmrun.Launcher(**OPTIONS).run(pids)  # after close: cold again, nothing kept
    assert gone(agent_pids(cold))


def raise_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank one")


def exit_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)


def test_a_worker_exception_or_death_ends_only_that_run() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        agents = agent_pids(launcher.run(pids))
        with pytest.raises(KeyError, match="rank one"):
            launcher.run(raise_on_rank_1)
        assert agent_pids(launcher.run(pids)) == agents
        with pytest.raises(WorkerFailedError, match="exited with code 3"):
            launcher.run(exit_on_rank_1)
        assert agent_pids(launcher.run(pids)) == agents


def kill_own_agent() -> None:
    if os.environ["RANK"] == "1":
        psutil.Process().parent().parent().kill()
    time.sleep(60)


def test_a_dead_agent_fails_its_run_and_the_next_run_starts_new_agents() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        first = agent_pids(launcher.run(pids))
        with pytest.raises(AgentFailedError, match="agent on localhost"):
            launcher.run(kill_own_agent)
        second = agent_pids(launcher.run(pids))
        assert second != first
        # Killed between runs: the next run notices and starts new agents (with a warning).
        agent = next(iter(second))
        os.kill(agent, signal.SIGKILL)
        # Until the kernel reports its exit (a zombie's threads may still be ending), the
        # next run could start on it and fail like the run above.
        os.waitid(os.P_PID, agent, os.WEXITED | os.WNOWAIT)
        third = agent_pids(launcher.run(pids))
        assert third != second


def fail_first_attempt(marker: str) -> tuple[int, int]:
    import torch.distributed as dist

    dist.barrier()
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        Path(marker).write_text("failed once")
        raise RuntimeError("first attempt")
    return pids()


def test_max_restarts_inside_a_warm_launcher_keeps_the_agents(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with slurmrun.Launcher(**OPTIONS, max_restarts=1) as launcher:
        agents = agent_pids(launcher.run(pids))
        result = launcher.run(fail_first_attempt, (str(marker),))
        assert marker.exists(), "the first attempt failed"
        assert agent_pids(result) == agents


def test_changing_hosts_or_workers_on_an_open_launcher_is_a_clear_error() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        launcher.run(pids)
        launcher.workers_per_host = 1
        with pytest.raises(slurmrun.OptionsValueError, match=r"workers_per_host changed .* close"):
            launcher.run(pids)
        launcher.workers_per_host = 2
        launcher.hostnames = ["localhost", "localhost"]
        with pytest.raises(slurmrun.OptionsValueError, match=r"hostnames, hosts changed"):
            launcher.run(pids)
        launcher.hostnames = "auto"
        launcher.run(pids)  # unchanged again: the same agents serve


def test_launch_and_run_outside_with_leave_nothing_behind() -> None:
    result = slurmrun.launch(pids, **OPTIONS)  # type: ignore[arg-type]
    assert gone(agent_pids(result) | worker_pids(result))
    result = slurmrun.Launcher(**OPTIONS).run(pids)  # type: ignore[arg-type]
    assert gone(agent_pids(result))
    assert psutil.Process().children() == []


SCRIPT = """
import os, sys, time, psutil, slurmrun

def where(path, agent=None):
    if os.environ.get("RANK", "0") == "0":
        agent = agent or psutil.Process().parent().parent().pid
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {agent}")
        os.rename(path + ".tmp", path)
    time.sleep(120)

path, mode = sys.argv[1:]
launcher = slurmrun.Launcher(workers_per_host=2, backend="gloo", timeout=120,
                             heartbeat_timeout=30)
with launcher:
    launcher.run(lambda: 0)
    if mode == "idle":  # the launcher is killed between runs
        where(path, psutil.Process().children()[0].pid)
    try:
        launcher.run(where, (path,))
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    again = launcher.run(lambda: psutil.Process().parent().parent().pid)
    print("AGAIN", again.rank(0), flush=True)
"""


def _start_script(tmp_path: Path, marker: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "warm.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.Popen(
        [sys.executable, str(script), str(marker), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(slurmrun.__file__).parents[1])},
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], within: float = 120.0) -> list[int]:
    deadline = time.monotonic() + within
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    return [int(x) for x in path.read_text().split()]


def test_ctrl_c_stops_the_runs_workers_and_the_launcher_runs_again(tmp_path: Path) -> None:
    marker = tmp_path / "where"
    proc = _start_script(tmp_path, marker, "run")
    try:
        worker, agent = _wait_for(marker, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "INTERRUPTED" in out and f"AGAIN {agent}" in out, "the same agent runs again"
    assert gone({worker})


@pytest.mark.parametrize("mode", ["idle", "run"])
def test_a_sigkilled_launcher_leaves_no_agent_or_worker_behind(tmp_path: Path, mode: str) -> None:
    marker = tmp_path / "where"
    proc = _start_script(tmp_path, marker, mode)
    try:
        _, agent = _wait_for(marker, proc)
        left = {agent, *(p.pid for p in psutil.Process(agent).children(recursive=True))}
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    # (and a successor, while it imports what the workers import: `slurmrun.node.successor`)
    assert len(left) >= (2 if mode == "idle" else 4), "agent, spawner (and 2 workers)"
    assert gone(left), "agents end once their launcher's connection does"


def master_port() -> int:
    """The port this run's store is served on (rank 0's agent reported it)."""
    return int(os.environ["MASTER_PORT"])


def own_process_group() -> int:
    """What a torchrun-style script does: its own group from env://, rank 0 binding MASTER_PORT."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def test_the_next_runs_store_port_is_listening_before_the_run_starts() -> None:
    """Workers that reach rank 0's store before it serves wait in the backlog of the socket its
    agent holds; refused, torch would retry them only after a backoff of up to a second."""
    with slurmrun.Launcher(**OPTIONS) as launcher:
        launcher.run(master_port)  # starts the agents
        for _ in range(2):
            warm = launcher._warm
            assert warm is not None and warm.pool is not None
            port = warm.pool.agents[0].master_port  # what the agent said in its last IDLE
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # accepted into the backlog: something listens there between runs
            assert launcher.run(master_port).values() == [port, port]


def test_with_backend_none_a_function_binds_the_store_port_itself() -> None:
    """Without slurmrun's process group the agent lets go of the port: the script binds it."""
    with slurmrun.Launcher(**{**OPTIONS, "backend": None}) as launcher:
        for _ in range(3):
            assert launcher.run(own_process_group).values() == [2, 2]
