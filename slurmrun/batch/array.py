"""`submit_array`: one SLURM job array whose every element is a multi-node launch (a sweep)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

from slurmrun import resources as named_resources
from slurmrun.batch.handle import SubmittedLaunch
from slurmrun.batch.requeue import Requeue
from slurmrun.batch.submit import JobSpec, SubmitDryRun
from slurmrun.launcher import Launcher
from slurmrun.slurm.cluster import check_slurm

__all__ = ["submit_array"]

T = TypeVar("T")


@overload
def submit_array(
    func: Callable[..., T],
    args_list: Sequence[Sequence[Any]],
    func_kwargs: dict[str, Any] | None = ...,
    *,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    nodes: int | None = ...,
    gpus_per_node: int | None = ...,
    workers_per_node: int | None = ...,
    cpus_per_worker: int | None = ...,
    time_min: int = ...,
    max_parallel: int | None = ...,
    slurm_parameters: dict[str, Any] | None = ...,
    requeue: bool | Requeue = ...,
    resources: str | None = ...,
    dry_run: Literal[False] = ...,
) -> list[SubmittedLaunch[T]]: ...


@overload
def submit_array(
    func: Callable[..., T],
    args_list: Sequence[Sequence[Any]],
    func_kwargs: dict[str, Any] | None = ...,
    *,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    nodes: int | None = ...,
    gpus_per_node: int | None = ...,
    workers_per_node: int | None = ...,
    cpus_per_worker: int | None = ...,
    time_min: int = ...,
    max_parallel: int | None = ...,
    slurm_parameters: dict[str, Any] | None = ...,
    requeue: bool | Requeue = ...,
    resources: str | None = ...,
    dry_run: Literal[True],
) -> SubmitDryRun: ...


def submit_array(
    func: Callable[..., T],
    args_list: Sequence[Sequence[Any]],
    func_kwargs: dict[str, Any] | None = None,
    *,
    launcher: Launcher | None = None,
    folder: str | os.PathLike[str] = "slurmrun_jobs",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    workers_per_node: int | None = None,
    cpus_per_worker: int | None = None,
    time_min: int = 60,
    max_parallel: int | None = None,
    slurm_parameters: dict[str, Any] | None = None,
    requeue: bool | Requeue = True,
    resources: str | None = None,
    dry_run: bool = False,
) -> list[SubmittedLaunch[T]] | SubmitDryRun:
    """Submits one job array: element K is a launch of ``func(*args_list[K], **func_kwargs)``.

    Every element asks for the same resources (`nodes` nodes...) and runs a whole launch on
    them, as `submit` does: a hyperparameter sweep of multi-node runs. The options are
    `submit`'s.

    Args:
        func: the function to run on every worker of every element.
        args_list: one sequence of positional arguments per element.
        func_kwargs: keyword arguments, the same for every element.
        launcher: the launch options (default: ``Launcher()``).
        folder: the folder to submit into; element K's files go to ``folder/<id>_<K>/``.
        nodes: number of nodes of each element (None: the preset's, else 1).
        gpus_per_node: GPUs on each node (None: none).
        workers_per_node: workers on each node (default: `gpus_per_node`, else 1).
        cpus_per_worker: CPUs for each worker (None: the preset's, else 1).
        time_min: each element's time limit in minutes.
        max_parallel: at most this many elements run at once (SLURM's ``--array=...%N``;
            default: all).
        slurm_parameters: more ``submitit.SlurmExecutor`` parameters.
        requeue: as for `submit`; each element is requeued on its own.
        resources: a named preset (`slurmrun.resources`), as for `submit`.
        dry_run: return the batch script that would be submitted (with its ``--array``);
            submit nothing.

    Returns:
        The elements' handles, in the order of `args_list` (job ids ``<array id>_<K>``), or
        with `dry_run` a `SubmitDryRun`.

    Raises:
        TypeError, ValueError: bad options or an unpicklable call, before submitting.
        OSError: `folder` cannot be created.
        RuntimeError: SLURM cannot take the job from here (a
            `slurmrun.slurm.cluster.SlurmUnavailableError`): sbatch or srun is not on PATH,
            or no controller answers ``scontrol ping``. The message says what to do.
    """
    calls = [tuple(args) for args in args_list]
    if not calls:
        raise ValueError("args_list is empty: there is nothing to submit")
    if max_parallel is not None and (
        isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1
    ):
        raise ValueError(f"max_parallel must be a positive int or None, got {max_parallel!r}")
    nodes, gpus_per_node, cpus_per_worker, slurm_parameters = named_resources.apply(
        resources, nodes, gpus_per_node, cpus_per_worker, slurm_parameters
    )
    spec = JobSpec.make(
        launcher,
        func,
        calls[0],
        func_kwargs,
        folder=folder,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        workers_per_node=workers_per_node,
        cpus_per_worker=cpus_per_worker,
        time_min=time_min,
        slurm_parameters=slurm_parameters,
        requeue=requeue,
    )
    job_calls = []
    for k, args in enumerate(calls):  # each pickles (or raises) before anything is submitted
        try:
            job_calls.append(spec.call(args))
        except Exception as e:
            raise TypeError(
                f"args_list[{k}] could not be pickled to send to the job: {type(e).__name__}: "
                f"{e}. Everything it holds must be picklable by cloudpickle (locks, open files, "
                "sockets and generators are not)"
            ) from e
    check_slurm(ping=not dry_run)  # a dry run needs no controller (submitit needs srun)
    executor = spec.executor(array_parallelism=max_parallel or len(calls))
    if dry_run:
        executor.parameters["map_count"] = len(calls)  # what submitit sets for an array
        script = executor._make_submission_file_text(executor._submitit_command_str, "dry-run")
        return SubmitDryRun(script, {**spec.params, "map_count": len(calls)}, spec.base)
    with spec.submitting():
        submitted = executor.submit_array(job_calls)
    handles: list[SubmittedLaunch[T]] = []
    for job in submitted:
        handle: SubmittedLaunch[T] = SubmittedLaunch(str(job.job_id), spec.base)
        handle.files.write_meta(spec.meta(handle.job_id))
        handles.append(handle)
    return handles
