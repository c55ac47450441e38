"""`AgentKind`: what a way of starting agents answers, for a run and for a dry run alike.

A plan holds one kind (`slurmrun.launcher.plan.Plan.agents`), chosen when it is made; every
question whose answer depends on how the agents start is asked of it, never of a flag or of
the starter's class: the launcher's address, the agents' environment and starter, what a dry
run shows of them, how a failed start is explained, where the master address lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from slurmrun.errors import AgentFailedError
    from slurmrun.launcher.address import Address
    from slurmrun.launcher.agents.containers import AgentCommand
    from slurmrun.launcher.agents.starters import AgentStarter
    from slurmrun.launcher.options import Options
    from slurmrun.log_dirs import LogDir
    from slurmrun.providers import Hosts
    from slurmrun.slurm.scontrol import NodeState

__all__ = ["AgentKind", "AgentStart", "DryRoute", "DryWorkers", "StartOrder"]


@dataclass(frozen=True)
class StartOrder:
    """What one start of a plan's agents is given (`AgentKind.start`).

    Attributes:
        cfg: the launch's options.
        hostnames: the hosts, one agent each.
        log_dir: the launch's log directory.
        command: how each agent's command is made (a container, srun options).
        control: the variables the launcher sets for every agent
            (`slurmrun.launcher.agents.common.control_env`).
    """

    cfg: Options
    hostnames: Sequence[str]
    log_dir: LogDir
    command: AgentCommand
    control: dict[str, str]


@dataclass(frozen=True)
class AgentStart:
    """One start of a plan's agents: what a run starts, and what a dry run shows of it.

    Attributes:
        starter: starts and stops the agents (the run's).
        env: the environment `starter` starts them with.
        commands: the command lines that start them, as a dry run shows them.
        names: the names of the variables the agents get, as a dry run shows them.
    """

    starter: AgentStarter
    env: dict[str, str]
    commands: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class DryWorkers:
    """What a dry run expects of the agents' workers when the options do not fix them.

    Attributes:
        gpus: the GPUs each agent is expected to see (0: none, or unknown here).
        counts: the workers each host is expected to run.
        reason: how the agents decide (for people).
    """

    gpus: int
    counts: list[int]
    reason: str


@dataclass(frozen=True)
class DryRoute:
    """How a launcher would reach agents that run already, and why (a reservation's).

    Attributes:
        job_id: the SLURM job the agents run in.
        text: the way, and why it was chosen (for people).
        commands: what would run to get there, as a dry run shows it.
    """

    job_id: str
    text: str
    commands: tuple[tuple[str, ...], ...]


class AgentKind(Protocol):
    """One way agents start (local subprocesses, ssh, an srun step), with the facts it needs.

    A kind that subclasses it takes the defaults of `explain` and `marked_down`.

    Attributes:
        name: its name (`slurmrun.providers.Hosts.agents`, `DryRun.agents`).
        shown: how a dry run says the agents start.
        env_on_stdin: whether the agents get their variables' values on stdin (a dry run
            then shows the values, which a command line never holds).
        local_master: whether the workers' master address is loopback (every agent on this
            machine), rather than the first agent's address.
        writes_logs: whether the agents write their log files themselves (else the process
            that starts each one writes its output there).
    """

    name: ClassVar[str]
    shown: ClassVar[str]
    env_on_stdin: ClassVar[bool]
    local_master: ClassVar[bool]
    writes_logs: ClassVar[bool]

    @classmethod
    def provided(cls, cfg: Options, found: Hosts) -> AgentKind | None:
        """The kind for the hosts an allocation provider found (``hostnames="auto"``).

        None: the hosts are the nodes of the job this runs in, planned by the job's rules.

        Raises:
            ValueError: the hosts cannot have agents of this kind.
        """

    def address(self, hostnames: Sequence[str]) -> Address:
        """Where agents on `hostnames` reach the launcher."""

    def start(self, order: StartOrder) -> AgentStart:
        """The starter and environment of the agents `order` asks for (starts nothing)."""

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        """The GPUs and workers a dry run expects of agents started with `env`."""

    def explain(
        self,
        error: AgentFailedError,
        starter: AgentStarter,
        hostnames: Sequence[str],
        log_dir: LogDir | None,
    ) -> AgentFailedError:
        """`error`, or an error that says better why an agent did not start.

        By default `error` itself: the agent's own log file says why.
        """
        return error

    def dry_route(self) -> DryRoute | None:
        """For a dry run: how the launcher would reach agents that run already.

        By default None: the launch starts its agents, which connect to the launcher.
        """
        return None

    def marked_down(self, hostnames: Sequence[str], timeout: float) -> dict[str, NodeState]:
        """The hosts the scheduler marks unable to run agents now, and their states.

        By default none: no scheduler is asked.
        """
        return {}
