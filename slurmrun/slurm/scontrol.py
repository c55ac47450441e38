"""Running ``scontrol`` and reading what it prints: a job's tasks and GPUs, node states.

Every run of scontrol is bounded by a time limit and answers None when scontrol is missing or
fails. What it prints is read by fields (`slurmrun.slurm.fields`), never by words: a job's
command and submit line may hold any word (``NumTasks=3``, ``GRES=gpu:8``).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from slurmrun.slurm.fields import NODE_FREE_TEXT, first_record, parse_records
from slurmrun.slurm.notation import expand_hostlist, scontrol_gres_gpus

__all__ = [
    "SCONTROL_SOURCE",
    "NodeState",
    "job_tasks_per_node",
    "parse_node_states",
    "parse_scontrol_gpus",
    "parse_scontrol_tasks",
    "scontrol",
    "scontrol_gpus",
    "scontrol_node_states",
    "scontrol_show_job",
]

# How `SlurmAllocation.sources` names figures read from scontrol.
SCONTROL_SOURCE = "scontrol show job -d"
# The words of a node's ``State=`` (a base state and its flags, joined by "+": DOWN+NOT_RESPONDING,
# IDLE+DRAIN, MIXED+DRAIN+FAIL; sinfo's DRAINED/DRAINING/FAILING too) that say it cannot run a
# step now: down, drained or draining, failing, not responding, powered off or rebooting.
UNUSABLE_NODE_STATES = frozenset(
    {
        "DOWN",
        "DRAIN",
        "DRAINED",
        "DRAINING",
        "FAIL",
        "FAILING",
        "NOT_RESPONDING",
        "NO_RESPOND",
        "POWERED_DOWN",
        "POWERING_DOWN",
        "REBOOT_ISSUED",
    }
)
# What ends a node's ``Reason=`` line: who set it and when ("[root@2026-01-02T03:04:05]").
_REASON_BY = re.compile(r"\s*\[[^\]]*@[^\]]*\]$")


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


def parse_scontrol_tasks(text: str) -> tuple[int, int, int, int] | None:
    """Read ``(NumNodes, NumTasks, CPUs/Task, ntasks per node)`` from ``scontrol show job``.

    Read from the job's own record (the first), by fields: never from its command or
    submit line.

    Args:
        text: the output of ``scontrol show job [-d] <job id>``.

    Returns:
        The four numbers (ntasks per node 0 when not requested), or None if the text lacks
        one of them (e.g. the job is pending and has no nodes yet).
    """
    fields = first_record(text).fields
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


def parse_scontrol_gpus(text: str) -> dict[str, int]:
    """Read how many GPUs each node of a job has from ``scontrol show job -d`` output.

    Understands the per-node lines ``Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)``,
    typed GPUs (``gpu:a100:2(IDX:0-1)``, several types summed) and the older
    ``GRES_IDX=gpu(IDX:0,2-3)`` form (counted from the indices), in every record of the text
    (a heterogeneous job's components), only where SLURM prints them. Nodes listed without
    GPUs count 0.

    Args:
        text: the output of ``scontrol show job -d <job_id>``.

    Returns:
        GPUs per hostname, node lists expanded; empty if the text lists no nodes (e.g. the job
        is pending).

    Raises:
        ValueError: if a node list or a GPU count in the text is malformed.
    """
    gpus: dict[str, int] = {}
    for record in parse_records(text):
        for line in record.node_lines:
            value = line.get("Nodes", "")
            hosts = expand_hostlist(value, f"Nodes={value!r} in scontrol output")
            count = sum(
                scontrol_gres_gpus(line[key]) for key in ("GRES", "GRES_IDX") if key in line
            )
            for host in hosts:
                gpus[host] = gpus.get(host, 0) + count
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


@dataclass(frozen=True)
class NodeState:
    """A node's state as ``scontrol show node`` says it.

    Attributes:
        name: the node's name (``NodeName``).
        words: its base state and flags (``("DOWN", "NOT_RESPONDING")`` from
            ``State=DOWN+NOT_RESPONDING``), upper case.
        reason: why an administrator, a health check or SLURM set it so (``Reason``), or "".
    """

    name: str
    words: tuple[str, ...]
    reason: str = ""

    @property
    def usable(self) -> bool:
        """Whether a step may run on it: none of `UNUSABLE_NODE_STATES` is among its words."""
        return UNUSABLE_NODE_STATES.isdisjoint(self.words)

    def __str__(self) -> str:
        state = "+".join(self.words) or "of an unknown state"
        return f"{state} (reason: {self.reason})" if self.reason else state


def parse_node_states(text: str) -> dict[str, NodeState]:
    """Read each node's state from ``scontrol show node`` output (records of lines, not ``-o``).

    A state's words are those of ``State=`` split at "+", upper case, without the marks
    sinfo's short form appends (``down*``); the reason is its ``Reason=`` free text, without
    who set it and when, its lines joined by "; ".

    Args:
        text: the output of ``scontrol show node [NODES]``.

    Returns:
        The nodes' states by name; empty if the text names no node.
    """
    states: dict[str, NodeState] = {}
    for record in parse_records(text, NODE_FREE_TEXT):
        fields = record.fields
        name = fields.get("NodeName", "")
        if not name:
            continue
        words = tuple(
            word.upper().rstrip("*~#!%$@^-")
            for word in fields.get("State", "").split("+")
            if word.strip()
        )
        first, *more = fields.get("Reason", "").split("\n")
        reason = "; ".join([_REASON_BY.sub("", first).strip(), *more]).strip("; ")
        states[name] = NodeState(name, words, reason)
    return states


def scontrol_node_states(nodes: Sequence[str], timeout: float = 10) -> dict[str, NodeState] | None:
    """Ask ``scontrol show node`` the states of `nodes`, now.

    Args:
        nodes: the nodes' names.
        timeout: seconds to wait for scontrol before giving up.

    Returns:
        The states by node name (the nodes scontrol told of), or None if scontrol is missing,
        fails, times out, or names none of them.
    """
    if not nodes:
        return {}
    text = scontrol(["show", "node", ",".join(nodes)], timeout)
    if text is None:
        return None
    states = parse_node_states(text)
    return {node: states[node] for node in nodes if node in states} or None
