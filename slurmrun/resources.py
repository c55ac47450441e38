"""Named resources for `slurmrun.submit`: presets that a team ships as a package.

A preset is a `Resources` object registered under a name in the entry-point group
``slurmrun.resources`` of any installed package::

    [project.entry-points."slurmrun.resources"]
    gpu_x8 = "my_cluster.presets:GPU_X8"

``slurmrun.submit(f, resources="gpu_x8")`` then asks for its nodes, GPUs, CPUs, memory and
partition. Arguments of `submit` that are given win over the preset's, and
``slurm_parameters`` win over its memory and partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

__all__ = ["GROUP", "Resources", "apply", "named_resources"]

GROUP = "slurmrun.resources"


@dataclass(frozen=True)
class Resources:
    """What a job asks for.

    Attributes:
        nodes: number of nodes.
        gpus_per_node: GPUs on each node (None: none).
        cpus_per_worker: CPUs for each worker (task).
        mem: memory per node, as sbatch's ``--mem`` takes it (``"500G"``); None: the default.
        partition: the partition; None: the cluster's default.
    """

    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_worker: int = 1
    mem: str | None = None
    partition: str | None = None


def named_resources() -> dict[str, Resources]:
    """Every preset of the installed packages' ``slurmrun.resources`` entry points, by name.

    Raises:
        TypeError: an entry point does not name a `Resources` object.
    """
    found: dict[str, Resources] = {}
    for point in entry_points(group=GROUP):
        preset = point.load()
        if not isinstance(preset, Resources):
            raise TypeError(
                f"the {GROUP} entry point {point.name!r} ({point.value}) names a "
                f"{type(preset).__name__}, not a slurmrun.resources.Resources"
            )
        found[point.name] = preset
    return found


def apply(
    name: str | None,
    nodes: int | None,
    gpus_per_node: int | None,
    cpus_per_worker: int | None,
    slurm_parameters: dict[str, Any] | None,
) -> tuple[int, int | None, int, dict[str, Any] | None]:
    """`submit`'s arguments with preset `name` filled in where they were not given (None).

    Without a preset, nodes and CPUs not given are 1.

    Raises:
        ValueError: no installed package provides `name`.
    """
    if name is None:
        nodes = 1 if nodes is None else nodes  # 0 stays 0: the caller's check refuses it
        cpus_per_worker = 1 if cpus_per_worker is None else cpus_per_worker
        return nodes, gpus_per_node, cpus_per_worker, slurm_parameters
    presets = named_resources()
    if name not in presets:
        raise ValueError(
            f"resources={name!r} is not a named resource of any installed package "
            f"(known: {sorted(presets) or 'none'}); packages register them in the "
            f"{GROUP!r} entry-point group"
        )
    preset = presets[name]
    params = {
        **({"mem": preset.mem} if preset.mem else {}),
        **({"partition": preset.partition} if preset.partition else {}),
        **(slurm_parameters or {}),
    }
    return (
        preset.nodes if nodes is None else nodes,
        preset.gpus_per_node if gpus_per_node is None else gpus_per_node,
        preset.cpus_per_worker if cpus_per_worker is None else cpus_per_worker,
        params,
    )
