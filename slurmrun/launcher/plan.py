"""A launch's plan: its hosts, and how their agents start (srun, ssh, local; a container).

`make_plan` reads the allocation (or the hosts given) once per launch, and for srun agents
the job's nodes (`srun.JobNodes`: CPUs, GPUs, tasks per node, their order) there too: what
follows reads the plan and asks SLURM nothing more. `slurmrun.launcher.startup` turns a plan
into what the agents start with; where they reach the launcher is
`slurmrun.launcher.address`'s. A dry run (`slurmrun.launcher.dryrun.plan_dry_run`) takes the
same steps and starts nothing.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from slurmrun import providers
from slurmrun.errors import OptionsValueError
from slurmrun.launcher import srun
from slurmrun.launcher.containers import PLAIN, AgentCommand, agent_command_of
from slurmrun.slurm.job import (
    SlurmAllocation,
    job_gpus_per_node,
    slurm_allocation,
)

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options

__all__ = ["Plan", "check_for_hosts", "job_nodes", "make_plan"]

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Plan:
    """Where a launch's agents run and how they start (one plan per launch).

    Attributes:
        hostnames: the hosts, one agent each, in node-rank order.
        workers_per_host: workers on each host; None: each agent decides.
        alloc: the SLURM job as read at planning, or None outside one.
        local: whether the agents are subprocesses of the launcher.
        ssh: whether the agents start over ssh (hosts outside SLURM).
        provider: the allocation provider that found the hosts (``hostnames="auto"``).
        ssh_config_file: the ssh config file for ssh agents.
        nodes: what the job has on the hosts and spares, read once, which `step` is made
            from (after a lost host too: `slurmrun.launcher.elastic`); None unless the agents
            start with srun.
        spares: hosts of the allocation kept out of the run, to replace a lost one
            (`Launcher.hosts`; `slurmrun.launcher.elastic`).
        command: how each agent starts on its node (a container, srun options).
        title: what the launch runs (`slurmrun.titles.run_title`), for the header
            line of each worker's log file.
    """

    hostnames: list[str]
    workers_per_host: list[int] | None
    alloc: SlurmAllocation | None
    local: bool
    ssh: bool = False
    provider: str = ""
    ssh_config_file: str | None = None
    spares: list[str] = field(default_factory=list)
    nodes: srun.JobNodes | None = None
    command: AgentCommand = PLAIN
    title: str = ""

    @property
    def step(self) -> srun.AgentsStep | None:
        """The agents' srun step on `hostnames`, from `nodes`; None unless they start with srun."""
        return None if self.nodes is None else self.nodes.step(self.hostnames)

    @property
    def task_order(self) -> list[str]:
        """The agents' nodes in their srun step's task order (the job's), else `hostnames`."""
        step = self.step
        return list(step.task_order) if step else list(self.hostnames)


def _is_local(host: str) -> bool:
    return host in _LOCAL_NAMES or host == socket.gethostname()


def make_plan(cfg: Options, *, check_driver_step: bool = True) -> Plan:
    """The plan for `cfg`'s options and the allocation this process is in.

    Raises:
        RuntimeError: ``"slurm"`` asked for outside a job, or a step of several tasks runs
            the launcher (unless `check_driver_step` is False: `slurmrun info` shows it).
        OptionsValueError, OptionsTypeError: hosts that are not the job's, a node listed
            twice, ``hosts`` or ``min_hosts`` out of range or without a restart, or an srun
            option that slurmrun sets itself (`slurmrun.launcher.containers`).
    """
    plan = _hosts_plan(cfg, check_driver_step)
    _check_elastic(cfg, len(plan.hostnames), spares=len(plan.spares))
    return replace(plan, command=agent_command_of(cfg))


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
    found: providers.Hosts | None = None
    if cfg.hostnames == "auto":
        found = providers.detect()
        hosts = list(found.hostnames)
    elif cfg.hostnames == "slurm":
        assert alloc is not None  # noqa: S101 - checked above
        hosts = list(alloc.hostnames)
    else:
        hosts = list(cfg.hostnames)
    if found is not None and found.agents != "srun":
        provided = _provided_plan(cfg, found)
        active, spares = _spares(cfg, provided.hostnames)
        counts = provided.workers_per_host
        return replace(
            provided,
            hostnames=active,
            workers_per_host=None if counts is None else counts[: len(active)],
            spares=spares,
        )
    hosts, spares = _spares(cfg, hosts)
    # A job's nodes, one of them this machine included, get their agents from srun: the agents
    # then live in the job (its SLURM_* variables, its GPUs and CPUs, its accounting) just
    # as on several nodes. Local agents are for hosts that are not the job's ("localhost").
    local = alloc is None or not all(h in alloc.hostnames for h in [*hosts, *spares])
    if local and not all(_is_local(h) for h in hosts):
        if alloc is None:  # hosts outside any scheduler: their agents start over ssh
            counts = _counts(cfg.workers_per_host, hosts)
            return Plan(
                hosts,
                counts,
                None,
                False,
                ssh=True,
                ssh_config_file=cfg.ssh_config_file,
                spares=spares,
            )
        unknown = [h for h in [*hosts, *spares] if h not in alloc.hostnames]
        raise OptionsValueError(
            f"hostnames {unknown} are not nodes of SLURM job {alloc.job_id}, whose nodes are "
            f"{alloc.hostnames}"
        )
    if not local and len(set(hosts)) != len(hosts):
        raise OptionsValueError(
            f"hostnames lists a node twice ({hosts}); srun starts one agent per node"
        )
    if not local and alloc is not None and check_driver_step:
        _check_driver_step(alloc)
    counts = _counts(cfg.workers_per_host, hosts)
    if local or alloc is None:
        return Plan(hosts, counts, alloc, local, spares=spares)
    nodes = job_nodes(alloc, [*hosts, *spares])
    return Plan(hosts, counts, alloc, local, spares=spares, nodes=nodes)


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


def job_nodes(alloc: SlurmAllocation, hostnames: Sequence[str]) -> srun.JobNodes:
    """What job `alloc` has on each of `hostnames`, its nodes (`srun.JobNodes`).

    Asks ``scontrol`` for the job's GPUs per node only when neither SLURM's variables nor
    `slurm_allocation` told (`job_gpus_per_node`): once per launch, at planning.
    """
    gpus = job_gpus_per_node(alloc)
    tasks = alloc.tasks_per_node
    nodes = sorted((alloc.node_index(h), h) for h in hostnames)
    return srun.JobNodes(
        order=tuple(h for _, h in nodes),
        cpus=tuple(alloc.cpus_per_node[i] for i, _ in nodes),
        gpus=tuple(gpus[i] for i, _ in nodes),
        tasks=None if tasks is None else tuple(tasks[i] for i, _ in nodes),
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


def _provided_plan(cfg: Options, found: providers.Hosts) -> Plan:
    """The plan for the hosts of an allocation provider whose agents are local or ssh ones."""
    hosts = list(found.hostnames)
    counts = _counts(cfg.workers_per_host, hosts)
    if counts is None and found.workers_per_host is not None:
        counts = list(found.workers_per_host)
    if found.agents == "local" and not all(_is_local(h) for h in hosts):
        raise ValueError(
            f"the allocation provider {found.provider!r} found hosts {hosts} and asks for local "
            "agents, but not all of them are this machine"
        )
    local = found.agents == "local"
    return Plan(
        hosts,
        counts,
        None,
        local,
        ssh=not local,
        provider=found.provider,
        ssh_config_file=cfg.ssh_config_file,
    )


def _check_driver_step(alloc: SlurmAllocation) -> None:
    """Refuses to launch from each of several tasks of one step: they would share the nodes."""
    step = alloc.driver_step
    if step is None or step.num_tasks <= 1:
        return
    raise RuntimeError(
        f"slurmrun.launch runs in SLURM step {step.step_id}, which has {step.num_tasks} tasks "
        f"(this is task {step.proc_id}): every task would launch workers on every node of "
        f"job {alloc.job_id}, and they would fight over its GPUs and CPUs. Start the script "
        "that calls launch() once: `python train.py` in the batch script or the salloc "
        "shell, or `srun -N1 -n1 python train.py`. slurmrun starts one agent per node itself."
    )
