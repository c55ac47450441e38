"""SLURM's notations for lists and GPU requests: host lists, index lists, GRES and TRES items.

Shared by what reads SLURM's variables (`slurmrun.slurm.job`) and what reads
``scontrol`` (`slurmrun.slurm.scontrol`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import hostlist

__all__ = ["expand_hostlist", "requested_gpus", "scontrol_gres_gpus"]

# One GRES item of `scontrol show job -d`: "gpu:a100:2" optionally followed by "(IDX:0-1)".
_GRES_ITEM = re.compile(r"([^,()]+)(?:\(([^)]*)\))?")


def expand_hostlist(value: str, label: str) -> list[str]:
    """Expand a host list; ``label`` says where it came from in error messages."""
    try:
        hosts: list[str] = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as error:
        raise ValueError(
            f"{label} is not a valid SLURM host list ({error}); "
            f"expected a form such as 'node[1-3,7],login5'"
        ) from error
    return hosts


def requested_gpus(env: Mapping[str, str], num_nodes: int) -> tuple[list[int] | None, str | None]:
    """GPUs per node from SLURM's request variables, most precise first, and the variable read.

    Args:
        env: the job shell's environment.
        num_nodes: how many nodes the job has.

    Returns:
        One count per node and the variable that told, or (None, None) if no variable says.

    Raises:
        ValueError: if the variable that tells is malformed; the message names it.
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


def scontrol_gres_gpus(value: str) -> int:
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
