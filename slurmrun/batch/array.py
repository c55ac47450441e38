"""`submit_array`: one SLURM job array whose every element is a multi-node launch (a sweep)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from slurmrun.batch.handle import SubmittedLaunch
from slurmrun.batch.job_resources import JobOptions, job_resources
from slurmrun.batch.submit import JobSpec, SubmitDryRun
from slurmrun.launcher import Launcher
from slurmrun.slurm.cluster import check_slurm

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

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
    max_parallel: int | None = ...,
    dry_run: Literal[False] = ...,
    **job: Unpack[JobOptions],
) -> list[SubmittedLaunch[T]]: ...


@overload
def submit_array(
    func: Callable[..., T],
    args_list: Sequence[Sequence[Any]],
    func_kwargs: dict[str, Any] | None = ...,
    *,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    max_parallel: int | None = ...,
    dry_run: Literal[True],
    **job: Unpack[JobOptions],
) -> SubmitDryRun: ...


def submit_array(
    func: Callable[..., T],
    args_list: Sequence[Sequence[Any]],
    func_kwargs: dict[str, Any] | None = None,
    *,
    launcher: Launcher | None = None,
    folder: str | os.PathLike[str] = "slurmrun_jobs",
    max_parallel: int | None = None,
    dry_run: bool = False,
    **job: Unpack[JobOptions],
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
        max_parallel: at most this many elements run at once (SLURM's ``--array=...%N``;
            default: all).
        dry_run: return the batch script that would be submitted (with its ``--array``);
            submit nothing.
        **job: what each element asks SLURM for, as keywords, as for `submit`: the fields of
            `slurmrun.batch.JobResources`; with ``requeue``, each element is requeued on its
            own.

    Returns:
        The elements' handles, in the order of `args_list` (job ids ``<array id>_<K>``), or
        with `dry_run` a `SubmitDryRun`.

    Raises:
        TypeError, ValueError: bad options or an unpicklable call, before submitting.
        slurmrun.batch.JobFolderError: `folder` is not yours alone (see `slurmrun.submit`).
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
    spec = JobSpec.make(
        launcher, func, calls[0], func_kwargs, folder=folder, job=job_resources("submit_array", job)
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
        return spec.dry_run(executor, map_count=len(calls))  # submitit's count for an array
    with spec.submitting():
        submitted = executor.submit_array(job_calls)
    handles: list[SubmittedLaunch[T]] = []
    for element in submitted:
        handle: SubmittedLaunch[T] = SubmittedLaunch(str(element.job_id), spec.base)
        handle.files.write_meta(spec.meta(handle.job_id))
        handles.append(handle)
    return handles
