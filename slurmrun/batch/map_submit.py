"""`submit_map`: a `Launcher.map` as a SLURM batch job, submitted from a login node."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from slurmrun.batch.call import MapJob
from slurmrun.batch.handle import SubmittedMap
from slurmrun.batch.job_resources import JobOptions, job_resources
from slurmrun.batch.submit import JobSpec, SubmitDryRun
from slurmrun.launcher import Launcher
from slurmrun.slurm.cluster import check_slurm

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = ["submit_map"]

T = TypeVar("T")


@overload
def submit_map(
    func: Callable[[Any], T],
    items: Iterable[Any],
    *,
    workers_per_item: int = ...,
    retries: int = ...,
    item_timeout: float | None = ...,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    dry_run: Literal[False] = ...,
    **job: Unpack[JobOptions],
) -> SubmittedMap[T]: ...


@overload
def submit_map(
    func: Callable[[Any], T],
    items: Iterable[Any],
    *,
    workers_per_item: int = ...,
    retries: int = ...,
    item_timeout: float | None = ...,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    dry_run: Literal[True],
    **job: Unpack[JobOptions],
) -> SubmitDryRun: ...


def submit_map(
    func: Callable[[Any], T],
    items: Iterable[Any],
    *,
    workers_per_item: int = 1,
    retries: int = 0,
    item_timeout: float | None = None,
    launcher: Launcher | None = None,
    folder: str | os.PathLike[str] = "slurmrun_jobs",
    dry_run: bool = False,
    **job: Unpack[JobOptions],
) -> SubmittedMap[T] | SubmitDryRun:
    """Submits a batch job that runs `launcher.map(func, items, ...)`; returns at once.

    The job asks for its nodes, GPUs and workers as `submit`'s does, and its batch step maps
    the items over every slot of them (docs/sweeps.md): one job for a whole sweep, in place
    of a job array's element per item. ``handle.result()`` returns the values in the items'
    order, or raises `slurmrun.MapFailedError` with every item's outcome.

    Args:
        func: the function; its one argument is an item.
        items: the items (pickled with the call before submitting).
        workers_per_item: `Launcher.map`'s: the workers of a slot, on one node.
        retries: `Launcher.map`'s: how many times a failed item is tried again.
        item_timeout: `Launcher.map`'s: seconds an item may run (None: no limit).
        launcher: the launch options (default: ``Launcher()``).
        folder: the folder to submit into, as for `submit`.
        dry_run: return the batch script that would be submitted; submit nothing.
        **job: what the job asks SLURM for, as keywords: `submit`'s (the fields of
            `slurmrun.batch.JobResources`).

    Returns:
        The job's handle (`SubmittedMap`), or with `dry_run` a `SubmitDryRun`.

    Raises:
        TypeError, ValueError: bad options (`submit`'s and `Launcher.map`'s; a
            `workers_per_item` above the job's workers a node) or an unpicklable call,
            before submitting.
        slurmrun.batch.JobFolderError, OSError, RuntimeError: as `submit` raises them.
    """
    mapped = MapJob(workers_per_item, retries, item_timeout)
    spec = JobSpec.make(
        launcher,
        func,
        (list(items),),
        None,
        folder=folder,
        job=job_resources("submit_map", job),
        map_job=mapped,
    )
    check_slurm(ping=not dry_run)
    executor = spec.executor()
    if dry_run:
        return spec.dry_run(executor)
    with spec.submitting():
        submitted = executor.submit(spec.call())
    handle: SubmittedMap[T] = SubmittedMap(str(submitted.job_id), spec.base)
    handle.files.write_meta(spec.meta(handle.job_id))
    return handle
