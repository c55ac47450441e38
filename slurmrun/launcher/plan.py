"""A launch's plan: its hosts, and how their agents start (an `AgentKind`; a container).

`make_plan` reads the allocation (or the hosts given) once per launch, and picks how the
agents start (`slurmrun.launcher.agents`): for srun agents the job's nodes
(`slurmrun.launcher.agents.srun.JobNodes`: CPUs, GPUs, tasks per node, their order) are read
there too; what follows reads the plan and asks SLURM nothing more. `Plan.address` and
`Plan.start` are what the agents reach and start with: a run (`slurmrun.launcher.warm`) and a
dry run (`slurmrun.launcher.dryrun.plan_dry_run`) ask the same plan, and the dry run starts
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from slurmrun import providers
from slurmrun.errors import OptionsValueError
from slurmrun.launcher.agents import KINDS, AgentKind, AgentStart, Local, Reserved, Srun, Ssh
from slurmrun.launcher.agents.common import control_env
from slurmrun.launcher.agents.containers import PLAIN, AgentCommand, agent_command_of
from slurmrun.launcher.agents.kind import StartOrder
from slurmrun.launcher.agents.local import is_local
from slurmrun.slurm.job import SlurmAllocation, slurm_allocation

if TYPE_CHECKING:
    from slurmrun.launcher.address import Address
    from slurmrun.launcher.options import Options
    from slurmrun.log_dirs import LogDir

__all__ = ["Plan", "check_for_hosts", "make_plan"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where a launch's agents run and how they start (one plan per launch).

    Attributes:
        hostnames: the hosts, one agent each, in node-rank order.
        workers_per_host: workers on each host; None: each agent decides.
        alloc: the SLURM job as read at planning, or None outside one.
        agents: how the agents start (`slurmrun.launcher.agents`): chosen once, here.
        provider: the allocation provider that found the hosts (``hostnames="auto"``).
        spares: hosts of the allocation kept out of the run, to replace a lost one
            (`Launcher.hosts`; `slurmrun.launcher.elastic`).
        command: how each agent starts on its node (a container, srun options).
        title: what the launch runs (`slurmrun.titles.run_title`), for the header
            line of each worker's log file.
        once: the agents start for this launch's one run (a cold launch): no run follows on
            them, so their spawners learn no preloads and import nothing for later.
    """

    hostnames: list[str]
    workers_per_host: list[int] | None
    alloc: SlurmAllocation | None
    agents: AgentKind
    provider: str = ""
    spares: list[str] = field(default_factory=list)
    command: AgentCommand = PLAIN
    title: str = ""
    once: bool = False

    def address(self) -> Address:
        """Where the agents reach the launcher."""
        return self.agents.address(self.hostnames)

    def start(
        self, cfg: Options, log_dir: LogDir, *, secret: str, advertise: str, port: str
    ) -> AgentStart:
        """The agents' starter and environment, and what a dry run shows of them.

        What a run starts its agents with (`slurmrun.launcher.warm.open_pool`), and what a dry
        run shows (`slurmrun.launcher.dryrun.plan_dry_run`, with no secret and port 0).

        Args:
            cfg: the launch's options.
            log_dir: the launch's log directory.
            secret: the launch's secret (hex), which agents prove they know.
            advertise: the launcher's address the agents connect to.
            port: the launcher's port.
        """
        control = control_env(
            cfg,
            self.command,
            self.alloc,
            secret=secret,
            advertise=advertise,
            port=port,
            once=self.once,
        )
        return self.agents.start(StartOrder(cfg, self.hostnames, log_dir, self.command, control))


def make_plan(cfg: Options, *, check_driver_step: bool = True, wait: bool = True) -> Plan:
    """The plan for `cfg`'s options and the allocation this process is in.

    With ``job=``, a reservation that is starting is waited for (``timeout``) unless not
    `wait` (a dry run).

    Raises:
        RuntimeError: ``"slurm"`` asked for outside a job, or a step of several tasks runs
            the launcher (unless `check_driver_step` is False: `slurmrun info` shows it).
        OptionsValueError, OptionsTypeError: hosts that are not the job's, a node listed
            twice, ``hosts`` or ``min_hosts`` out of range or without a restart, or an srun
            option that slurmrun sets itself (`slurmrun.launcher.agents.containers`).
    """
    if cfg.job is not None:  # a reservation's agents: its nodes, as it started them
        _check_reserved(cfg)
        reserved = Reserved.of_job(cfg.job.strip(), float(cfg.timeout) if wait else 0.0)
        hosts = reserved.hostnames(cfg.min_hosts)
        _check_elastic(cfg, len(hosts), spares=0)
        counts = _counts(cfg.workers_per_host, hosts)
        return Plan(hostnames=hosts, workers_per_host=counts, alloc=None, agents=reserved)
    plan = _hosts_plan(cfg, check_driver_step)
    _check_elastic(cfg, len(plan.hostnames), spares=len(plan.spares))
    return replace(plan, command=agent_command_of(cfg))


def _check_reserved(cfg: Options) -> None:
    """Refuses what a launch on a reservation's agents cannot honour (`Launcher.job`)."""
    if not isinstance(cfg.job, str) or not cfg.job.strip():
        raise OptionsValueError(
            f"job must be a SLURM job id (a str such as '1234'), got {cfg.job!r}"
        )
    chosen = [
        name
        for name, value, default in (
            ("hostnames", cfg.hostnames, "auto"),
            ("hosts", cfg.hosts, None),
        )
        if value != default
    ]
    if chosen:
        raise OptionsValueError(
            f"job={cfg.job!r} runs on every node of the reservation, as it started its agents: "
            f"leave {', '.join(chosen)} unset (reserve as many nodes as the launch needs)"
        )


def check_for_hosts(cfg: Options, hosts: int) -> None:
    """`make_plan`'s checks of `cfg` for a launch on `hosts` hosts, before they are known.

    `slurmrun.submit` runs them on the login node, so that a job is not submitted only to
    refuse its launch on its nodes (where `make_plan` runs them again).

    Raises:
        OptionsValueError, OptionsTypeError: as `make_plan` would for `hosts` hosts.
    """
    active = _active_hosts(cfg, hosts)
    _check_elastic(cfg, active, spares=hosts - active)
    agent_command_of(cfg)


def _hosts_plan(cfg: Options, check_driver_step: bool) -> Plan:
    """`make_plan`'s hosts, and how their agents start."""
    alloc = slurm_allocation()
    for name, value in (("hostnames", cfg.hostnames), ("workers_per_host", cfg.workers_per_host)):
        if value == "slurm" and alloc is None:
            raise RuntimeError(
                f"{name}='slurm' but no SLURM allocation was found (SLURM_JOB_ID is not set). "
                "Run inside salloc or an sbatch script, or pass 'auto' to fall back to localhost."
            )
    if cfg.hostnames == "auto":
        found = providers.detect()
        provided = _provided_plan(cfg, found)
        if provided is not None:
            active, spares = _spares(cfg, provided.hostnames)
            counts = provided.workers_per_host
            return replace(
                provided,
                hostnames=active,
                workers_per_host=None if counts is None else counts[: len(active)],
                spares=spares,
            )
        hosts = list(found.hostnames)  # the job's nodes: planned by the job's rules below
    elif cfg.hostnames == "slurm":
        assert alloc is not None  # noqa: S101 - checked above
        hosts = list(alloc.hostnames)
    else:
        hosts = list(cfg.hostnames)
    hosts, spares = _spares(cfg, hosts)
    # A job's nodes, one of them this machine included, get their agents from srun: the agents
    # then live in the job (its SLURM_* variables, its GPUs and CPUs, its accounting) just
    # as on several nodes. Local agents are for hosts that are not the job's ("localhost").
    in_job = alloc is not None and all(h in alloc.hostnames for h in [*hosts, *spares])
    if not in_job and not all(is_local(h) for h in hosts):
        if alloc is None:  # hosts outside any scheduler: their agents start over ssh
            counts = _counts(cfg.workers_per_host, hosts)
            agents = Ssh(cfg.ssh_config_file)
            return Plan(
                hostnames=hosts, workers_per_host=counts, alloc=None, agents=agents, spares=spares
            )
        unknown = [h for h in [*hosts, *spares] if h not in alloc.hostnames]
        raise OptionsValueError(
            f"hostnames {unknown} are not nodes of SLURM job {alloc.job_id}, whose nodes are "
            f"{alloc.hostnames}"
        )
    kind: AgentKind = Local()
    if in_job:
        assert alloc is not None  # noqa: S101 - in_job says so
        kind = Srun.of_job(alloc, hosts, spares, check_driver_step=check_driver_step)
    counts = _counts(cfg.workers_per_host, hosts)
    return Plan(hostnames=hosts, workers_per_host=counts, alloc=alloc, agents=kind, spares=spares)


def _spares(cfg: Options, hosts: list[str]) -> tuple[list[str], list[str]]:
    """The hosts that run (the first `Launcher.hosts`) and the spares (the rest)."""
    active = _active_hosts(cfg, len(hosts), hosts)
    return hosts[:active], hosts[active:]


def _active_hosts(cfg: Options, found: int, hosts: Sequence[str] = ()) -> int:
    """How many of the `found` hosts run (`Launcher.hosts`, checked); the rest are spares."""
    active = cfg.hosts
    if active is None:
        return found
    if isinstance(active, bool) or not isinstance(active, int) or not 1 <= active <= found:
        named = f" ({list(hosts)})" if hosts else ""
        raise OptionsValueError(
            f"hosts must be an int from 1 to the {found} host(s) found{named}, got {active!r}"
        )
    return active


def _check_elastic(cfg: Options, hosts: int, *, spares: int) -> None:
    """Refuses a `min_hosts`, or spares, that a plan of `hosts` hosts cannot honour.

    Planning checks it, so that a dry run refuses what the run would.
    """
    minimum = cfg.min_hosts
    if minimum is not None and (
        isinstance(minimum, bool) or not isinstance(minimum, int) or not 1 <= minimum <= hosts
    ):
        raise OptionsValueError(
            f"min_hosts must be an int from 1 to the launch's {hosts} host(s), got {minimum!r}"
        )
    elastic = spares or (minimum is not None and minimum < hosts)
    if elastic and cfg.max_restarts < 1:
        what = f"min_hosts={minimum}" if not spares else f"hosts={hosts} (with spares)"
        raise OptionsValueError(
            f"{what} restarts without a host that is lost, which takes a restart: set "
            "max_restarts >= 1 (each lost host uses one)"
        )


def _counts(w: int | list[int] | str, hosts: list[str]) -> list[int] | None:
    if isinstance(w, str):
        return None
    if isinstance(w, int):
        return [w] * len(hosts)
    if len(w) != len(hosts):
        found = "1 host was found" if len(hosts) == 1 else f"{len(hosts)} hosts were found"
        raise OptionsValueError(
            f"workers_per_host has {len(w)} counts ({' '.join(map(str, w))}) but {found} "
            f"({', '.join(hosts)}): give one count per host, or one count for every host "
            f"(workers_per_host={w[0]}; on the command line --workers-per-host {w[0]})"
        )
    return list(w)


def _provided_plan(cfg: Options, found: providers.Hosts) -> Plan | None:
    """The plan for the hosts an allocation provider found; None: the job's nodes (srun).

    Raises:
        OptionsValueError: the provider names a way of starting agents that is not known.
        ValueError: its hosts cannot have agents of the kind it names.
    """
    kind = KINDS.get(found.agents)
    if kind is None:
        raise OptionsValueError(
            f"the allocation provider {found.provider!r} asks for {found.agents!r} agents, "
            f"which slurmrun does not know (it knows {', '.join(sorted(KINDS))})"
        )
    agents = kind.provided(cfg, found)
    if agents is None:
        return None
    hosts = list(found.hostnames)
    counts = _counts(cfg.workers_per_host, hosts)
    if counts is None and found.workers_per_host is not None:
        counts = list(found.workers_per_host)
    return Plan(
        hostnames=hosts, workers_per_host=counts, alloc=None, agents=agents, provider=found.provider
    )
