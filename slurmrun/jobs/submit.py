"""Submitting a launch from a login node as a SLURM batch job, through submitit."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from slurmrun.launcher import Launcher, check_call, run_from_designated_task
from slurmrun.result import LaunchResult

if TYPE_CHECKING:
    import submitit

__all__ = ["SubmittedLaunch", "submit"]

T = TypeVar("T")


@dataclass(frozen=True)
class SubmittedLaunch(Generic[T]):
    """A launch submitted as a batch job.

    Attributes:
        job: the ``submitit.Job`` (one task per node; the first one ran the launch).
    """

    job: submitit.Job[LaunchResult[T] | None]

    @property
    def job_id(self) -> str:
        """The SLURM job id."""
        return str(self.job.job_id)

    def done(self) -> bool:
        """Whether the job has finished."""
        return bool(self.job.done())

    def cancel(self) -> None:
        """Cancels the job (scancel)."""
        self.job.cancel()

    def result(self, timeout: float | None = None, poll: float = 1.0) -> LaunchResult[T]:
        """Waits for the job and returns the launch's result, or raises what it raised.

        Raises:
            TimeoutError: the job did not finish within `timeout` seconds (it keeps running).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.job.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
            time.sleep(poll)
        first = self.job.results()[0]
        if first is None:  # pragma: no cover - the first task always launches
            raise RuntimeError(f"job {self.job_id}: the first task returned no launch result")
        return first


def _launch_from_first_task(
    launcher: Launcher,
    func: Callable[..., T],
    func_args: tuple[Any, ...],
    func_kwargs: dict[str, Any],
) -> LaunchResult[T] | None:
    # submitit runs one task per node; the first one launches on every node of the job.
    if os.environ.get("SLURM_PROCID", "0") != "0":
        return None
    return run_from_designated_task(launcher, func, func_args, func_kwargs)


def submit(
    func: Callable[..., T],
    func_args: Sequence[Any] = (),
    func_kwargs: dict[str, Any] | None = None,
    *,
    launcher: Launcher | None = None,
    folder: str | os.PathLike[str] = "slurmrun_jobs/%j",
    nodes: int = 1,
    gpus_per_node: int | None = None,
    time_min: int = 60,
    slurm_parameters: dict[str, Any] | None = None,
) -> SubmittedLaunch[T]:
    """Submits a batch job that runs `launcher.run(func, ...)` on its nodes; returns at once.

    ``submit(...).result()`` waits for the job and gives the `LaunchResult` (or raises what
    the launch raised). The job runs one task per node; the first launches on all of them.

    Args:
        func: the function to run on every worker.
        func_args: its positional arguments.
        func_kwargs: its keyword arguments.
        launcher: the launch options (default: ``Launcher()``, every GPU of every node).
        folder: where submitit keeps the job's script, pickles and logs (``%j``: job id).
        nodes: number of nodes to allocate.
        gpus_per_node: GPUs to allocate on each node (None: none).
        time_min: the job's time limit in minutes.
        slurm_parameters: more ``submitit.SlurmExecutor`` parameters (``partition``,
            ``account``, ``cpus_per_task``, ``mem``, ``additional_parameters``...).

    Raises:
        TypeError, ValueError: bad options or an unpicklable call, before submitting.
    """
    import submitit  # noqa: PLC0415 - only submitting needs it (import slurmrun stays light)

    launcher = Launcher() if launcher is None else launcher
    kwargs = {} if func_kwargs is None else func_kwargs
    check_call(launcher, func, tuple(func_args), kwargs)
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive int, got {nodes!r}")
    executor = submitit.SlurmExecutor(folder=os.fspath(folder))
    params: dict[str, Any] = {"nodes": nodes, "ntasks_per_node": 1, "time": time_min}
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    params.update(slurm_parameters or {})
    executor.update_parameters(**params)
    job = executor.submit(_launch_from_first_task, launcher, func, tuple(func_args), kwargs)
    return SubmittedLaunch(job)
