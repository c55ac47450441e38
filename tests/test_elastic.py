"""The elastic plan (`slurmrun.launcher.elastic`): which hosts the next attempt runs on after
one is lost, with `min_hosts` or spares (`hosts`), and the checks made before anything starts.
The cluster tests (tests/slurm/test_elastic_slurm.py) lose a real node."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import slurmrun
from slurmrun.errors import AgentFailedError, WorkerFailedError
from slurmrun.launcher.elastic import without_lost_host
from slurmrun.launcher.plan import Plan


def plan(hosts: list[str], spares: list[str] | None = None) -> Plan:
    return Plan(hosts, [2] * len(hosts), None, local=False, ssh=True, spares=spares or [])


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
