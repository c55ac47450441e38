"""What a submitted job asks SLURM for: `JobResources`, and `JobOptions`, its keyword form.

`slurmrun.submit` and `slurmrun.submit_array` take these as keywords (``nodes=2,
time_min=30``), typed by `JobOptions`, and make one `JobResources` of them at once; the
fields are written here only (a test checks that the two agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from slurmrun import resources as named_resources
from slurmrun.batch.requeue import Requeue
from slurmrun.keywords import check_keywords

__all__ = ["JobOptions", "JobResources", "job_resources"]


class JobOptions(TypedDict, total=False):
    """`JobResources`'s fields as keyword arguments (``**job: Unpack[JobOptions]``)."""

    nodes: int | None
    gpus_per_node: int | None
    workers_per_node: int | None
    cpus_per_worker: int | None
    time_min: int
    slurm_parameters: Mapping[str, Any] | None
    requeue: bool | Requeue
    resources: str | None


@dataclass(frozen=True)
class JobResources:
    """What a submitted job asks SLURM for: nodes, tasks, CPUs, GPUs, time, requeueing.

    Raises:
        ValueError: a count or the time limit is not a positive int (GPUs: an int >= 0).
        TypeError: `slurm_parameters`, `requeue` or `resources` is of another type.
    """

    nodes: int | None = None
    """Number of nodes; None takes the preset's, else 1."""
    gpus_per_node: int | None = None
    """GPUs on each node; None takes the preset's, else none."""
    workers_per_node: int | None = None
    """Workers (SLURM tasks) on each node; None is `gpus_per_node`, else 1."""
    cpus_per_worker: int | None = None
    """CPUs for each worker; None takes the preset's, else 1."""
    time_min: int = 60
    """The job's time limit in minutes."""
    slurm_parameters: Mapping[str, Any] | None = None
    """More ``submitit.SlurmExecutor`` parameters (``partition``, ``account``, ``mem``,
    ``job_name``, ``additional_parameters``...); they win over the preset's."""
    requeue: bool | Requeue = True
    """Requeue the job when SLURM signals it, ``Requeue.signal_seconds`` before its time
    limit or on ``scancel --signal=USR2``. The workers get the signal, and the launch runs
    again in the same job id (``SLURMRUN_REQUEUE_COUNT`` counts the requeues). True is
    ``Requeue()`` (SIGUSR2, 90 s, at most 3 times); False never requeues."""
    resources: str | None = None
    """A named preset of an installed package (`slurmrun.resources`) whose nodes, GPUs,
    CPUs, memory and partition fill the fields not given."""

    def __post_init__(self) -> None:
        for name in ("nodes", "workers_per_node", "cpus_per_worker", "time_min"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        gpus = self.gpus_per_node
        if gpus is not None and (not _is_int(gpus) or gpus < 0):
            raise ValueError(f"gpus_per_node must be an int >= 0 or None, got {gpus!r}")
        if self.slurm_parameters is not None and not isinstance(self.slurm_parameters, Mapping):
            raise TypeError(f"slurm_parameters must be a dict, got {self.slurm_parameters!r}")
        if not isinstance(self.requeue, bool | Requeue):
            raise TypeError(f"requeue must be a bool or a Requeue, got {self.requeue!r}")
        if self.resources is not None and not isinstance(self.resources, str):
            raise TypeError(f"resources must be a preset's name, got {self.resources!r}")

    def resolved(self) -> JobResources:
        """These resources with the preset's (and the defaults) in the fields not given.

        Raises:
            ValueError: no installed package provides the preset.
        """
        nodes, gpus, cpus, params = named_resources.apply(
            self.resources,
            self.nodes,
            self.gpus_per_node,
            self.cpus_per_worker,
            None if self.slurm_parameters is None else dict(self.slurm_parameters),
        )
        return dataclasses.replace(
            self,
            nodes=nodes,
            gpus_per_node=gpus,
            cpus_per_worker=cpus,
            slurm_parameters=params,
            resources=None,
        )

    @property
    def requeue_policy(self) -> Requeue | None:
        """The `Requeue` policy that `requeue` asks for, or None to never requeue."""
        return Requeue() if self.requeue is True else self.requeue or None


def job_resources(call: str, job: Mapping[str, Any]) -> JobResources:
    """The `JobResources` of `call`'s (``"submit"``'s) job keywords, each name checked first.

    Raises:
        OptionsTypeError: a keyword is no field (``did you mean nodes?``), or a launch option
            (``workers_per_host``: it belongs to ``launcher=slurmrun.Launcher(...)``).
    """
    from slurmrun.launcher.options import option_names  # noqa: PLC0415 - the launcher's side

    elsewhere = {name: f"launcher=slurmrun.Launcher({name}=...)" for name in option_names()}
    check_keywords(call, job, [f.name for f in dataclasses.fields(JobResources)], elsewhere)
    return JobResources(**job)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
