"""The SLURM job this process runs in, from SLURM's variables (and scontrol inside a step).

Its nodes, their CPUs, tasks and GPUs (`slurm_allocation`), the step it runs in, and how many
workers an agent starts for ``workers_per_host="auto"``. It never imports torch nor
initialises CUDA, so it is cheap to import and safe to call before forking workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from slurmrun.devices import usable_cpu_count, visible_gpu_count
from slurmrun.slurm.notation import expand_hostlist, requested_gpus
from slurmrun.slurm.scontrol import (
    SCONTROL_SOURCE,
    job_tasks_per_node,
    parse_scontrol_gpus,
    scontrol_show_job,
)
from slurmrun.slurm.step import step_id
from slurmrun.variables import JOB_TASKS_VAR
from slurmrun.worker_env import expand_counts

__all__ = [
    "DriverStep",
    "SlurmAllocation",
    "agent_auto_workers",
    "auto_workers_per_host",
    "env_job_id",
    "job_gpus_per_node",
    "job_hostnames",
    "job_node_index",
    "own_job_id",
    "slurm_allocation",
]


@dataclass(frozen=True)
class DriverStep:
    """The job step this process runs in (e.g. ``srun -N1 -n1 python train.py``).

    Attributes:
        step_id: ``<job id>.<step id>``.
        num_tasks: how many tasks the step has (``SLURM_STEP_NUM_TASKS``).
        proc_id: this task's rank in the step (``SLURM_PROCID``).
    """

    step_id: str
    num_tasks: int
    proc_id: int


@dataclass(frozen=True)
class SlurmAllocation:
    """The nodes of a SLURM job and what each of them was given.

    All per-node lists are in the order of ``hostnames``, which is SLURM's node list order.

    Attributes:
        job_id: the job's id (``SLURM_JOB_ID``).
        hostnames: the job's nodes, expanded from ``SLURM_JOB_NODELIST``.
        cpus_per_node: CPUs SLURM allocated to the job on each node.
        tasks_per_node: tasks the job was given on each node, or None if SLURM did not say.
        gpus_per_node: GPUs the job asked for on each node, or None if the environment does not
            tell (then each node's agent counts the GPUs it sees).
        driver_step: the step this process runs in, or None in the job's own shell (the
            ``salloc`` shell or the batch script).
        sources: where each figure came from, by attribute name (``"gpus_per_node"``...):
            the variable (``"SLURM_GPUS_PER_NODE"``) or ``"scontrol show job -d"``; figures
            that are None have no entry. For people (``slurmrun info``), not for equality.
    """

    job_id: str
    hostnames: list[str]
    cpus_per_node: list[int]
    tasks_per_node: list[int] | None
    gpus_per_node: list[int] | None
    driver_step: DriverStep | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def node_index(self, hostname: str) -> int:
        """Return the index of ``hostname`` in the job's node list.

        A fully qualified name also matches its short form, because SLURM node names are
        usually short while ``socket.gethostname()`` may return the FQDN.

        Args:
            hostname: the host to look up.

        Returns:
            The position of the host in ``hostnames``.

        Raises:
            ValueError: if the host is not one of the job's nodes.
        """
        for candidate in (hostname, hostname.split(".", 1)[0]):
            if candidate in self.hostnames:
                return self.hostnames.index(candidate)
        raise ValueError(
            f"host {hostname!r} is not part of SLURM job {self.job_id}, whose nodes are "
            f"{', '.join(self.hostnames)}"
        )


def slurm_allocation(
    environ: Mapping[str, str] | None = None,
    scontrol: Callable[[str], str | None] | None = None,
) -> SlurmAllocation | None:
    """Describe the SLURM job this process runs in, also from inside one of its steps.

    The nodes and CPUs per node come from the job-level variables ``SLURM_JOB_NODELIST`` and
    ``SLURM_JOB_CPUS_PER_NODE``, which every process of the job sees alike.

    In the job's own shell (the ``salloc`` shell, the batch script), tasks per node come from
    ``SLURM_TASKS_PER_NODE`` and GPUs per node, in order, from ``SLURM_GPUS_ON_NODE`` then
    ``SLURM_JOB_GPUS`` (single-node jobs only: they describe just the node this process is
    on), ``SLURM_GPUS_PER_NODE``, ``SLURM_TRES_PER_NODE``, ``SLURM_JOB_GRES``, and last
    ``SLURM_GPUS`` (a job total, used only when it splits evenly across the nodes).

    Inside a step (`step_id`: ``SLURM_STEP_ID`` is a regular step id, e.g. ``srun -N1 -n1
    python train.py``; not a batch script's ``-5``) those variables describe the step, not
    the job, so tasks and GPUs per node come from ``scontrol show job -d`` instead (see
    `job_tasks_per_node` and `parse_scontrol_gpus`), and ``driver_step`` says which step
    this is.

    Args:
        environ: the environment to read; ``os.environ`` by default.
        scontrol: returns the output of ``scontrol show job -d <job id>`` or None; called only
            inside a step. Default: run scontrol (`scontrol_show_job`).

    Returns:
        The allocation, or None outside a SLURM job (neither ``SLURM_JOB_ID`` nor
        ``SLURM_JOBID`` is set). Counts that cannot be known are None.

    Raises:
        ValueError: if a SLURM variable is missing or malformed; the message names it.
    """
    env = os.environ if environ is None else environ
    job_id = env_job_id(env)
    if job_id is None:
        return None
    hostnames = _hostnames(env)
    cpus_per_node = _per_node_counts(env, "SLURM_JOB_CPUS_PER_NODE", hostnames)
    if cpus_per_node is None:
        raise ValueError(f"SLURM_JOB_ID is set but SLURM_JOB_CPUS_PER_NODE is not (job {job_id})")
    num_nodes = env.get("SLURM_JOB_NUM_NODES")
    if num_nodes is not None and num_nodes.strip() != str(len(hostnames)):
        raise ValueError(
            f"SLURM_JOB_NUM_NODES={num_nodes!r} but SLURM_JOB_NODELIST has {len(hostnames)} "
            f"nodes ({', '.join(hostnames)})"
        )
    sources = {
        "job_id": "SLURM_JOB_ID" if env.get("SLURM_JOB_ID") else "SLURM_JOBID",
        "hostnames": "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST",
        "cpus_per_node": "SLURM_JOB_CPUS_PER_NODE",
    }
    step = _driver_step(env, job_id)
    if step is None:
        tasks = _per_node_counts(env, "SLURM_TASKS_PER_NODE", hostnames)
        gpus, gpu_source = requested_gpus(env, len(hostnames))
        if tasks is not None:
            sources["tasks_per_node"] = "SLURM_TASKS_PER_NODE"
        if gpu_source is not None:
            sources["gpus_per_node"] = gpu_source
    else:
        sources["driver_step"] = "SLURM_STEP_ID, SLURM_STEP_NUM_TASKS, SLURM_PROCID"
        text = (scontrol or scontrol_show_job)(job_id)
        tasks = None
        gpus = None
        if text:
            with contextlib.suppress(ValueError):  # unreadable output: as if scontrol said nothing
                tasks = job_tasks_per_node(text, cpus_per_node)
                per_host = parse_scontrol_gpus(text)
                if all(h in per_host for h in hostnames):
                    gpus = [per_host[h] for h in hostnames]
        for name, value in (("tasks_per_node", tasks), ("gpus_per_node", gpus)):
            if value is not None:
                sources[name] = SCONTROL_SOURCE
    return SlurmAllocation(
        job_id=job_id,
        hostnames=hostnames,
        cpus_per_node=cpus_per_node,
        tasks_per_node=tasks,
        gpus_per_node=gpus,
        driver_step=step,
        sources=sources,
    )


def job_gpus_per_node(
    alloc: SlurmAllocation, scontrol: Callable[[str], str | None] | None = None
) -> list[int]:
    """GPUs the job has on each of its nodes, for a step to ask for; 0 where nothing tells.

    ``alloc.gpus_per_node`` when SLURM's variables told (or, inside a step, scontrol: there
    `slurm_allocation` asked it already, and it is not asked twice). Else, in the job's shell,
    ``scontrol show job -d`` is asked once: e.g. ``--gpus=N`` spread unevenly, or a login-side
    shell with no per-node variable.

    Args:
        alloc: the job, as `slurm_allocation` read it.
        scontrol: as for `slurm_allocation`; called only in the job's shell, when
            ``alloc.gpus_per_node`` is None.

    Returns:
        One count per node of ``alloc.hostnames``.
    """
    if alloc.gpus_per_node is not None:
        return list(alloc.gpus_per_node)
    per_host: dict[str, int] = {}
    if alloc.driver_step is None:
        text = (scontrol or scontrol_show_job)(alloc.job_id)
        with contextlib.suppress(ValueError):  # unreadable output: as if scontrol said nothing
            per_host = parse_scontrol_gpus(text or "")
    return [per_host.get(h, 0) for h in alloc.hostnames]


def job_hostnames(environ: Mapping[str, str]) -> list[str] | None:
    """The job's nodes from its node list alone (``SLURM_JOB_NODELIST``), without scontrol.

    Args:
        environ: the environment to read.

    Returns:
        The nodes, or None outside a job.

    Raises:
        ValueError: if the node list is missing or malformed.
    """
    return None if env_job_id(environ) is None else _hostnames(environ)


def job_node_index(environ: Mapping[str, str], hostname: str) -> int | None:
    """This host's index in the job's node list (``SLURM_JOB_NODELIST``), without scontrol.

    Args:
        environ: the environment to read.
        hostname: the host; a fully qualified name also matches its short form.

    Returns:
        The index, or None outside a job or if the host is not one of the job's nodes.

    Raises:
        ValueError: if the node list is malformed.
    """
    hosts = job_hostnames(environ)
    if hosts is None:
        return None
    for candidate in (hostname, hostname.split(".", 1)[0]):
        if candidate in hosts:
            return hosts.index(candidate)
    return None


def own_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """This process's job as scontrol and submitit name it (None outside a job).

    ``<array id>_<task id>`` in an array task, whose ``SLURM_JOB_ID`` may be the array's id
    (which names every task to scontrol); else ``SLURM_JOB_ID``.
    """
    env = os.environ if env is None else env
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task and env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{task}"
    return env_job_id(env)


def auto_workers_per_host(
    environ: Mapping[str, str] | None = None,
    node_index: int | None = None,
    *,
    dev_dir: str | os.PathLike[str] = "/dev",
) -> int:
    """Decide how many workers an agent starts for ``workers_per_host="auto"``.

    The rule: one per GPU the agent sees, if it sees any; else, inside SLURM, the number of
    tasks the job was given on this node (``SLURM_TASKS_PER_NODE``), or 1 if that is unknown;
    outside SLURM, one per usable CPU.

    Note that ``srun`` overwrites ``SLURM_TASKS_PER_NODE`` with the step's own layout, so an
    agent started by ``srun`` must be given the job's value (e.g. in ``environ``) to follow
    what the job asked for.

    Args:
        environ: the environment to read; ``os.environ`` by default.
        node_index: this node's index in the job's node list
            (see `SlurmAllocation.node_index`); None if not known.
        dev_dir: where device files live; a parameter so tests can fake it.

    Returns:
        The number of workers, at least 1 unless SLURM says 0 tasks for this node.

    Raises:
        ValueError: if ``SLURM_TASKS_PER_NODE`` is malformed or has no entry for ``node_index``.
    """
    env = os.environ if environ is None else environ
    gpus = visible_gpu_count(env, dev_dir=dev_dir)
    if gpus > 0:
        return gpus
    if env_job_id(env) is None:
        return usable_cpu_count()
    value = env.get("SLURM_TASKS_PER_NODE")
    if value is None or node_index is None:
        return 1
    tasks = expand_counts(value, "SLURM_TASKS_PER_NODE")
    if not 0 <= node_index < len(tasks):
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={value!r} lists {len(tasks)} nodes; "
            f"it has no entry for node index {node_index}"
        )
    return tasks[node_index]


def agent_auto_workers(environ: Mapping[str, str], hostname: str) -> int:
    """`auto_workers_per_host` for an agent on `hostname`, from the agent's environment.

    An srun agent is a task of the agents' step, where ``SLURM_TASKS_PER_NODE`` describes
    that step: the job's own layout comes from the launcher (`variables.JOB_TASKS_VAR`). The
    node list is job-level; scontrol is not asked here (every agent of a large job would ask
    the controller at once).
    """
    environ = dict(environ)
    job_tasks = environ.get(JOB_TASKS_VAR)
    if job_tasks:
        environ["SLURM_TASKS_PER_NODE"] = job_tasks
    else:
        environ.pop("SLURM_TASKS_PER_NODE", None)
    return auto_workers_per_host(environ, job_node_index(environ, hostname))


def env_job_id(env: Mapping[str, str]) -> str | None:
    """The job id that `env` names (``SLURM_JOB_ID``); None outside a job."""
    # SLURM_JOBID is the older spelling; SLURM still sets both.
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def _driver_step(env: Mapping[str, str], job_id: str) -> DriverStep | None:
    """The step this process is a task of; None in the job's shell (`step_id` says)."""
    step = step_id(env)
    if step is None:
        return None
    counts = []
    for variable in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        value = env.get(variable, "0" if variable == "SLURM_PROCID" else "1").strip()
        if not value.isdigit():
            raise ValueError(f"{variable}={value!r} is malformed: expected a number")
        counts.append(int(value))
    return DriverStep(step_id=f"{job_id}.{step}", num_tasks=counts[0], proc_id=counts[1])


def _hostnames(env: Mapping[str, str]) -> list[str]:
    # SLURM_NODELIST is overwritten by srun with the step's nodes; SLURM_JOB_NODELIST is not.
    for variable in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        value = env.get(variable)
        if value is not None:
            hosts = expand_hostlist(value, f"{variable}={value!r}")
            if not hosts:
                raise ValueError(f"{variable} is empty: expected the job's nodes, e.g. node[1-4]")
            return hosts
    raise ValueError(
        "SLURM_JOB_ID is set but neither SLURM_JOB_NODELIST nor SLURM_NODELIST is: "
        "cannot tell which nodes the job has"
    )


def _per_node_counts(
    env: Mapping[str, str], variable: str, hostnames: list[str]
) -> list[int] | None:
    value = env.get(variable)
    if value is None:
        return None
    counts = expand_counts(value, variable)
    if len(counts) != len(hostnames):
        raise ValueError(
            f"{variable}={value!r} gives {len(counts)} nodes but SLURM_JOB_NODELIST has "
            f"{len(hostnames)} ({', '.join(hostnames)})"
        )
    return counts
