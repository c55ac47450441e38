"""The elastic plan (`slurmrun.launcher.elastic`): which hosts the next attempt runs on after
one is lost, with `min_hosts` or spares (`hosts`), and the checks made before anything starts;
hosts told apart by their place (a host named twice), and the node SLURM marks down blamed.
The cluster tests (tests/slurm/test_elastic_slurm.py) lose a real node."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import slurmrun
from slurmrun.errors import AgentFailedError, WorkerFailedError
from slurmrun.launcher.agents import Srun, Ssh
from slurmrun.launcher.agents.srun import JobNodes
from slurmrun.launcher.elastic import (
    HostsDownError,
    note_hosts_down,
    restart_plan,
    without_lost_host,
)
from slurmrun.launcher.plan import Plan


def plan(hosts: list[str], spares: list[str] | None = None) -> Plan:
    return Plan(
        hostnames=hosts,
        workers_per_host=[2] * len(hosts),
        alloc=None,
        agents=Ssh(),
        spares=spares or [],
    )


def lost(host: str) -> AgentFailedError:
    return AgentFailedError(f"the agent on {host} sent nothing for 5 s", hostname=host)


def test_min_hosts_drops_the_lost_host_and_keeps_the_order() -> None:
    cfg = slurmrun.Launcher(min_hosts=2, max_restarts=1)
    smaller = without_lost_host(cfg, plan(["a", "b", "c"]), lost("b"))
    assert smaller is not None
    assert smaller.hostnames == ["a", "c"] and smaller.workers_per_host == [2, 2]
    assert without_lost_host(cfg, smaller, lost("a")) is None  # 1 left < min_hosts


def test_a_spare_takes_the_lost_hosts_place() -> None:
    cfg = slurmrun.Launcher(hosts=2, max_restarts=2)
    swapped = without_lost_host(cfg, plan(["a", "b"], ["c", "d"]), lost("a"))
    assert swapped is not None
    assert swapped.hostnames == ["c", "b"] and swapped.spares == ["d"]


def test_other_failures_and_unknown_hosts_keep_the_plan() -> None:
    cfg = slurmrun.Launcher(min_hosts=1, max_restarts=1)
    hosts = plan(["a", "b"])
    assert without_lost_host(cfg, hosts, WorkerFailedError("rank 1 died")) is None
    assert without_lost_host(cfg, hosts, lost("z")) is None
    assert without_lost_host(slurmrun.Launcher(max_restarts=1), hosts, lost("a")) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_hosts": 4, "max_restarts": 1}, "from 1 to the launch's 3"),
        ({"min_hosts": 0, "max_restarts": 1}, "from 1 to"),
        ({"min_hosts": 2}, "max_restarts >= 1"),
        ({"hosts": 2}, "max_restarts >= 1"),
    ],
)
def test_bad_elastic_options_are_refused_by_the_run_and_its_dry_run_alike(
    options: dict[str, int], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    # ssh hosts: the plan is made without any host being reached
    launcher = slurmrun.Launcher(hostnames=["a", "b", "c"], **options)  # type: ignore[arg-type]
    with pytest.raises(slurmrun.OptionsValueError, match=message):
        launcher.dry_run(print)
    with pytest.raises(slurmrun.OptionsValueError, match=message):
        launcher.run(print)


def test_hosts_keeps_the_rest_of_the_allocation_as_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmrun.launcher.plan import make_plan

    for name in list(__import__("os").environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    cfg = slurmrun.Launcher(hostnames=["h1", "h2", "h3"], hosts=2, max_restarts=1)
    made = make_plan(cfg)
    assert made.hostnames == ["h1", "h2"] and made.spares == ["h3"]
    with pytest.raises(ValueError, match="hosts must be an int from 1 to the 3"):
        make_plan(slurmrun.Launcher(hostnames=["h1", "h2", "h3"], hosts=5))


def test_the_dry_run_says_what_a_lost_host_would_do(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURMRUN_LAUNCHER_ADDR", "10.0.0.1")  # the hosts are names only
    hosts = ["h1", "h2", "h3"]
    spares = slurmrun.Launcher(hostnames=hosts, hosts=2, max_restarts=1).dry_run(print)
    assert spares.hosts == ("h1", "h2") and spares.spares == ("h3",)
    assert "a lost host:      is replaced by a spare (h3)" in str(spares)
    smaller = slurmrun.Launcher(hostnames=hosts, min_hosts=2, max_restarts=1).dry_run(print)
    assert "is left out at the restart, while 2 or more hosts remain" in str(smaller)


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun")
def test_a_submitted_elastic_job_asks_sbatch_for_no_kill(tmp_path: Path) -> None:
    def submitted(launcher: slurmrun.Launcher | None) -> str:
        dry = slurmrun.submit(
            print, launcher=launcher, nodes=3, folder=tmp_path / "jobs", dry_run=True
        )
        return str(dry)

    assert "#SBATCH --no-kill\n" in submitted(slurmrun.Launcher(min_hosts=2, max_restarts=1))
    assert "#SBATCH --no-kill\n" in submitted(slurmrun.Launcher(hosts=2, max_restarts=1))
    assert "--no-kill" not in submitted(None)


# Issue 44, item 3: a host named twice (two agents on localhost) is told apart by its place.
def lost_at(host: str, node_rank: int) -> AgentFailedError:
    return AgentFailedError(f"the agent on {host} died", hostname=host, node_rank=node_rank)


def test_a_host_named_twice_loses_only_the_agent_that_failed() -> None:
    cfg = slurmrun.Launcher(min_hosts=2, max_restarts=1)
    smaller = without_lost_host(cfg, plan(["localhost"] * 3), lost_at("localhost", 1))
    assert smaller is not None and smaller.hostnames == ["localhost", "localhost"]
    # min_hosts counts the agents left: two named alike are two, and one less is too few
    assert without_lost_host(cfg, smaller, lost_at("localhost", 0)) is None
    spared = slurmrun.Launcher(hosts=2, max_restarts=1)
    swapped = without_lost_host(spared, plan(["a", "a"], ["c"]), lost_at("a", 1))
    assert swapped is not None and swapped.hostnames == ["a", "c"]
    # the name alone cannot tell which of the two failed: no host is left out
    assert without_lost_host(cfg, plan(["localhost"] * 3), lost("localhost")) is None


def _kill_my_agent_once() -> list[int]:
    import os
    import signal
    import time

    import psutil

    node_rank = int(os.environ["SLURMRUN_NODE_RANK"])
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0" and node_rank == 1:
        agent = next(p for p in psutil.Process().parents() if p.name() == "slurmrun-agent")
        os.kill(agent.pid, signal.SIGKILL)
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        time.sleep(30)
    return [node_rank, int(os.environ["WORLD_SIZE"]), int(os.environ["SLURMRUN_RESTART_COUNT"])]


def test_an_agent_killed_on_a_host_named_twice_restarts_on_the_other() -> None:
    result = slurmrun.launch(
        _kill_my_agent_once,
        hostnames=["localhost", "localhost"],
        workers_per_host=1,
        backend=None,
        min_hosts=1,
        max_restarts=1,
        timeout=60,
    )
    assert result.values() == [[0, 1, 1]]
    assert result.hostnames == ["localhost"]
    assert list(result.lost_hosts) == ["localhost#1"]  # its label: the name and place


# Issue 44, item 11: after a failed step, the node SLURM marks down is the one lost (srun ends
# the other nodes' tasks itself, so the error may name a healthy node), and a restart never
# asks for it: not as a host, not as a spare. The cluster test sets a real node down.
def srun_plan(hosts: list[str], spares: list[str]) -> Plan:
    nodes = JobNodes(tuple(hosts + spares), (4,) * 4, (0,) * 4)
    return Plan(
        hostnames=hosts,
        workers_per_host=[1] * len(hosts),
        alloc=None,
        agents=Srun(nodes),
        spares=spares,
    )


def fake_node_states(directory: Path, states: dict[str, str]) -> None:
    lines = "\n".join(f"NodeName={n} Arch=x86_64 State={s} Weight=1" for n, s in states.items())
    (directory / "nodes.txt").write_text(lines + "\n")
    scontrol = directory / "scontrol"
    scontrol.write_text(f'#!/bin/sh\ncat "{directory}/nodes.txt"\n')
    scontrol.chmod(0o755)


@pytest.mark.skipif(shutil.which("sh") is None, reason="uses a shell script as scontrol")
def test_the_node_slurm_marks_down_is_lost_whatever_the_error_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    states = {"n1": "ALLOCATED", "n2": "DOWN+NOT_RESPONDING", "n3": "ALLOCATED", "n4": "IDLE"}
    fake_node_states(tmp_path, states)
    cfg = slurmrun.Launcher(min_hosts=2, max_restarts=1)
    restart = restart_plan(cfg, srun_plan(["n1", "n2", "n3"], []), lost_at("n3", 2))
    assert restart is not None and restart.plan.hostnames == ["n1", "n3"]
    assert restart.lost == {1: "SLURM marks n2 DOWN+NOT_RESPONDING"}
    assert restart.plan.agents.step(restart.plan.hostnames).hostnames == ("n1", "n3")
    # a worker's error (no agent named) too: SLURM's word decides
    assert restart_plan(cfg, srun_plan(["n1", "n2", "n3"], []), WorkerFailedError("x"))
    # a spare SLURM marks down is passed over, and dropped
    fake_node_states(tmp_path, {**states, "n4": "IDLE+DRAIN", "n5": "IDLE"})
    nodes = JobNodes(("n1", "n2", "n3", "n4", "n5"), (4,) * 5, (0,) * 5)
    spared = Plan(
        hostnames=["n1", "n2"],
        workers_per_host=[1, 1],
        alloc=None,
        agents=Srun(nodes),
        spares=["n4", "n5"],
    )
    swapped = restart_plan(slurmrun.Launcher(hosts=2, max_restarts=1), spared, lost_at("n1", 0))
    assert swapped is not None and swapped.plan.hostnames == ["n1", "n5"]
    assert swapped.plan.spares == [] and swapped.kept == (0, 3)  # n1, then n5
    # nothing marked down: the host the error names is lost, as before
    fake_node_states(tmp_path, {"n1": "ALLOCATED", "n2": "MIXED", "n3": "ALLOCATED"})
    restart = restart_plan(cfg, srun_plan(["n1", "n2", "n3"], []), lost_at("n3", 2))
    assert restart is not None and restart.plan.hostnames == ["n1", "n2"]


def _stop_my_agent_once() -> list[int]:
    import os
    import signal
    import time

    import psutil

    node_rank = int(os.environ["SLURMRUN_NODE_RANK"])
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        if node_rank == 1:  # a hung agent: its heartbeats stop, its connection stays open
            agent = next(p for p in psutil.Process().parents() if p.name() == "slurmrun-agent")
            os.kill(agent.pid, signal.SIGSTOP)
        time.sleep(30)
    return [node_rank, int(os.environ["WORLD_SIZE"])]


def test_a_silent_agent_on_a_host_named_twice_is_the_one_left_out() -> None:
    result = slurmrun.launch(
        _stop_my_agent_once,
        hostnames=["localhost", "localhost"],
        workers_per_host=1,
        backend=None,
        min_hosts=1,
        max_restarts=1,
        heartbeat_timeout=2,
        timeout=60,
    )
    assert result.values() == [[0, 1]]
    assert list(result.lost_hosts) == ["localhost#1"]
    assert "sent nothing for 2 s" in result.lost_hosts["localhost#1"]


@pytest.mark.skipif(shutil.which("sh") is None, reason="uses a shell script as scontrol")
def test_a_node_marked_down_that_no_restart_can_leave_out_ends_the_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    fake_node_states(tmp_path, {"n1": "ALLOCATED", "n2": "IDLE+DRAIN", "n3": "ALLOCATED"})
    cfg = slurmrun.Launcher(min_hosts=3, max_restarts=1)
    with pytest.raises(HostsDownError, match=r"SLURM marks n2 IDLE\+DRAIN.*\(min_hosts=3\)"):
        restart_plan(cfg, srun_plan(["n1", "n2", "n3"], []), lost_at("n3", 2))


@pytest.mark.skipif(shutil.which("sh") is None, reason="uses a shell script as scontrol")
def test_a_last_failure_notes_the_node_slurm_marks_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    fake_node_states(tmp_path, {"n1": "ALLOCATED", "n2": "DOWN+NOT_RESPONDING", "n3": "MIXED"})
    error = lost_at("n3", 2)
    note_hosts_down(srun_plan(["n1", "n2", "n3"], []), error)
    assert error.__notes__ == [
        "slurmrun: SLURM marks n2 DOWN+NOT_RESPONDING: the failure began there"
    ]
    fine = lost_at("n3", 2)
    fake_node_states(tmp_path, {"n1": "ALLOCATED", "n2": "MIXED", "n3": "MIXED"})
    note_hosts_down(srun_plan(["n1", "n2", "n3"], []), fine)
    assert not hasattr(fine, "__notes__")
