"""The agents' srun step: its command line, the environment srun runs with, its process.

`slurmrun.launcher.agents.srun` plans the step (`JobNodes.step`); this builds what starts it:
one task per node, every variable's value taken from srun's environment (never on a command
line), and `SrunAgents`, the `AgentStarter` that runs srun and ends the step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from slurmrun.launcher.agents.containers import PLAIN, AgentCommand, no_srun_message
from slurmrun.launcher.agents.starters import wait_exit
from slurmrun.logs import agent_log_path
from slurmrun.slurm.step import step_id
from slurmrun.variables import LOG_DIR_MARK_VAR

__all__ = [
    "AgentsStep",
    "SrunAgents",
    "agents_step_command",
    "srun_agents",
    "srun_environment",
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
    in_step = step_id(environ) is not None

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
            (`slurmrun.launcher.agents.containers`).
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


def log_dir_mark(log_dir: str) -> str:
    """A file name in `log_dir`, new for each start of agents: `SrunAgents` writes it there.

    Each agent checks that it sees it (`slurmrun.variables.LOG_DIR_MARK_VAR`): a node that
    does not would write its log files where the launcher never reads them.
    """
    return os.path.join(log_dir, f".slurmrun-mark-{uuid.uuid4().hex}")


def srun_agents(
    step: AgentsStep,
    log_dir: str,
    export: Sequence[str],
    *,
    node_logs: bool = True,
    command: AgentCommand = PLAIN,
    mark: str | None = None,
) -> SrunAgents:
    """An `AgentStarter` that runs the agents as one srun step.

    Args:
        step: the step, as the plan resolved it.
        log_dir: the launcher's log directory; srun's own output goes to ``srun.log`` there.
        export: names of the variables the agents get.
        node_logs: whether each node writes ``<host>.agent.log`` into `log_dir` (which then
            must be shared by the nodes); else the agents' output goes to ``srun.log``.
        command: the agent's command and the options added to srun's.
        mark: the file the agents look for (`log_dir_mark`), written while they run.
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
        mark=mark,
    )


SRUN_TERM_WAIT = 2.0


@dataclass
class SrunAgents:
    """All agents as one SLURM job step, started with the `srun` command line `command`."""

    command: list[str]
    log_path: str
    node_logs: Mapping[str, str]
    hostnames: Sequence[str]
    proc: subprocess.Popen[bytes] | None = None
    step: str | None = None  # "<job id>.<step id>", once an agent said
    mark: str | None = None  # `log_dir_mark`: exists from `start` to `stop`
    _log: IO[bytes] | None = None

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """See `AgentStarter`."""
        job, step = hello.get("slurm_job"), hello.get("slurm_step")
        if job and step:
            self.step = f"{job}.{step}"

    def log_file(self, node_rank: int | None) -> str | None:
        """See `AgentStarter`."""
        if node_rank is None:
            return self.log_path
        return self.node_logs.get(self.hostnames[node_rank], self.log_path)

    def start(self, env: Mapping[str, str]) -> None:
        """See `AgentStarter`."""
        if self.mark is not None:
            with open(self.mark, "x"):
                pass
            env = {**env, LOG_DIR_MARK_VAR: self.mark}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(
                self.command,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            raise RuntimeError(f"could not run srun ({e}); is SLURM's client installed?") from e

    def _cancel_step(self) -> None:
        if self.step is None:
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", self.step], capture_output=True, timeout=10.0, check=False)

    def exit_codes(self) -> dict[int | None, int]:
        """See `AgentStarter`."""
        if self.proc is None or self.proc.poll() is None:
            return {}
        return {None: self.proc.returncode}

    def stop(self, grace: float) -> None:
        """See `AgentStarter`."""
        killed = True  # unless srun is seen to end by itself: then the step ended with it
        try:
            if self.proc is not None and self.proc.poll() is None:
                wait_exit(self.proc, grace)
                if self.proc.poll() is None:
                    # srun forwards SIGTERM to the step's tasks and ends the step. A task on a
                    # lost node keeps srun waiting (up to KillWait and longer): then kill srun
                    # and cancel the step, which slurmctld ends even on a node it cannot reach.
                    self.proc.send_signal(signal.SIGTERM)
                    wait_exit(self.proc, SRUN_TERM_WAIT)
                if self.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)  # not reaped: still its group
                    wait_exit(self.proc, 5.0)
                else:
                    killed = False
            else:
                killed = False
        finally:
            try:
                if killed:  # also when anything above raised (a Ctrl-C while we wait)
                    self._cancel_step()
            finally:
                if self._log is not None:
                    self._log.close()
                if self.mark is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.mark)
