"""The world a worker's environment describes: torchrun's contract, and SLURM's made true.

A worker is one process of a run, but it lives in a task of the agents' srun step, one task
per node, and inherits that task's variables. Left alone they describe the agents' world
(``SLURM_PROCID`` 0 on every worker of the first node, ``SLURM_NTASKS`` the node count), and
code that reads them (Lightning's ``SLURMEnvironment``, submitit's ``JobEnvironment``, an
``if SLURM_PROCID == 0``) sees a world that does not exist. So every worker gets:

- torchrun's variables (`TORCHRUN_VARS`, read from torch's own elastic agent): with
  ``TORCHELASTIC_RUN_ID`` set, frameworks that ask ``torch.distributed.is_torchelastic_launched()``
  (Lightning asks it first) take the torchrun path;
- SLURM's task variables as ``srun`` would set them had the worker been started as its own
  task of a step with the run's layout (`TASK_VARS`);
- the job's own values of the variables that the agents' srun could not carry, because srun
  reads them as its options (`JOB_VARS`: ``SLURM_JOB_NAME``, ``SLURM_CPUS_PER_TASK``, ...), or
  none where the job has none (the agents' step sets ``SLURM_CPUS_PER_TASK`` to the node's
  CPUs, which describes the agent's task, not a worker's);
- no PMI variables (`REMOVED_PREFIXES`): srun's MPI plugin set them for the agent's task, and
  a worker that used them would join that world as the agent;
- not the agents' way back to their launcher (`AGENTS_OWN`: ``SLURMRUN_LAUNCHER_ADDR`` and
  ``SLURMRUN_LAUNCHER_PORT``): a launch the worker starts itself (a submitted job's function
  that maps) would take them for the user's choice, and listen on its launcher's port;
- ``PYTHONBREAKPOINT`` naming slurmrun's debugger (`DEBUGGER_HOOK`), unless it is set: a
  ``breakpoint()`` then opens pdb in the launcher's terminal (a worker has none of its own).

Everything else of SLURM's (``SLURM_JOB_*``, the node's, the step's id and node list) is true
for every worker of the node and stays. This module is imported by workers: standard library
only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurmrun.variables import LAUNCHER_ADDR_VAR, PORT_VAR

__all__ = [
    "AGENTS_OWN",
    "DEBUGGER_HOOK",
    "JOB_VARS",
    "REMOVED_PREFIXES",
    "TASK_VARS",
    "TORCHRUN_VARS",
    "RankPlace",
    "compress_counts",
    "expand_counts",
    "flight_recorder_vars",
    "job_vars",
    "preview",
    "restart_vars",
    "worker_changes",
]

# What torch's LocalElasticAgent sets for each worker (torch/distributed/elastic/agent/server/
# local_elastic_agent.py), plus NODE_RANK (ours: the node's index, as GROUP_RANK).
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "NODE_RANK",
)
ROLE_NAME = "default"  # torchrun's --role default
# What breakpoint() calls in a worker (`slurmrun.node.debugger`), unless PYTHONBREAKPOINT is set.
DEBUGGER_HOOK = "slurmrun.node.debugger.set_trace"
# torchrun's run id without --rdzv-id; under SLURM: the job's id (`--rdzv-id=$SLURM_JOB_ID`).
NO_RUN_ID = "none"

# SLURM's per-task and per-step-layout variables (srun(1), OUTPUT ENVIRONMENT VARIABLES), each
# set as srun sets it for a task of a step with the run's layout. SLURM_NTASKS_PER_NODE is set
# only where every node runs the same number of workers (srun sets it only when asked for one).
TASK_VARS = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_GTIDS",
    "SLURM_TASK_PID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NNODES",
    "SLURM_STEP_NUM_NODES",
)
# The job's values (as its batch script or salloc shell sees them) of variables that srun reads
# as options, so the launcher keeps them out of the agents' srun; a task of a plain `srun` in
# the job inherits them. Absent in the job: absent in the worker.
JOB_VARS = (
    "SLURM_JOB_NAME",
    "SLURM_JOB_NUM_NODES",
    "SLURM_CPUS_PER_TASK",
    "SLURM_CPUS_PER_GPU",
    "SLURM_MEM_PER_CPU",
    "SLURM_MEM_PER_GPU",
    "SLURM_MEM_PER_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
    "SLURM_NTASKS_PER_GPU",
)
REMOVED_PREFIXES = ("PMI_", "PMIX_")
# The agent's own: where its launcher listens (names the user may also set for a launcher of
# theirs: a launch in a worker must not take the agent's for those).
AGENTS_OWN = (LAUNCHER_ADDR_VAR, PORT_VAR)

_COUNT_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class RankPlace:
    """Where one worker stands in its run.

    Attributes:
        rank: its global rank.
        local_rank: its rank on its node.
        world_size: the run's worker count.
        local_world_size: its node's worker count.
        node_rank: its node's index in the run.
        master_addr: where rank 0's store listens.
        master_port: that store's port.
        tasks_per_node: every node's worker count, in SLURM's compressed form (``"2(x2),1"``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    tasks_per_node: str


def compress_counts(counts: Sequence[int]) -> str:
    """Per-node counts in SLURM's compressed form: ``[2, 2, 1]`` is ``"2(x2),1"``."""
    items: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        items.append(str(counts[i]) if j - i == 1 else f"{counts[i]}(x{j - i})")
        i = j
    return ",".join(items)


def expand_counts(value: str, variable: str) -> list[int]:
    """Expand SLURM's compressed per-node counts, e.g. ``"36(x2),72"`` to ``[36, 36, 72]``.

    Args:
        value: the compressed list, as in ``SLURM_JOB_CPUS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``.
        variable: the variable the value came from, for error messages.

    Returns:
        One count per node.

    Raises:
        ValueError: if the value is not of the form ``N`` or ``N(xR)``, comma-separated.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _COUNT_ITEM.fullmatch(item.strip())
        if match is None or match.group(2) == "0":
            raise ValueError(
                f"{variable}={value!r} is malformed: expected comma-separated counts such as "
                f"'4' or '36(x2),72' (a count, optionally followed by '(xR)' for R nodes)"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def restart_vars(attempt: int, max_restarts: int) -> dict[str, str]:
    """The restart count and bound torchrun gives workers, for one attempt of a launch."""
    return {
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }


# torch's NCCL flight recorder: entries kept per rank, when a launch turns it on.
FLIGHT_RECORDER_ENTRIES = 2000
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # torch appends the rank


def flight_recorder_vars(directory: str) -> dict[str, str]:
    """What turns on torch's NCCL flight recorder, with its dumps in `directory`.

    Each rank keeps its last collectives and dumps them (on a collective's timeout, as
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` asks) to ``<directory>/nccl_trace_rank_<rank>``, ready for
    ``python -m torch.distributed.flight_recorder.fr_trace <directory>``. Both of torch's
    names are set: ``TORCH_FR_*`` (torch 2.6 and later) and ``TORCH_NCCL_*`` (before). gloo
    ignores them.
    """
    prefix = f"{directory.rstrip('/')}/{FLIGHT_RECORDER_PREFIX}"
    entries = str(FLIGHT_RECORDER_ENTRIES)
    return {
        "TORCH_FR_BUFFER_SIZE": entries,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": entries,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def job_vars(environ: Mapping[str, str]) -> str:
    """The job's `JOB_VARS` in the launcher's `environ`, as the agents carry them (JSON)."""
    return json.dumps({name: environ[name] for name in JOB_VARS if name in environ})


def worker_changes(
    environ: Mapping[str, str], place: RankPlace, job: str | None, *, pid: int
) -> tuple[dict[str, str], list[str]]:
    """What a worker sets in, and removes from, the environment it inherited.

    Args:
        environ: the worker's environment before (its agent's, with the run's variables).
        place: where the worker stands.
        job: the job's `JOB_VARS` (`job_vars`), where the agents were started by srun in the
            job; None: the worker's own SLURM variables are the job's.
        pid: the worker's process id.

    Returns:
        The variables to set, and the names to remove.
    """
    counts = expand_counts(place.tasks_per_node, "tasks_per_node")
    first = place.rank - place.local_rank
    values = {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "GROUP_RANK": str(place.node_rank),
        "NODE_RANK": str(place.node_rank),
        "ROLE_RANK": str(place.rank),
        "ROLE_NAME": ROLE_NAME,
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_WORLD_SIZE": str(len(counts)),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        "TORCHELASTIC_RUN_ID": environ.get("SLURM_JOB_ID") or NO_RUN_ID,
        "TORCHELASTIC_RESTART_COUNT": environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        "TORCHELASTIC_MAX_RESTARTS": environ.get("TORCHELASTIC_MAX_RESTARTS", "0"),
        # Workers make their own store (rank 0 serves it); torch reads "True" only.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if "OMP_NUM_THREADS" not in environ and place.local_world_size > 1:
        values["OMP_NUM_THREADS"] = "1"  # torchrun's default where a node runs several workers
    if "PYTHONBREAKPOINT" not in environ:
        values["PYTHONBREAKPOINT"] = DEBUGGER_HOOK
    removed = [n for n in environ if n.startswith(REMOVED_PREFIXES) or n in AGENTS_OWN]
    if "SLURM_JOB_ID" not in environ:
        return values, removed
    world = str(place.world_size)
    values |= {
        "SLURM_PROCID": str(place.rank),
        "SLURM_LOCALID": str(place.local_rank),
        "SLURM_NODEID": str(place.node_rank),
        "SLURM_GTIDS": ",".join(str(first + i) for i in range(place.local_world_size)),
        "SLURM_TASK_PID": str(pid),
        "SLURM_NTASKS": world,
        "SLURM_NPROCS": world,
        "SLURM_STEP_NUM_TASKS": world,
        "SLURM_TASKS_PER_NODE": place.tasks_per_node,
        "SLURM_STEP_TASKS_PER_NODE": place.tasks_per_node,
        "SLURM_NNODES": str(len(counts)),
        "SLURM_STEP_NUM_NODES": str(len(counts)),
    }
    if len(set(counts)) == 1:
        values["SLURM_NTASKS_PER_NODE"] = str(counts[0])
    else:
        removed.append("SLURM_NTASKS_PER_NODE")
    if job is not None:
        job_values: dict[str, str] = json.loads(job)
        for name in JOB_VARS:
            if name in job_values:
                values[name] = job_values[name]
            else:
                removed.append(name)
    return values, [name for name in removed if name in environ and name not in values]


# What a preview shows where a value is known only when the run starts.
_LATER = {
    "MASTER_ADDR": "<rank-0-agent-address>",
    "MASTER_PORT": "<free-port>",
    "SLURM_TASK_PID": "<worker-pid>",
}


def preview(
    environ: Mapping[str, str], counts: Sequence[int], job: str | None = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """What rank 0 would set and remove (`worker_changes`), for ``slurmrun info`` and dry runs.

    Args:
        environ: the environment the agents would start with.
        counts: every node's worker count.
        job: as for `worker_changes`.

    Returns:
        The variables rank 0 would set, sorted by name, with `_LATER`'s stand-ins for values
        known only when the run starts, and the names it would remove (but `AGENTS_OWN`:
        the agents' own way back, which slurmrun itself sets for them).
    """
    place = RankPlace(
        rank=0,
        local_rank=0,
        world_size=sum(counts),
        local_world_size=counts[0],
        node_rank=0,
        master_addr="",
        master_port=0,
        tasks_per_node=compress_counts(counts),
    )
    values, removed = worker_changes(environ, place, job, pid=0)
    shown = sorted((name, _LATER.get(name, value)) for name, value in values.items())
    return shown, [name for name in removed if name not in AGENTS_OWN]
