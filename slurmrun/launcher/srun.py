"""The agents' `srun` step: building it, an address its nodes reach, the nodes SLURM marks down.

After a step failed, `unusable_nodes` asks SLURM which of its nodes are down, drained or not
responding (`slurmrun.launcher.elastic` leaves them out of the restart).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurmrun.launcher.containers import PLAIN, AgentCommand, no_srun_message
from slurmrun.launcher.starters import SrunAgents
from slurmrun.logs import agent_log_path
from slurmrun.slurm.scontrol import NodeState, scontrol_node_states

__all__ = [
    "AgentsStep",
    "JobNodes",
    "address_toward",
    "agent_start_failure",
    "agents_step_command",
    "srun_agents",
    "srun_environment",
    "unusable_nodes",
]


# srun's INPUT ENVIRONMENT VARIABLES (man srun, Slurm 22.05, 24.11 and 26.05: the lists are in
# tests/golden/slurm/): each one set in the launcher's environment (by salloc, sbatch, the
# driver's own step, or the user) would silently reshape the agents' step, so srun gets none
# of them but those that find the job. 24.11 sets SLURM_TRES_PER_TASK=cpu=N for `-c N` jobs.
SRUN_INPUT_VARS = frozenset(
    [
        "PMI_FANOUT",
        "PMI_FANOUT_OFF_HOST",
        "PMI_TIME",
        "SLURM_ACCOUNT",
        "SLURM_ACCTG_FREQ",
        "SLURM_BCAST",
        "SLURM_BCAST_EXCLUDE",
        "SLURM_BURST_BUFFER",
        "SLURM_CLUSTERS",
        "SLURM_COMPRESS",
        "SLURM_CONF",
        "SLURM_CONSTRAINT",
        "SLURM_CORE_SPEC",
        "SLURM_CPU_BIND",
        "SLURM_CPU_FREQ_REQ",
        "SLURM_CPUS_PER_GPU",
        "SLURM_CPUS_PER_TASK",
        "SLURM_DEBUG",
        "SLURM_DEBUG_FLAGS",
        "SLURM_DELAY_BOOT",
        "SLURM_DEPENDENCY",
        "SLURM_DISABLE_STATUS",
        "SLURM_DIST_PLANESIZE",
        "SLURM_DISTRIBUTION",
        "SLURM_EPILOG",
        "SLURM_EXACT",
        "SLURM_EXCLUSIVE",
        "SLURM_EXIT_ERROR",
        "SLURM_EXIT_IMMEDIATE",
        "SLURM_EXPORT_ENV",
        "SLURM_GPU_BIND",
        "SLURM_GPU_FREQ",
        "SLURM_GPUS",
        "SLURM_GPUS_PER_NODE",
        "SLURM_GPUS_PER_TASK",
        "SLURM_GRES",
        "SLURM_GRES_FLAGS",
        "SLURM_HINT",
        "SLURM_IMMEDIATE",
        "SLURM_JOB_ID",
        "SLURM_JOB_NAME",
        "SLURM_JOB_NUM_NODES",
        "SLURM_KILL_BAD_EXIT",
        "SLURM_LABELIO",
        "SLURM_MEM_BIND",
        "SLURM_MEM_PER_CPU",
        "SLURM_MEM_PER_GPU",
        "SLURM_MEM_PER_NODE",
        "SLURM_MPI_TYPE",
        "SLURM_NETWORK",
        "SLURM_NNODES",
        "SLURM_NO_KILL",
        "SLURM_NPROCS",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_CORE",
        "SLURM_NTASKS_PER_GPU",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NTASKS_PER_SOCKET",
        "SLURM_OOMKILLSTEP",
        "SLURM_OPEN_MODE",
        "SLURM_OVERCOMMIT",
        "SLURM_OVERLAP",
        "SLURM_PARTITION",
        "SLURM_PMI_KVS_NO_DUP_KEYS",
        "SLURM_POWER",
        "SLURM_PROFILE",
        "SLURM_PROLOG",
        "SLURM_QOS",
        "SLURM_REMOTE_CWD",
        "SLURM_REQ_SWITCH",
        "SLURM_RESERVATION",
        "SLURM_RESV_PORTS",
        "SLURM_SEND_LIBS",
        "SLURM_SIGNAL",
        "SLURM_SPREAD_JOB",
        "SLURM_SRUN_REDUCE_TASK_EXIT_MSG",
        "SLURM_STDERRMODE",
        "SLURM_STDINMODE",
        "SLURM_STDOUTMODE",
        "SLURM_STEP_GRES",
        "SLURM_STEP_KILLED_MSG_NODE_ID",
        "SLURM_TASK_EPILOG",
        "SLURM_TASK_PROLOG",
        "SLURM_TEST_EXEC",
        "SLURM_THREAD_SPEC",
        "SLURM_THREADS",
        "SLURM_THREADS_PER_CORE",
        "SLURM_TIMELIMIT",
        "SLURM_TRES_BIND",
        "SLURM_TRES_PER_TASK",
        "SLURM_UMASK",
        "SLURM_UNBUFFEREDIO",
        "SLURM_USE_MIN_NODES",
        "SLURM_WAIT",
        "SLURM_WAIT4SWITCH",
        "SLURM_WCKEY",
        "SLURM_WORKING_DIR",
        "SLURMD_DEBUG",
        "SRUN_CONTAINER",
        "SRUN_CPUS_PER_TASK",
        "SRUN_EXPORT_ENV",
    ]
)
# What srun needs to find the job (and its cluster) to add a step to.
SRUN_KEEP_VARS = frozenset({"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CONF", "SLURM_CLUSTERS"})
# Set by SLURM in each task of a step: in a launcher that runs inside a step they describe
# that step (its GPUs, its tasks), never the agents' step, which gets its own.
STEP_TASK_VARS = frozenset(
    [
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_GTIDS",
        "SLURM_TASK_PID",
        "SLURM_CPUS_ON_NODE",
        "SLURM_GPUS_ON_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_NODELIST",
        "SLURM_LAUNCH_NODE_IPADDR",
        "SLURM_SRUN_COMM_HOST",
        "SLURM_SRUN_COMM_PORT",
        "SLURM_STEPID",
        "SLURM_TOPOLOGY_ADDR",
        "SLURM_TOPOLOGY_ADDR_PATTERN",
        "SLURM_UMASK",
        "CUDA_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "ROCR_VISIBLE_DEVICES",
        "SLURM_JOB_GPUS",
    ]
)
# srun's word for a task whose stdout could not be set up on its node (e.g. --output names a
# directory the node cannot see or write).
_LAUNCH_FAILED = re.compile(r"task (\d+) launch failed: (.+)")
# srun's words for a node whose slurmd could not be reached to start the step's task there
# (the node is down, its slurmd dead, its network cut).
_NODE_UNREACHABLE = re.compile(r"Task launch for StepId=\S+ failed on node (\S+): (.+)")


@dataclass(frozen=True)
class AgentsStep:
    """The agents' srun step, resolved once per launch (`slurmrun.launcher.plan.make_plan`).

    What the step asks SLURM for, from the job's facts: building its command line asks
    nothing more (no variable, no scontrol).

    Attributes:
        hostnames: the nodes, one agent each, in the launch's order (``--nodelist``).
        cpus_per_task: each agent's CPUs: the fewest the job has on any of the nodes.
        gpus_per_node: each agent's GPUs (``--gres=gpu:N``; 0 asks for none): the fewest the
            job has on any of the nodes, since a step asks the same on every node.
        task_order: the same nodes in SLURM's task order (the job's node order).
    """

    hostnames: tuple[str, ...]
    cpus_per_task: int
    gpus_per_node: int
    task_order: tuple[str, ...]


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


def address_toward(host: str) -> str:
    """The local address the kernel would use to reach `host`.

    ``SLURMRUN_LAUNCHER_ADDR`` overrides it (the launcher reads that, not this function).

    Connecting a UDP socket sends nothing; it only picks a route. This is right where
    ``getfqdn()`` is not (nodes often cannot resolve the login node's name).
    """
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise RuntimeError(
            f"cannot resolve node {host!r} to find an address it can reach us at ({e}); set "
            "SLURMRUN_LAUNCHER_ADDR to this machine's address on the cluster network"
        ) from e
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return str(s.getsockname()[0])


def srun_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for the agents' srun: `environ` without what would reshape the step.

    Drops srun's input variables (`SRUN_INPUT_VARS`, all ``SRUN_*``) except those that find
    the job (`SRUN_KEEP_VARS`), and, when `environ` is that of a step's task, the variables
    that describe that step (``SLURM_STEP_*``, `STEP_TASK_VARS`). The step's shape comes
    from the command line alone (`agents_step_command`).

    Args:
        environ: the launcher's environment.

    Returns:
        A new dict.
    """
    in_step = bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))

    def keep(name: str) -> bool:
        if name in SRUN_KEEP_VARS:
            return True
        if name in SRUN_INPUT_VARS or name.startswith("SRUN_"):
            return False
        return not (in_step and (name in STEP_TASK_VARS or name.startswith("SLURM_STEP_")))

    return {k: v for k, v in environ.items() if keep(k)}


def agents_step_command(
    step: AgentsStep,
    log_dir: str | None,
    export: Sequence[str],
    srun: str = "srun",
    command: AgentCommand = PLAIN,
) -> list[str]:
    """The srun command line of the agents' step: one task on each of its nodes.

    Args:
        step: the step, as the plan resolved it.
        log_dir: where each node writes its agent's output (``<host>.agent.log``); it must be
            on a filesystem every node shares. None: no file on the nodes (srun relays the
            agents' output to its own, on the launcher's side).
        export: names of the variables the agents get (values: srun's environment).
        srun: the srun executable.
        command: the agent's command, and the options added to srun's
            (`slurmrun.launcher.containers`).
    """
    n = len(step.hostnames)
    cmd = [
        srun,
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(step.hostnames)}",
        # The agent and all its workers live in this one task: give it every CPU of the node.
        f"--cpus-per-task={step.cpus_per_task}",
        # Agents' steps may run beside the user's own steps (and our previous launch's).
        "--overlap",
        "--kill-on-bad-exit=1",
        "--job-name=slurmrun-agents",
        # Names only: srun copies their values from its own environment, so no value (the
        # launch secret above all) ever appears on a command line.
        f"--export={','.join(export)}",
    ]
    if log_dir is not None:
        # "%" in the directory is srun's pattern character: "%%" is a literal "%".
        cmd.append(f"--output={os.path.join(log_dir.replace('%', '%%'), '%N.agent.log')}")
    if step.gpus_per_node:
        # A step sees no GPU unless it asks: ask for what the job has on each node.
        cmd.append(f"--gres=gpu:{step.gpus_per_node}")
    # The site's options last: checked not to touch the ones above (`containers`).
    return [*cmd, *command.srun_args, *command.agent()]


def srun_agents(
    step: AgentsStep,
    log_dir: str,
    export: Sequence[str],
    node_logs: bool = True,
    command: AgentCommand = PLAIN,
) -> SrunAgents:
    """An `AgentStarter` that runs the agents as one srun step.

    Args:
        step: the step, as the plan resolved it.
        log_dir: the launcher's log directory; srun's own output goes to ``srun.log`` there.
        export: names of the variables the agents get.
        node_logs: whether each node writes ``<host>.agent.log`` into `log_dir` (which then
            must be shared by the nodes); else the agents' output goes to ``srun.log``.
        command: the agent's command and the options added to srun's.
    """
    srun = shutil.which("srun")
    if srun is None:
        raise RuntimeError(no_srun_message())
    hostnames = list(step.hostnames)
    return SrunAgents(
        command=agents_step_command(step, log_dir if node_logs else None, export, srun, command),
        log_path=os.path.join(log_dir, "srun.log"),
        node_logs={h: agent_log_path(log_dir, h) for h in hostnames} if node_logs else {},
        hostnames=hostnames,
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
        "agents' log files are written by each node, so SLURMRUN_LOG_DIR must be a "
        "directory on a filesystem that every node shares and can write (the default, "
        "./slurmrun_logs, must then be too). Set SLURMRUN_LOG_DIR to such a directory, or "
        "SLURMRUN_LOG_DIR='' to write no log files on the nodes."
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
