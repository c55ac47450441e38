"""How agents start is one object (`slurmrun.launcher.agents`): a new way of starting them is a
class that follows `AgentKind` and its entry in `KINDS`, which an allocation provider names;
nothing else asks which kind a plan holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest

import slurmrun
from slurmrun import providers
from slurmrun.launcher import agents
from slurmrun.launcher.address import Address
from slurmrun.launcher.agents import AgentKind, AgentStart, DryWorkers, StartOrder


class _Attached:
    """A starter for agents that some other process runs (none here: the test starts nothing)."""

    def start(self, env: Mapping[str, str]) -> None:
        raise AssertionError("a dry run starts nothing")

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        pass

    def exit_codes(self) -> dict[int | None, int]:
        return {}

    def log_file(self, node_rank: int | None) -> str | None:
        return None

    def stop(self, grace: float) -> None:
        pass


class Reserved(AgentKind):
    """Agents already running in a reserved job, reached from outside it (a kind not built in).

    A failed start is explained by `AgentKind`'s default, and no node is ever marked down.
    """

    name: ClassVar[str] = "reserved"
    shown: ClassVar[str] = "agents already running in a reserved job"
    env_on_stdin: ClassVar[bool] = False
    local_master: ClassVar[bool] = False
    writes_logs: ClassVar[bool] = True

    @classmethod
    def provided(cls, cfg: Any, found: providers.Hosts) -> Reserved:
        return cls()

    def address(self, hostnames: Sequence[str]) -> Address:
        return Address("0.0.0.0", "192.0.2.7", "the reservation's gateway")

    def start(self, order: StartOrder) -> AgentStart:
        commands = (("attach", *order.hostnames),)
        control = order.control
        return AgentStart(_Attached(), dict(control), commands, tuple(sorted(control)))

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        return DryWorkers(0, [3] * len(hostnames), "three each, as reserved")


def _provider(kind: str) -> type:
    class Provider:
        priority = 0  # before SLURM's

        def detect(self, environ: Mapping[str, str]) -> providers.Hosts:
            return providers.Hosts(("r1", "r2"), None, kind)

    return Provider


def test_a_kind_added_to_the_table_is_what_a_provider_names_and_the_dry_run_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(agents.KINDS, "reserved", Reserved)
    monkeypatch.setitem(providers._BUILTIN, "reservation", _provider("reserved"))
    dry = slurmrun.Launcher(backend="gloo").dry_run(print)
    assert dry.agents == "reserved" and dry.hosts == ("r1", "r2")
    assert dry.commands == (("attach", "r1", "r2"),)
    assert dry.expected_workers == (3, 3) and dry.workers_reason == "three each, as reserved"
    assert (dry.launcher_address, dry.bind_address) == ("192.0.2.7", "0.0.0.0")
    assert "SLURMRUN_SECRET" in dry.env_names
    assert "agents:           agents already running in a reserved job" in str(dry)


def test_a_provider_naming_an_unknown_kind_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(providers._BUILTIN, "odd", _provider("pigeons"))
    with pytest.raises(
        slurmrun.OptionsValueError, match=r"'pigeons' agents.*local, reserved, srun, ssh"
    ):
        slurmrun.Launcher().dry_run(print)
