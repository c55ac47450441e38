"""A launch's plan: its hosts, how their agents start, and where they reach the launcher.

`make_plan` reads the allocation (or the hosts given) once per launch, and for srun agents
resolves their step (`srun.AgentsStep`: CPUs, GPUs per node, task order) there too: what
follows reads the plan and asks SLURM nothing more. The rest (`agent_start`) turns a plan
into what the agents start with: their environment and their starter (srun, ssh or local);
where they reach the launcher is `slurmrun.launcher.address`'s. A dry run
(`slurmrun.launcher.dryrun.plan_dry_run`) takes the same steps and starts nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from slurmrun import providers
from slurmrun.environment import env_words, matching_env
from slurmrun.errors import OptionsValueError
from slurmrun.launcher import srun
from slurmrun.launcher.containers import PLAIN, AgentCommand, agent_command_of
from slurmrun.launcher.ssh import SshAgents
from slurmrun.launcher.starters import (
    AgentStarter,
    LocalAgents,
    package_pythonpath,
)
from slurmrun.log_dirs import LogDir
from slurmrun.protocol import (
    ENV_FILE_VAR,
    HEARTBEAT_VAR,
    HEARTBEATS_PER_TIMEOUT,
    JOB_ENV_VAR,
    JOB_TASKS_VAR,
    LAUNCHER_ADDR_VAR,
    LEARN_PRELOADS_VAR,
    PORT_VAR,
    PRELOAD_LATER_VAR,
    PRELOAD_VAR,
    SECRET_VAR,
)
from slurmrun.slurm.job import (
    SlurmAllocation,
    job_gpus_per_node,
    slurm_allocation,
)
from slurmrun.worker_env import job_vars

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options

__all__ = [
    "Plan",
    "agent_start",
    "job_nodes",
    "make_plan",
    "silence",
    "step_order",
    "user_env",
]

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

    @property
    def step(self) -> srun.AgentsStep | None:
        """The agents' srun step on `hostnames`, from `nodes`; None unless they start with srun."""
        return None if self.nodes is None else self.nodes.step(self.hostnames)


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
    _check_elastic(cfg, plan)
    return replace(plan, command=agent_command_of(cfg))


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
    active = cfg.hosts
    if active is None:
        return hosts, []
    if isinstance(active, bool) or not isinstance(active, int) or not 1 <= active <= len(hosts):
        raise OptionsValueError(
            f"hosts must be an int from 1 to the {len(hosts)} host(s) found ({hosts}), "
            f"got {active!r}"
        )
    return hosts[:active], hosts[active:]


def _check_elastic(cfg: Options, plan: Plan) -> None:
    """Refuses a `min_hosts`, or spares, that the plan cannot honour.

    Planning checks it, so that a dry run refuses what the run would.
    """
    minimum = cfg.min_hosts
    hosts = len(plan.hostnames)
    if minimum is not None and (
        isinstance(minimum, bool) or not isinstance(minimum, int) or not 1 <= minimum <= hosts
    ):
        raise OptionsValueError(
            f"min_hosts must be an int from 1 to the launch's {hosts} host(s), got {minimum!r}"
        )
    elastic = plan.spares or (minimum is not None and minimum < hosts)
    if elastic and cfg.max_restarts < 1:
        what = f"min_hosts={minimum}" if not plan.spares else f"hosts={hosts} (with spares)"
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
    nodes = sorted((alloc.node_index(h), h) for h in hostnames)
    return srun.JobNodes(
        order=tuple(h for _, h in nodes),
        cpus=tuple(alloc.cpus_per_node[i] for i, _ in nodes),
        gpus=tuple(gpus[i] for i, _ in nodes),
    )


def _counts(w: int | list[int] | str, hosts: list[str]) -> list[int] | None:
    if isinstance(w, str):
        return None
    if isinstance(w, int):
        return [w] * len(hosts)
    if len(w) != len(hosts):
        raise OptionsValueError(
            f"workers_per_host has {len(w)} entries but there are {len(hosts)} hosts "
            f"({hosts}): give one count per host, or a single int"
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


# ---------------------------------------------------------------------- the agents' start


def user_env(cfg: Options, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The user's part of what agents and workers get: the matching variables, the given ones.

    A warm launcher reads it again at every run (`slurmrun.launcher.warm`).
    """
    environ = os.environ if environ is None else environ
    patterns, values = env_words(cfg.extra_env_vars)
    env = matching_env(environ, [*cfg.default_env_vars, *patterns])
    env.update(values)
    return env


def silence(cfg: Options) -> float:
    """How long an agent may be silent before it counts as dead, and the launcher for agents.

    Heartbeats must come often enough for the shorter of the two timeouts.
    """
    return float(min(cfg.timeout, cfg.heartbeat_timeout))


def _control_env(
    cfg: Options, plan: Plan, secret: str, advertise: str, port: str
) -> dict[str, str]:
    """The variables the launcher sets for its agents (`_agent_starter` adds the job's tasks)."""
    # Modules the spawner imports before forking workers (the command's script mode asks for
    # torch although it initialises no process group). Without a process group torch is
    # imported after the first run instead: a one-shot launch never waits for it, and later
    # runs of a warm launcher find it loaded. A value the user set is taken as it is.
    preload = os.environ.get(PRELOAD_VAR)
    control = {
        SECRET_VAR: secret,
        LAUNCHER_ADDR_VAR: advertise,
        PORT_VAR: port,
        PRELOAD_VAR: preload or ("" if cfg.backend is None else "torch"),
        PRELOAD_LATER_VAR: "torch" if not preload and cfg.backend is None else "",
        LEARN_PRELOADS_VAR: "1" if cfg.learn_preloads else "0",
        HEARTBEAT_VAR: str(max(0.05, silence(cfg) / HEARTBEATS_PER_TIMEOUT)),
    }
    if not plan.command.contained:  # this slurmrun; a container has its own
        control["PYTHONPATH"] = package_pythonpath(os.environ)
    if cfg.env_file:
        control[ENV_FILE_VAR] = os.path.abspath(cfg.env_file)
    return control


def agent_start(
    cfg: Options, plan: Plan, log_dir: LogDir, *, secret: str, advertise: str, port: str
) -> tuple[AgentStarter, dict[str, str]]:
    """The agents' starter, and the environment to start them with.

    What a run starts its agents with (`slurmrun.launcher.warm.open_pool`), and what a dry
    run shows (`slurmrun.launcher.dryrun.plan_dry_run`, with no secret and port 0).

    Args:
        cfg: the launch's options.
        plan: the launch's plan.
        log_dir: the launch's log directory.
        secret: the launch's secret (hex), which agents prove they know.
        advertise: the launcher's address the agents connect to.
        port: the launcher's port.
    """
    control = _control_env(cfg, plan, secret, advertise, port)
    return _agent_starter(cfg, plan, log_dir, control)


def _agent_starter(
    cfg: Options, plan: Plan, log_dir: LogDir, control: dict[str, str]
) -> tuple[AgentStarter, dict[str, str]]:
    if plan.alloc is not None and plan.alloc.tasks_per_node is not None:
        control[JOB_TASKS_VAR] = ",".join(map(str, plan.alloc.tasks_per_node))
    environ: Mapping[str, str] = os.environ
    if not plan.local and not plan.ssh:
        # srun runs with our environment less what would reshape the agents' step (the driver's
        # own step, SLURM_CPUS_PER_TASK...); the agents get only the names listed in --export,
        # with their values taken from srun's environment, so no value is on a command line.
        environ = srun.srun_environment(os.environ)
        control[JOB_ENV_VAR] = job_vars(os.environ)  # the workers' SLURM_JOB_NAME, ...
    agent_env = user_env(cfg, environ) | control
    if plan.local:
        return LocalAgents(plan.hostnames, log_dir.path, command=plan.command.agent()), agent_env
    if plan.ssh:
        ssh = SshAgents(
            plan.hostnames, log_dir.path, config_file=cfg.ssh_config_file, command=plan.command
        )
        return ssh, agent_env
    assert plan.step is not None  # noqa: S101 - make_plan resolves srun agents' step
    starter = srun.srun_agents(
        plan.step, log_dir.path, sorted(agent_env), node_logs=log_dir.keep, command=plan.command
    )
    return starter, {**environ, **agent_env}


def step_order(plan: Plan) -> list[str]:
    """The agents' step's nodes in SLURM's task order (the job's node order)."""
    return list(plan.step.task_order) if plan.step else list(plan.hostnames)
