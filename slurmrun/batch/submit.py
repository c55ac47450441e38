"""Submitting a launch from a login node as a SLURM batch job, through submitit."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from slurmrun.batch.call import JobCall, MapJob
from slurmrun.batch.folder import base_folder, check_folder
from slurmrun.batch.handle import MAP_KIND, SubmittedLaunch
from slurmrun.batch.job_resources import JobOptions, JobResources, job_resources
from slurmrun.batch.requeue import Requeue
from slurmrun.batch.sbatch import batch_script
from slurmrun.batch.seal import new_nonce
from slurmrun.launcher import Launcher
from slurmrun.launcher.checks import check_call
from slurmrun.launcher.mapping import check_map
from slurmrun.launcher.plan import check_for_hosts
from slurmrun.pickling import dumps_inband
from slurmrun.private import private_umask, umask
from slurmrun.slurm.cluster import check_slurm

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = ["JobSpec", "SubmitDryRun", "submit"]

T = TypeVar("T")


@dataclass(frozen=True)
class SubmitDryRun:
    """What `submit` (or `submit_array`) would submit (``dry_run=True``); ``str()`` is the script.

    Attributes:
        script: the batch script.
        parameters: the submitit ``SlurmExecutor`` parameters it was made from.
        folder: the folder the job would be submitted into.
    """

    script: str
    parameters: dict[str, Any]
    folder: Path

    def __str__(self) -> str:
        return self.script


@overload
def submit(
    func: Callable[..., T],
    func_args: Sequence[Any] = ...,
    func_kwargs: dict[str, Any] | None = ...,
    *,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    dry_run: Literal[False] = ...,
    **job: Unpack[JobOptions],
) -> SubmittedLaunch[T]: ...


@overload
def submit(
    func: Callable[..., T],
    func_args: Sequence[Any] = ...,
    func_kwargs: dict[str, Any] | None = ...,
    *,
    launcher: Launcher | None = ...,
    folder: str | os.PathLike[str] = ...,
    dry_run: Literal[True],
    **job: Unpack[JobOptions],
) -> SubmitDryRun: ...


def submit(
    func: Callable[..., T],
    func_args: Sequence[Any] = (),
    func_kwargs: dict[str, Any] | None = None,
    *,
    launcher: Launcher | None = None,
    folder: str | os.PathLike[str] = "slurmrun_jobs",
    dry_run: bool = False,
    **job: Unpack[JobOptions],
) -> SubmittedLaunch[T] | SubmitDryRun:
    """Submits a batch job that runs `launcher.run(func, ...)` on its nodes; returns at once.

    The job asks for `nodes` nodes with `workers_per_node` tasks of `cpus_per_worker` CPUs
    each (and `gpus_per_node` GPUs); its batch script runs the launch, which starts one
    agent per node with srun and one worker per task (per GPU in a GPU job), so the workers
    use the whole allocation on any number of nodes. The function may live in a module of
    the submitter's ``sys.path`` (a project folder): the job restores that ``sys.path`` and
    the working directory before it loads the function.

    Args:
        func: the function to run on every worker.
        func_args: its positional arguments.
        func_kwargs: its keyword arguments.
        launcher: the launch options (default: ``Launcher()``).
        folder: the folder to submit into; the job's files go to ``folder/<job id>/``
            (a trailing ``/%j`` is accepted). It must be on a filesystem the nodes share.
        dry_run: return the batch script that would be submitted; submit nothing.
        **job: what the job asks SLURM for, as keywords: the fields of
            `slurmrun.batch.JobResources` (which says what each means): ``nodes``,
            ``gpus_per_node``, ``workers_per_node``, ``cpus_per_worker``, ``time_min``,
            ``slurm_parameters``, ``requeue`` and ``resources`` (a named preset).

    Returns:
        The job's handle (`SubmittedLaunch`), or with `dry_run` a `SubmitDryRun`.

    Raises:
        TypeError, ValueError: bad options or an unpicklable call, before submitting (a
            misspelt keyword names its closest, a launch option says it belongs to
            ``launcher=slurmrun.Launcher(...)``): every
            check that the launch makes in the job (`Launcher.dry_run`'s) that needs no
            allocation, such as ``min_hosts`` without ``max_restarts`` (an `OptionsError`).
        slurmrun.batch.JobFolderError: `folder` is not yours alone: another user owns it, or
            others may write to it or replace it (a `PermissionError`; the message says what
            to do), before submitting.
        OSError: `folder` cannot be created.
        RuntimeError: SLURM cannot take the job from here (a
            `slurmrun.slurm.cluster.SlurmUnavailableError`): sbatch or srun is not on PATH,
            or no controller answers ``scontrol ping``. The message says what to do.
    """
    spec = JobSpec.make(
        launcher, func, func_args, func_kwargs, folder=folder, job=job_resources("submit", job)
    )
    check_slurm(ping=not dry_run)  # a dry run needs no controller (submitit needs srun)
    executor = spec.executor()
    if dry_run:
        return spec.dry_run(executor)
    with spec.submitting():
        submitted = executor.submit(spec.call())
    handle: SubmittedLaunch[T] = SubmittedLaunch(str(submitted.job_id), spec.base)
    handle.files.write_meta(spec.meta(handle.job_id))
    return handle


@dataclass(frozen=True)
class JobSpec:
    """A checked submission: the sbatch parameters and what the job will run."""

    launcher: Launcher
    func: Callable[..., Any]
    func_args: tuple[Any, ...]
    func_kwargs: dict[str, Any]
    workers_per_node: int | None
    base: Path
    params: dict[str, Any]
    requeue: Requeue | None
    umask: int = field(default_factory=umask)  # the submitter's: the job's workers run with it
    map_job: MapJob | None = None  # the job maps ``func_args[0]``, the items

    @classmethod
    def make(
        cls,
        launcher: Launcher | None,
        func: Callable[..., Any],
        func_args: Sequence[Any],
        func_kwargs: dict[str, Any] | None,
        *,
        folder: str | os.PathLike[str],
        job: JobResources,
        map_job: MapJob | None = None,
    ) -> JobSpec:
        """Checks the options (raises before anything is submitted) and makes the spec."""
        launcher = Launcher() if launcher is None else launcher
        kwargs = {} if func_kwargs is None else func_kwargs
        if map_job is None:
            check_call(launcher, func, tuple(func_args), kwargs)
        else:
            m = map_job
            check_map(launcher, func, func_args[0], m.workers_per_item, m.retries, m.item_timeout)
        check_folder(base_folder(folder))
        job = job.resolved()
        workers_per_node = job.workers_per_node
        asked = launcher.workers_per_host
        if workers_per_node is not None and asked != "auto":
            raise ValueError(
                "pass workers_per_node or launcher.workers_per_host, not both "
                f"(got {workers_per_node} and {asked!r})"
            )
        if isinstance(asked, list | tuple):
            raise ValueError(  # noqa: TRY004 - a list is right for launch(), not here
                f"launcher.workers_per_host={asked!r}: every node of a submitted job runs the "
                "same number of workers; pass workers_per_node"
            )
        if isinstance(asked, int):  # the job's tasks: sbatch must be asked for them
            workers_per_node = asked
        policy = job.requeue_policy
        tasks = workers_per_node or job.gpus_per_node or 1
        if map_job is not None and map_job.workers_per_item > tasks:
            raise ValueError(
                f"workers_per_item={map_job.workers_per_item}, but the job runs {tasks} "
                f"worker{'s' * (tasks != 1)} a node, and a slot's workers are on one node: ask for "
                f"workers_per_node={map_job.workers_per_item} (or gpus_per_node) or more"
            )
        params: dict[str, Any] = {
            "nodes": job.nodes,
            "ntasks_per_node": tasks,
            "cpus_per_task": job.cpus_per_worker,
            "time": job.time_min,
            # The launch runs in the batch step: one process, which starts the agents' step.
            "use_srun": False,
            "job_name": "slurmrun",
        }
        if job.gpus_per_node:
            params["gpus_per_node"] = job.gpus_per_node
        if policy is not None:
            params["signal_delay_s"] = policy.signal_seconds
            params["additional_parameters"] = {"requeue": True, "signal": policy.sbatch_signal()}
        else:
            params["additional_parameters"] = {"no_requeue": True}
        if launcher.min_hosts is not None or launcher.hosts is not None:
            # A node that fails must not end the job: the launch restarts without it.
            params["additional_parameters"]["no_kill"] = True
        extra = dict(job.slurm_parameters or {})
        params["additional_parameters"].update(extra.pop("additional_parameters", None) or {})
        params.update(extra)
        # What the launch would refuse on the job's nodes is refused here, before submitting.
        nodes = params["nodes"] if isinstance(params["nodes"], int) else job.nodes or 1
        hostnames = launcher.hostnames
        check_for_hosts(launcher, len(hostnames) if isinstance(hostnames, list | tuple) else nodes)
        return cls(
            launcher=launcher,
            func=func,
            func_args=tuple(func_args),
            func_kwargs=kwargs,
            workers_per_node=workers_per_node,
            base=base_folder(folder),
            params=params,
            requeue=policy,
            map_job=map_job,
        )

    def dry_run(self, executor: Any, map_count: int | None = None) -> SubmitDryRun:
        """The batch script that `executor` would submit (`map_count`: an array's elements)."""
        more = {} if map_count is None else {"map_count": map_count}
        script = batch_script({**executor.parameters, **more}, executor.folder, executor.python)
        return SubmitDryRun(script, {**self.params, **more}, self.base)

    def executor(self, **more: Any) -> Any:
        """The submitit executor that submits it (``more``: more parameters)."""
        # Only submitting needs submitit (import slurmrun stays light).
        from slurmrun.batch.sealed_job import SealedExecutor  # noqa: PLC0415

        executor = SealedExecutor(os.fspath(self.base / "%j"), new_nonce())
        executor.update_parameters(**self.params, **more)
        return executor

    @contextlib.contextmanager
    def submitting(self) -> Iterator[None]:
        """Creates the folder to submit into; if submitting fails, removes what it left there.

        submitit writes the pickled calls and a batch script into the folder before it runs
        sbatch; when sbatch refuses the job they would stay (and a folder made for nothing).
        When sbatch takes it, submitit moves the script into the job's folder and leaves a
        symlink to it behind (one per job, ``.submission_file_<uuid>.sh``): removed too.
        Everything created meanwhile is private (umask 077): the folders, the pickled calls,
        the batch script, and through sbatch (``SLURM_UMASK``) the job's output files.

        Raises:
            OSError: the folder cannot be created.
            JobFolderError: it is not this user's alone (made meanwhile by another user).
        """
        with private_umask():
            yield from self._submitting()

    def _submitting(self) -> Iterator[None]:
        existed = self.base.is_dir()
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot create the job folder {self.base}: {e.strerror}") from e
        check_folder(self.base)
        before = set(os.listdir(self.base))
        try:
            yield
        except BaseException:
            for name in set(os.listdir(self.base)) - before:
                if name.endswith(".pkl") or name.startswith(".submission_file_"):
                    with contextlib.suppress(OSError):
                        (self.base / name).unlink()
            if not existed:
                with contextlib.suppress(OSError):
                    self.base.rmdir()  # only if empty
            raise
        with contextlib.suppress(OSError):
            for name in set(os.listdir(self.base)) - before:
                if name.startswith(".submission_file_") and (self.base / name).is_symlink():
                    (self.base / name).unlink()

    def call(self, func_args: Sequence[Any] | None = None) -> JobCall:
        """What the job runs (`func_args`: other positional arguments, for an array element)."""
        args = self.func_args if func_args is None else tuple(func_args)
        sys_path = [p or os.getcwd() for p in sys.path]
        payload = (
            self.launcher,
            self.func,
            args,
            self.func_kwargs,
            self.workers_per_node,
            self.map_job,
        )
        return JobCall(
            payload=dumps_inband(payload),
            sys_path=sys_path,
            cwd=os.getcwd(),
            folder=str(self.base),
            existing=[p for p in sys_path if os.path.exists(p)],
            requeue=self.requeue,
            umask=self.umask,
        )

    def meta(self, job_id: str) -> dict[str, Any]:
        """What ``slurmrun.json`` records."""
        func = self.func
        kind = {} if self.map_job is None else {"kind": MAP_KIND, "items": len(self.func_args[0])}
        return {
            **kind,
            "job_id": job_id,
            "function": f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)}",
            "nodes": self.params["nodes"],
            "workers_per_node": self.params["ntasks_per_node"],
            "submitted": time.time(),
            "cwd": os.getcwd(),
        }
