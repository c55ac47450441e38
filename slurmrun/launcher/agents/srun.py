"""srun agents: one step of the job this runs in, one task per node (`Srun`), and its nodes.

`JobNodes` is what the job has on the launch's nodes, read once when the plan is made
(`job_nodes`); the step on any of them (`JobNodes.step`), after a lost node too, is built
from it alone (`slurmrun.launcher.agents.srun_step`). After a failed start, srun's own output
says which node could not start its agent (`agent_start_failure`); after a failed step,
`unusable_nodes` asks SLURM which of its nodes are down, drained or not responding
(`slurmrun.launcher.elastic` leaves them out of the restart).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from slurmrun.errors import AgentFailedError, OptionsValueError
from slurmrun.launcher.address import Address, routed
from slurmrun.launcher.agents.common import agent_env
from slurmrun.launcher.agents.kind import AgentKind, AgentStart, DryWorkers, StartOrder
from slurmrun.launcher.agents.srun_step import (
    AgentsStep,
    log_dir_mark,
    srun_agents,
    srun_environment,
)
from slurmrun.logs import UNSHARED_LOG_DIR_ADVICE, agent_log_path
from slurmrun.slurm.job import SlurmAllocation, job_gpus_per_node
from slurmrun.slurm.scontrol import NodeState, scontrol_node_states
from slurmrun.variables import JOB_ENV_VAR, JOB_TASKS_VAR, LOG_DIR_MARK_VAR
from slurmrun.worker_env import job_vars

if TYPE_CHECKING:
    from slurmrun.launcher.agents.starters import AgentStarter
    from slurmrun.launcher.options import Options
    from slurmrun.log_dirs import LogDir
    from slurmrun.providers import Hosts

__all__ = [
    "JobNodes",
    "Srun",
    "agent_start_failure",
    "job_nodes",
    "unusable_nodes",
]

# srun's word for a task whose stdout could not be set up on its node (e.g. --output names a
# directory the node cannot see or write).
_LAUNCH_FAILED = re.compile(r"task (\d+) launch failed: (.+)")
# srun's words for a node whose slurmd could not be reached to start the step's task there
# (the node is down, its slurmd dead, its network cut).
_NODE_UNREACHABLE = re.compile(r"Task launch for StepId=\S+ failed on node (\S+): (.+)")


@dataclass(frozen=True)
class JobNodes:
    """What the job has on each node a launch may run on (its hosts and spares), read once.

    `slurmrun.launcher.plan.make_plan` reads it from SLURM (scontrol where no variable tells);
    the step on any of these nodes (`step`), after a lost node too, is built from it alone.

    Attributes:
        order: the nodes in SLURM's task order (the job's node order).
        cpus: each node's CPUs, in `order`.
        gpus: each node's GPUs (0 where nothing tells), in `order`.
        tasks: the job's tasks on each node, in `order`; None where nothing tells.
    """

    order: tuple[str, ...]
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]
    tasks: tuple[int, ...] | None = None

    def step(self, hostnames: Sequence[str]) -> AgentsStep:
        """The step of one agent on each of `hostnames` (nodes of `order`, in the launch's order).

        It asks the fewest CPUs and GPUs of any of them: a step asks the same on every node.
        """
        index = {self.order.index(host) for host in hostnames}
        return AgentsStep(
            hostnames=tuple(hostnames),
            cpus_per_task=min(self.cpus[i] for i in index),
            gpus_per_node=min(self.gpus[i] for i in index),
            task_order=tuple(self.order[i] for i in sorted(index)),
        )


@dataclass(frozen=True)
class Srun(AgentKind):
    """Agents as one srun step of the job (`slurmrun.launcher.agents.kind.AgentKind`).

    The agents then live in the job (its SLURM_* variables, its GPUs and CPUs, its
    accounting), and each node writes its agent's log file (when the log directory is kept).

    Attributes:
        nodes: what the job has on the launch's hosts and spares, read once at planning.
        tasks_source: where the job's tasks per node were read (for a dry run).
    """

    name: ClassVar[str] = "srun"
    shown: ClassVar[str] = "one srun step, one task per host"
    env_on_stdin: ClassVar[bool] = False
    local_master: ClassVar[bool] = False
    writes_logs: ClassVar[bool] = True

    nodes: JobNodes
    tasks_source: str = "the job"

    @classmethod
    def of_job(
        cls,
        alloc: SlurmAllocation,
        hostnames: Sequence[str],
        spares: Sequence[str],
        *,
        check_driver_step: bool = True,
    ) -> Srun:
        """Srun agents on `hostnames` of job `alloc` (`spares` may replace one), checked.

        Raises:
            OptionsValueError: a node listed twice.
            RuntimeError: a step of several tasks runs the launcher (unless
                `check_driver_step` is False: `slurmrun info` shows it).
        """
        if len(set(hostnames)) != len(hostnames):
            raise OptionsValueError(
                f"hostnames lists a node twice ({list(hostnames)}); srun starts one agent per node"
            )
        if check_driver_step:
            _check_driver_step(alloc)
        return cls(
            job_nodes(alloc, [*hostnames, *spares]),
            alloc.sources.get("tasks_per_node", "the job"),
        )

    @classmethod
    def provided(cls, cfg: Options, found: Hosts) -> None:
        """See `AgentKind`: the slurm provider's hosts are the job's, planned by its rules."""
        return

    def step(self, hostnames: Sequence[str]) -> AgentsStep:
        """The agents' step on `hostnames`."""
        return self.nodes.step(hostnames)

    def address(self, hostnames: Sequence[str]) -> Address:
        """See `AgentKind`: toward the first node."""
        return routed(hostnames[0])

    def start(self, order: StartOrder) -> AgentStart:
        """See `AgentKind`: names on srun's command line, values in its environment."""
        # srun runs with our environment less what would reshape the agents' step (the driver's
        # own step, SLURM_CPUS_PER_TASK...); the agents get only the names listed in --export,
        # with their values taken from srun's environment, so no value is on a command line.
        environ = srun_environment(os.environ)
        control = {**order.control, JOB_ENV_VAR: job_vars(os.environ)}  # SLURM_JOB_NAME...
        env = agent_env(order.cfg, environ, control)
        log_dir = order.log_dir
        # The mark's value is the starter's, set when it starts (a dry run names no file).
        names = sorted([*env, *([LOG_DIR_MARK_VAR] if log_dir.keep else [])])
        starter = srun_agents(
            self.step(order.hostnames),
            log_dir.path,
            names,
            node_logs=log_dir.keep,
            command=order.command,
            mark=log_dir_mark(log_dir.path) if log_dir.keep else None,
        )
        return AgentStart(starter, {**environ, **env}, (tuple(starter.command),), tuple(names))

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        """See `AgentKind`: one per GPU of the step, else the job's tasks on each node."""
        n = len(hostnames)
        gpus = self.step(hostnames).gpus_per_node
        if gpus > 0:
            return DryWorkers(gpus, [gpus] * n, f"one per GPU of its step (--gres=gpu:{gpus})")
        if self.nodes.tasks is None:
            return DryWorkers(gpus, [1] * n, "no GPU, and the job's tasks per node are unknown: 1")
        tasks = dict(zip(self.nodes.order, self.nodes.tasks, strict=True))
        return DryWorkers(
            gpus,
            [tasks[h] for h in hostnames],
            f"no GPU in its step: the job's tasks on its node ({self.tasks_source}, passed on "
            f"as {JOB_TASKS_VAR})",
        )

    def explain(
        self,
        error: AgentFailedError,
        starter: AgentStarter,
        hostnames: Sequence[str],
        log_dir: LogDir | None,
    ) -> AgentFailedError:
        """See `AgentKind`: the node log srun says could not be opened, or the node lost."""
        srun_log = starter.log_file(None)
        if srun_log is None or log_dir is None or not log_dir.keep:
            return error
        failure = agent_start_failure(srun_log, self.step(hostnames).task_order, log_dir.path)
        if failure is None:
            return error
        host, message = failure
        explained = AgentFailedError(
            message, hostname=host, log_file=srun_log, stderr_tail=error.stderr_tail
        )
        explained.__cause__ = error
        return explained

    def marked_down(self, hostnames: Sequence[str], timeout: float) -> dict[str, NodeState]:
        """See `AgentKind`: asked of SLURM (`unusable_nodes`)."""
        return unusable_nodes(hostnames, timeout)


def job_nodes(alloc: SlurmAllocation, hostnames: Sequence[str]) -> JobNodes:
    """What job `alloc` has on each of `hostnames`, its nodes (`JobNodes`).

    Asks ``scontrol`` for the job's GPUs per node only when neither SLURM's variables nor
    `slurm_allocation` told (`job_gpus_per_node`): once per launch, at planning.
    """
    gpus = job_gpus_per_node(alloc)
    tasks = alloc.tasks_per_node
    nodes = sorted((alloc.node_index(h), h) for h in hostnames)
    return JobNodes(
        order=tuple(h for _, h in nodes),
        cpus=tuple(alloc.cpus_per_node[i] for i, _ in nodes),
        gpus=tuple(gpus[i] for i, _ in nodes),
        tasks=None if tasks is None else tuple(tasks[i] for i, _ in nodes),
    )


def agent_start_failure(
    srun_log: str, step_hosts: Sequence[str], log_dir: str
) -> tuple[str, str] | None:
    """(host, message) if srun's output says a node could not start its agent's task.

    Either srun could not reach the node's slurmd (``Task launch for StepId=... failed on
    node N``: the node is lost, and srun ends the whole step, so the other agents' ends say
    nothing about the cause), or the node cannot open its ``--output`` file (the log
    directory is not on a filesystem the node shares, or it cannot write there), and srun says
    only ``task N launch failed: Slurmd could not connect IO``.

    Args:
        srun_log: srun's own output file.
        step_hosts: the step's nodes in SLURM's task order (the job's node order).
        log_dir: the log directory the nodes were told to write to.
    """
    try:
        with open(srun_log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    unreachable = _NODE_UNREACHABLE.search(text)
    if unreachable is not None:
        host = unreachable.group(1)
        return host, (
            f"the agent on {host} could not start: srun says the task launch failed on node "
            f"{host}: {unreachable.group(2).strip()} (its slurmd does not answer: the node is "
            "down, or cut off)"
        )
    match = _LAUNCH_FAILED.search(text)
    if match is None:
        return None
    task = int(match.group(1))
    host = step_hosts[task] if task < len(step_hosts) else f"task {task}"
    path = agent_log_path(log_dir, host)
    return host, (
        f"the agent on {host} could not start: srun says task {task} launch failed: "
        f"{match.group(2).strip()}. Most likely {host} could not open its log file {path}: "
        f"{UNSHARED_LOG_DIR_ADVICE}"
    )


def unusable_nodes(nodes: Sequence[str], timeout: float = 10) -> dict[str, NodeState]:
    """The nodes of `nodes` that SLURM says cannot run a step now, with their states.

    Asked after a step failed: a node SLURM marks down (a failed health check, an admin, its
    slurmd gone silent), drained or not responding is where the failure began, whatever
    connection closed first (srun ends the other nodes' tasks itself), and a step that asks
    for it is refused. Read from ``scontrol show node``'s states, not from srun's words.

    Args:
        nodes: the step's nodes (and the spares that might replace one).
        timeout: seconds to wait for scontrol.

    Returns:
        The unusable nodes' states by name; empty when none is, or scontrol cannot tell.
    """
    states = scontrol_node_states(nodes, timeout) or {}
    return {node: state for node, state in states.items() if not state.usable}


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
