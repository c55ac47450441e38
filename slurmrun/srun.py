"""Building the `srun` step that starts one agent per node, and finding a reachable address."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Sequence

from slurmrun.allocation import SlurmAllocation, scontrol_gpus
from slurmrun.logs import agent_log_path
from slurmrun.starters import SrunAgents, agent_command

__all__ = ["address_toward", "agents_step_command", "srun_agents"]

# srun rewrites SLURM_TASKS_PER_NODE with the step's layout (1 per node for the agents' step),
# so the job's own value travels to agents under this name.
JOB_TASKS_VAR = "SLURMRUN_JOB_TASKS_PER_NODE"


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


def agents_step_command(
    alloc: SlurmAllocation,
    hostnames: Sequence[str],
    log_dir: str,
    export: Sequence[str],
    srun: str = "srun",
) -> list[str]:
    """The srun command line of the agents' step: one task on each of `hostnames`."""
    n = len(hostnames)
    cpus = min(alloc.cpus_per_node[alloc.node_index(h)] for h in hostnames)
    cmd = [
        srun,
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hostnames)}",
        # The agent and all its workers live in this one task: give it every CPU of the node.
        f"--cpus-per-task={cpus}",
        # Agents' steps may run beside the user's own steps (and our previous launch's).
        "--overlap",
        "--kill-on-bad-exit=1",
        "--job-name=slurmrun-agents",
        f"--output={os.path.join(log_dir, '%N.agent.log')}",
        # Names only: srun copies their values from its own environment, so no value (the
        # launch secret above all) ever appears on a command line.
        f"--export={','.join(export)}",
    ]
    gpus = _step_gpus(alloc, hostnames)
    if gpus:
        # A step sees no GPU unless it asks: ask for what the job has on each node. (Where nodes
        # differ, the step can only ask for the smallest count on every node.)
        cmd.append(f"--gres=gpu:{gpus}")
    return [*cmd, *agent_command()]


def _step_gpus(alloc: SlurmAllocation, hostnames: Sequence[str]) -> int:
    if alloc.gpus_per_node is not None:
        return min(alloc.gpus_per_node[alloc.node_index(h)] for h in hostnames)
    # e.g. `--gpus=N` spread unevenly, or a login-side shell with no per-node variable: ask
    # the controller (`GRES=gpu:2(IDX:0-1)` lines).
    per_node = scontrol_gpus(alloc.job_id) or {}
    return min(per_node.get(h, 0) for h in hostnames)


def srun_agents(
    alloc: SlurmAllocation, hostnames: Sequence[str], log_dir: str, export: Sequence[str]
) -> SrunAgents:
    """An `AgentStarter` that runs the agents as one srun step."""
    srun = shutil.which("srun")
    if srun is None:
        raise RuntimeError("srun was not found on PATH, but a SLURM allocation was detected")
    return SrunAgents(
        command=agents_step_command(alloc, hostnames, log_dir, export, srun),
        log_path=os.path.join(log_dir, "srun.log"),
        node_logs={h: agent_log_path(log_dir, h) for h in hostnames},
        hostnames=list(hostnames),
    )
