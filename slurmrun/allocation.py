"""What hosts and workers a SLURM allocation (or the local machine) has.

Reads SLURM's environment variables and, on request, ``scontrol`` output. It never imports
torch nor initialises CUDA, so it is cheap to import and safe to call before forking workers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import hostlist

from slurmrun.protocol import JOB_TASKS_VAR
from slurmrun.worker_env import expand_counts

__all__ = [
    "DriverStep",
    "Preemption",
    "SlurmAllocation",
    "agent_auto_workers",
    "auto_workers_per_host",
    "expand_counts",
    "first_record",
    "job_gpus_per_node",
    "job_hostnames",
    "job_node_index",
    "job_tasks_per_node",
    "own_job_id",
    "parse_scontrol_gpus",
    "parse_scontrol_tasks",
    "preemption",
    "scontrol",
    "scontrol_fields",
    "scontrol_gpus",
    "slurm_allocation",
    "usable_cpu_count",
    "visible_gpu_count",
]

_NVIDIA_DEVICE = re.compile(r"nvidia\d+")
# One GRES item of `scontrol show job -d`: "gpu:a100:2" optionally followed by "(IDX:0-1)".
_GRES_ITEM = re.compile(r"([^,()]+)(?:\(([^)]*)\))?")
# Keys that belong to one per-node line of `scontrol show job -d`.
_SCONTROL_NODE_KEYS = frozenset({"Nodes", "CPU_IDs", "Mem", "GRES", "GRES_IDX"})
_NO_CUDA_DEVICES = frozenset({"NoDevFiles"})
# `scontrol show job` fields that tell how many tasks the job has (see job_tasks_per_node).
# How `SlurmAllocation.sources` names figures read from scontrol.
SCONTROL_SOURCE = "scontrol show job -d"
_SCONTROL_TASK_FIELDS = re.compile(r"\b(NumNodes|NumTasks|CPUs/Task|NtasksPerN:B:S:C)=(\S+)")


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

    Inside a step (``SLURM_STEP_ID`` is set, e.g. ``srun -N1 -n1 python train.py``) those
    variables describe the step, not the job, so tasks and GPUs per node come from
    ``scontrol show job -d`` instead (see `job_tasks_per_node` and `parse_scontrol_gpus`),
    and ``driver_step`` says which step this is.

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
    job_id = _job_id(env)
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
        gpus, gpu_source = _gpus_per_node(env, len(hostnames))
        if tasks is not None:
            sources["tasks_per_node"] = "SLURM_TASKS_PER_NODE"
        if gpu_source is not None:
            sources["gpus_per_node"] = gpu_source
        return SlurmAllocation(
            job_id=job_id,
            hostnames=hostnames,
            cpus_per_node=cpus_per_node,
            tasks_per_node=tasks,
            gpus_per_node=gpus,
            sources=sources,
        )
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
    return None if _job_id(environ) is None else _hostnames(environ)


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


def parse_scontrol_tasks(text: str) -> tuple[int, int, int, int] | None:
    """Read ``(NumNodes, NumTasks, CPUs/Task, ntasks per node)`` from ``scontrol show job``.

    Args:
        text: the output of ``scontrol show job [-d] <job id>``.

    Returns:
        The four numbers (ntasks per node 0 when not requested), or None if the text lacks
        one of them (e.g. the job is pending and has no nodes yet).
    """
    fields = dict(_SCONTROL_TASK_FIELDS.findall(text))
    values = [
        fields.get("NumNodes", ""),
        fields.get("NumTasks", ""),
        fields.get("CPUs/Task", ""),
        fields.get("NtasksPerN:B:S:C", "").split(":", 1)[0],
    ]
    if not all(v.isdigit() for v in values):
        return None
    nodes, tasks, cpus_per_task, per_node = (int(v) for v in values)
    return nodes, tasks, cpus_per_task, per_node


def job_tasks_per_node(text: str, cpus_per_node: Sequence[int]) -> list[int] | None:
    """The job's tasks per node, as SLURM computes ``SLURM_TASKS_PER_NODE`` for the job's shell.

    SLURM lays the job's tasks out over its nodes like a block-distributed step: each node
    holds up to ``CPUs / CPUs per task`` tasks, filled round by round. When no task count was
    asked for, the job has one task per ``CPUs per task`` CPUs. ``scontrol`` does not tell an
    explicit ``--ntasks`` equal to the node count from no ``--ntasks`` at all: both count as
    "not asked for" here (they differ only when a node has more CPUs than tasks, e.g.
    ``-N2 -n2 --exclusive``).

    Args:
        text: the output of ``scontrol show job [-d] <job id>``.
        cpus_per_node: the job's CPUs on each node (``SLURM_JOB_CPUS_PER_NODE``).

    Returns:
        Tasks per node, or None if scontrol's text does not say enough.
    """
    parsed = parse_scontrol_tasks(text)
    if parsed is None or parsed[0] != len(cpus_per_node) or parsed[2] < 1:
        return None
    nodes, num_tasks, cpus_per_task, per_node = parsed
    if per_node > 0:
        return [per_node] * nodes
    capacity = [cpus // cpus_per_task for cpus in cpus_per_node]
    if num_tasks == nodes:  # the default when no task count was asked for
        return capacity
    tasks = [0] * nodes
    placed, round_, oversubscribe = 0, 0, False
    while placed < num_tasks:  # SLURM's _task_layout_block (not packing nodes)
        room_left = False
        for i in range(nodes):
            if placed == num_tasks:
                break
            if round_ < capacity[i] or oversubscribe:
                tasks[i] += 1
                placed += 1
                room_left = room_left or round_ + 1 < capacity[i]
        oversubscribe = oversubscribe or not room_left
        round_ += 1
    return tasks


def scontrol(args: Sequence[str], timeout: float = 10) -> str | None:
    """The output of ``scontrol ARGS...``, or None if scontrol fails or is missing.

    Args:
        args: scontrol's arguments (``["show", "config"]``).
        timeout: seconds to wait for scontrol before giving up.
    """
    try:
        result = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def scontrol_show_job(job_id: str, timeout: float = 10) -> str | None:
    """The output of ``scontrol show job -d <job_id>``, or None if scontrol fails or is missing.

    Args:
        job_id: the SLURM job id.
        timeout: seconds to wait for scontrol before giving up.
    """
    return scontrol(["show", "job", "-d", job_id], timeout)


def scontrol_fields(text: str) -> dict[str, str]:
    """The fields of scontrol's output, as one dict (the first of a key wins).

    ``Key=Value`` words (``scontrol show job/partition``) and ``Key = Value`` lines
    (``scontrol show config``) alike. For a job, pass its own record only: ``scontrol show
    job <array id>`` lists every task of the array after it (`first_record`).
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and " " not in key.strip():
            fields.setdefault(key.strip(), value.strip())
            continue
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep:
                fields.setdefault(key, value)
    return fields


def first_record(text: str) -> str:
    """The first record of ``scontrol show job`` (records are separated by blank lines)."""
    return text.strip().split("\n\n")[0]


# A launch fails seconds after SLURM terminates a preempted job's steps; an older PreemptTime
# is left from an earlier suspension (PreemptMode=SUSPEND), which SLURM never clears.
PREEMPTED_RECENTLY = 600.0


@dataclass(frozen=True)
class Preemption:
    """A job that SLURM is preempting (``scontrol show job``).

    Attributes:
        job_id: the job (``<array id>_<task id>`` for an array task).
        time: when SLURM selected it (``PreemptTime``).
        requeueable: whether SLURM may requeue it (``Requeue=1``: ``--requeue``, or the
            cluster's ``JobRequeue=1``).
    """

    job_id: str
    time: str
    requeueable: bool


def own_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """This process's job as scontrol and submitit name it (None outside a job).

    ``<array id>_<task id>`` in an array task, whose ``SLURM_JOB_ID`` may be the array's id
    (which names every task to scontrol); else ``SLURM_JOB_ID``.
    """
    env = os.environ if env is None else env
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task and env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{task}"
    return _job_id(env)


def preemption(
    job_id: str,
    scontrol: Callable[[str], str | None] | None = None,
    now: datetime.datetime | None = None,
) -> Preemption | None:
    """Whether SLURM is preempting job `job_id` (None: it is not, or scontrol fails).

    With a partition's ``GraceTime``, a preempted job's steps (agents and workers) get SIGTERM
    while the job runs on: a launch that fails then asks this (one ``scontrol`` call). Only a
    ``PreemptTime`` of the last `PREEMPTED_RECENTLY` seconds counts.

    Args:
        job_id: the job (`own_job_id`).
        scontrol: ``scontrol show job``'s output for a job id (default: run it).
        now: the time to compare ``PreemptTime`` with (default: now; SLURM prints local time).
    """
    fields = scontrol_fields(first_record((scontrol or scontrol_show_job)(job_id) or ""))
    try:
        when = datetime.datetime.fromisoformat(fields.get("PreemptTime", ""))
    except ValueError:  # "None", "Unknown", or no such job
        return None
    age = ((now or datetime.datetime.now()) - when).total_seconds()
    if not -60 <= age <= PREEMPTED_RECENTLY:  # a minute of clock skew between hosts
        return None
    return Preemption(job_id, fields["PreemptTime"], fields.get("Requeue") == "1")


def parse_scontrol_gpus(text: str) -> dict[str, int]:
    """Read how many GPUs each node of a job has from ``scontrol show job -d`` output.

    Understands the per-node lines ``Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)``,
    typed GPUs (``gpu:a100:2(IDX:0-1)``, several types summed), the older
    ``GRES_IDX=gpu(IDX:0,2-3)`` form (counted from the indices) and ``scontrol -o`` one-line
    output. Nodes listed without GPUs count 0.

    Args:
        text: the output of ``scontrol show job -d <job_id>``.

    Returns:
        GPUs per hostname, node lists expanded; empty if the text lists no nodes (e.g. the job
        is pending).

    Raises:
        ValueError: if a node list or a GPU count in the text is malformed.
    """
    gpus: dict[str, int] = {}
    current: list[str] = []
    for token in text.split():
        key, _, value = token.partition("=")
        if key not in _SCONTROL_NODE_KEYS:
            current = []
        elif key == "Nodes":
            current = _expand_hostlist(value, f"Nodes={value!r} in scontrol output")
            for host in current:
                gpus.setdefault(host, 0)
        elif key in {"GRES", "GRES_IDX"}:
            count = _scontrol_gres_gpus(value)
            for host in current:
                gpus[host] += count
    return gpus


def scontrol_gpus(job_id: str, timeout: float = 10) -> dict[str, int] | None:
    """Ask ``scontrol show job -d`` how many GPUs each node of a job has.

    Args:
        job_id: the SLURM job id.
        timeout: seconds to wait for scontrol before giving up.

    Returns:
        GPUs per hostname, or None if scontrol is missing, fails, times out, or prints nothing
        that can be read.
    """
    text = scontrol_show_job(job_id, timeout)
    if text is None:
        return None
    try:
        gpus = parse_scontrol_gpus(text)
    except ValueError:
        return None
    return gpus or None


def visible_gpu_count(
    environ: Mapping[str, str] | None = None, *, dev_dir: str | os.PathLike[str] = "/dev"
) -> int:
    """Count the NVIDIA GPUs this process may use, without importing torch or touching CUDA.

    ``CUDA_VISIBLE_DEVICES`` decides when set (SLURM sets it in steps that got GPUs);
    otherwise the ``nvidia<N>`` device files in ``dev_dir`` are counted.

    Args:
        environ: the environment to read; ``os.environ`` by default.
        dev_dir: where device files live; a parameter so tests can fake it.

    Returns:
        The number of GPUs, 0 if none.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _count_cuda_visible_devices(visible)
    try:
        names = [entry.name for entry in Path(dev_dir).iterdir()]
    except OSError:
        return 0
    return sum(1 for name in names if _NVIDIA_DEVICE.fullmatch(name))


def usable_cpu_count() -> int:
    """Return how many CPUs this process may run on (its affinity mask, else all CPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # sched_getaffinity is Linux-only
        return os.cpu_count() or 1


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
    if _job_id(env) is None:
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
    that step: the job's own layout comes from the launcher (`protocol.JOB_TASKS_VAR`). The
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


def _job_id(env: Mapping[str, str]) -> str | None:
    # SLURM_JOBID is the older spelling; SLURM still sets both.
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def _driver_step(env: Mapping[str, str], job_id: str) -> DriverStep | None:
    """The step this process is a task of; None in the job's shell (no SLURM_STEP_ID there)."""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not step:
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
            hosts = _expand_hostlist(value, f"{variable}={value!r}")
            if not hosts:
                raise ValueError(f"{variable} is empty: expected the job's nodes, e.g. node[1-4]")
            return hosts
    raise ValueError(
        "SLURM_JOB_ID is set but neither SLURM_JOB_NODELIST nor SLURM_NODELIST is: "
        "cannot tell which nodes the job has"
    )


def _expand_hostlist(value: str, label: str) -> list[str]:
    """Expand a host list; ``label`` says where it came from in error messages."""
    try:
        hosts: list[str] = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as error:
        raise ValueError(
            f"{label} is not a valid SLURM host list ({error}); "
            f"expected a form such as 'node[1-3,7],login5'"
        ) from error
    return hosts


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


def _gpus_per_node(env: Mapping[str, str], num_nodes: int) -> tuple[list[int] | None, str | None]:
    """GPUs per node from SLURM's request variables, most precise first, and the variable read.

    (None, None) if no variable says.
    """
    # SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS describe only the node this process runs on (the
    # batch node), so they are trusted only for single-node jobs, where that node is the job.
    if num_nodes == 1:
        for variable, read in (
            ("SLURM_GPUS_ON_NODE", _read_int),
            ("SLURM_JOB_GPUS", _read_index_count),
        ):
            value = env.get(variable)
            if value:
                return [read(value, variable)], variable
    for variable, read_request in (
        ("SLURM_GPUS_PER_NODE", _read_typed_counts),
        ("SLURM_TRES_PER_NODE", _read_gres_gpus),
        ("SLURM_JOB_GRES", _read_gres_gpus),
    ):
        value = env.get(variable)
        count = read_request(value, variable) if value else None
        if count is not None:
            return [count] * num_nodes, variable
    total = env.get("SLURM_GPUS")
    if total:
        # --gpus=N is a job total SLURM may spread unevenly; only an even split is a safe guess.
        count = _read_typed_counts(total, "SLURM_GPUS")
        if count % num_nodes == 0:
            return [count // num_nodes] * num_nodes, "SLURM_GPUS"
    return None, None


def _malformed_gpus(variable: str, value: str, expected: str) -> ValueError:
    return ValueError(f"{variable}={value!r} is malformed: expected {expected}")


def _read_int(value: str, variable: str) -> int:
    if not value.strip().isdigit():
        raise _malformed_gpus(variable, value, "a GPU count such as '4'")
    return int(value)


def _read_index_count(value: str, variable: str) -> int:
    """Count GPU indices such as ``0,1,3`` or ``0-3``."""
    try:
        return _count_indices(value)
    except ValueError as error:
        raise _malformed_gpus(variable, value, "GPU indices such as '0,1' or '0-3'") from error


def _read_typed_counts(value: str, variable: str) -> int:
    """Sum ``[type:]count`` items such as ``2``, ``a100:2`` or ``a100:2,v100:1``."""
    total = 0
    for item in value.split(","):
        count = item.strip().rsplit(":", 1)[-1]
        if not count.isdigit():
            raise _malformed_gpus(
                variable, value, "GPU counts such as '2', 'a100:2' or 'a100:2,v100:1'"
            )
        total += int(count)
    return total


def _read_gres_gpus(value: str, variable: str) -> int | None:
    """Sum the GPUs in a GRES/TRES list such as ``gres/gpu:a100:2,gres/shard:1``.

    Returns None if the list names no GPUs at all.
    """
    total: int | None = None
    for item in value.split(","):
        count = _gres_item_gpus(item.strip().replace("=", ":"))
        if count is None:
            continue
        if count < 0:
            raise _malformed_gpus(
                variable, value, "GPU requests such as 'gres/gpu:2', 'gres:gpu:a100:2' or 'gpu:2'"
            )
        total = (total or 0) + count
    return total


def _gres_item_gpus(item: str) -> int | None:
    """GPUs in one GRES item: None if not a GPU, -1 if the count is malformed."""
    for prefix in ("gres/", "gres:"):
        item = item.removeprefix(prefix)
    name, *rest = item.split(":")
    if name != "gpu":
        return None
    if not rest:  # a bare "gpu" means one, as in --gres=gpu
        return 1
    if rest[-1].isdigit():
        return int(rest[-1])
    # "gpu:a100" (a type, no count) means one; anything stranger is malformed.
    return 1 if len(rest) == 1 and rest[0] else -1


def _scontrol_gres_gpus(value: str) -> int:
    """GPUs in a ``GRES=`` value of ``scontrol show job -d``: ``gpu:a100:2(IDX:0-1),...``."""
    try:
        return sum(
            _scontrol_item_gpus(match.group(1), match.group(2) or "")
            for match in _GRES_ITEM.finditer(value)
        )
    except ValueError as error:
        raise ValueError(
            f"GRES={value!r} in scontrol output has a malformed GPU count or index list; "
            f"expected a form such as 'gpu:a100:2(IDX:0-1)'"
        ) from error


def _scontrol_item_gpus(name: str, details: str) -> int:
    """GPUs in one item such as ``gpu:a100:2`` with details ``IDX:0-1``; 0 if not a GPU."""
    count = _gres_item_gpus(name)
    if count is None:
        return 0
    has_count = name.rsplit(":", 1)[-1].isdigit()
    if not has_count and details.startswith("IDX:"):
        # The older GRES_IDX=gpu(IDX:0,2-3) form gives indices but no count.
        count = _count_indices(details.removeprefix("IDX:"))
    if count < 0:
        raise ValueError(f"malformed GPU item {name!r}")
    return count


def _count_indices(value: str) -> int:
    """Count a list of indices such as ``0,2-3,5``; ``N/A`` and empty count 0."""
    value = value.strip()
    if value in {"", "N/A"}:
        return 0
    count = 0
    for item in value.split(","):
        first, _, last = item.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"malformed index list {value!r}")
        count += int(last) - int(first) + 1 if last else 1
    return count


def _count_cuda_visible_devices(value: str) -> int:
    count = 0
    for entry in (item.strip() for item in value.split(",")):
        # CUDA stops enumerating at the first invalid entry: "-1" hides every GPU, and
        # SLURM writes "NoDevFiles" when GPUs are configured without device files.
        if not entry or entry in _NO_CUDA_DEVICES or entry.startswith("-"):
            break
        count += 1
    return count
