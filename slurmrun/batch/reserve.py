"""`slurmrun.reserve`: a job that keeps one agent per node for launchers outside it.

The job's batch step runs the keeper (`slurmrun.batch.keeper`); launchers attach with
``Launcher(job=JOB_ID)`` (`slurmrun.launcher.agents.reserved`). The job ends at `release`,
at the end of the handle's ``with`` block, at its time limit, and by itself once no launcher
was attached for `idle_timeout` seconds.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmrun.batch.folder import base_folder, check_folder
from slurmrun.batch.job_resources import job_resources
from slurmrun.launcher.agents.starters import package_pythonpath
from slurmrun.launcher.closing import interrupts_held
from slurmrun.private import private_umask
from slurmrun.reservations import ReservationRecord
from slurmrun.slurm.cluster import check_slurm
from slurmrun.slurm.pending import job_wait
from slurmrun.slurm.queue import FINAL_STATES, query_states

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self, Unpack  # typing's from Python 3.11

    from slurmrun.batch.job_resources import JobOptions

__all__ = ["Reservation", "ReservationInfo", "release", "reservations", "reserve"]

POLL = 0.5  # seconds between two looks at SLURM while waiting
GONE = "GONE"  # a job SLURM no longer knows


def reserve(
    *,
    idle_timeout: float = 600.0,
    heartbeat_timeout: float = 15.0,
    folder: str | os.PathLike[str] = "slurmrun_jobs",
    **job: Unpack[JobOptions],
) -> Reservation:
    """Submits a job that starts one agent per node and keeps them for launchers outside it.

    Returns at once. Run on its agents with ``slurmrun.Launcher(job=r.job_id)`` (or
    ``launch(..., job=...)``) from any process of yours, one launcher at a time.

    Args:
        idle_timeout: seconds with no launcher attached after which the job ends itself.
        heartbeat_timeout: seconds of silence after which a launcher counts as gone (its run
            ends on every node) and an agent as lost (the reservation goes on with the
            others: `Launcher.min_hosts`; it ends with its last).
        folder: where the job's log (``<folder>/<job id>.log``) and the agents' logs
            (``<folder>/<job id>/logs``) go; on a filesystem the nodes share.
        **job: what the job asks SLURM for, as `slurmrun.submit` takes it: ``nodes``,
            ``gpus_per_node``, ``workers_per_node``, ``cpus_per_worker``, ``time_min``,
            ``slurm_parameters``, ``resources`` (not ``requeue``: preempted, a reservation
            is requeued by SLURM, under its job id).

    Returns:
        The reservation's handle.

    Raises:
        ValueError, TypeError: bad resources or timeouts, before anything is submitted.
        slurmrun.batch.JobFolderError: `folder` is not yours alone.
        RuntimeError: SLURM cannot take the job from here, or sbatch refused it.
    """
    for name, value in (("idle_timeout", idle_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if "requeue" in job:
        raise ValueError(
            "a reservation takes no requeue options: SLURM requeues it when it is preempted "
            "(it comes back under its job id); leave requeue out"
        )
    resources = job_resources("reserve", job).resolved()
    base = base_folder(folder).resolve()
    check_folder(base)
    check_slurm(ping=True)
    tasks = resources.workers_per_node or resources.gpus_per_node or 1
    argv = [
        "sbatch",
        "--parsable",
        f"--nodes={resources.nodes or 1}",
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={resources.cpus_per_worker or 1}",
        f"--time={resources.time_min}",
        f"--output={base}/%j.log",
        "--requeue",  # preempted, it comes back under its id (the next run waits for it)
        "--no-kill",  # a node that fails leaves the others (`Launcher.min_hosts`)
    ]
    if resources.gpus_per_node:
        argv.append(f"--gpus-per-node={resources.gpus_per_node}")
    params = dict(resources.slurm_parameters or {})
    params.setdefault("job_name", "slurmrun-reserve")
    extra = params.pop("additional_parameters", None) or {}
    for key, value in {**params, **extra}.items():
        flag = "--" + key.replace("_", "-")
        argv.append(flag if value is True else f"{flag}={value}")
    keeper = [
        sys.executable, "-m", "slurmrun.batch.keeper", "--folder", str(base),
        "--idle-timeout", str(float(idle_timeout)),
        "--heartbeat-timeout", str(float(heartbeat_timeout)),
    ]  # fmt: skip
    script = (
        "#!/bin/bash\n"
        f"export PYTHONPATH={shlex.quote(package_pythonpath(os.environ))}\n"
        f"exec {shlex.join(keeper)}\n"
    )
    job_id = ""
    try:
        # A Ctrl-C in the middle would lose a job that was submitted: it is raised after.
        with private_umask(), interrupts_held():
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_folder(base)
            done = subprocess.run(
                argv, input=script, capture_output=True, text=True, timeout=60, check=False,
                start_new_session=True,
            )  # fmt: skip
            if done.returncode == 0:
                job_id = done.stdout.strip().split(";")[0]
    except BaseException:
        if job_id:  # interrupted once sbatch answered: the job is cancelled, not left idle
            _scancel(job_id)
        raise
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused the reservation: {done.stderr.strip()}")
    return Reservation(job_id, base)


def _scancel(job_id: str) -> subprocess.CompletedProcess[str]:
    """``scancel job_id``, whole even when a Ctrl-C comes meanwhile (it is raised after)."""
    with interrupts_held():
        return subprocess.run(
            ["scancel", job_id], capture_output=True, text=True, timeout=30, check=False,
            start_new_session=True,
        )  # fmt: skip


class Reservation:
    """A reservation's handle: its job, its state, its end (`release`; a ``with`` block).

    Args:
        job_id: the SLURM job id.
        folder: its folder (the job's log).
    """

    def __init__(self, job_id: str, folder: str | os.PathLike[str] = "slurmrun_jobs") -> None:
        self.job_id = str(job_id)
        self.folder = Path(folder)

    def __repr__(self) -> str:
        return f"Reservation({self.job_id!r}, {str(self.folder)!r})"

    @property
    def state(self) -> str:
        """SLURM's state of the job now (``PENDING``, ``RUNNING``...; ``GONE``: forgotten)."""
        return query_states([self.job_id]).get(self.job_id, GONE)

    @property
    def log(self) -> Path:
        """The job's log: the keeper's lines (when it ends, and why)."""
        return self.folder / f"{self.job_id}.log"

    def wait(self, timeout: float) -> None:
        """Waits until the job runs and its agents can be attached to.

        Raises:
            TimeoutError: not within `timeout` seconds (the job stays; `release` ends it).
            RuntimeError: the job ended before its agents were ready (its log says why).
        """
        deadline = time.monotonic() + timeout
        while True:
            if ReservationRecord.read(self.job_id) is not None:
                return
            state = self.state
            if state in FINAL_STATES or state == GONE:
                raise RuntimeError(
                    f"reservation {self.job_id} ended ({state}) before its agents were ready; "
                    f"see {self.log}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reservation {self.job_id} is not ready after {timeout:g} s (state {state})"
                )
            time.sleep(POLL)

    def release(self, timeout: float = 60.0) -> str:
        """Ends the job; returns its final state once SLURM says it is gone (see `release`)."""
        return release(self.job_id, timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass(frozen=True)
class ReservationInfo:
    """A reservation of this user's, as `slurmrun jobs` lists it.

    Attributes:
        job_id: its job id.
        state: SLURM's state (``GONE``: SLURM no longer knows it).
        hostnames: its nodes, but those whose agent was lost (`ReservationRecord.lost`).
        time_left: SLURM's time left (``9:58``), or ``""``.
        attached: the launcher attached (``pid 123 on login1``), or ``""``.
        idle_for: seconds with no launcher attached (0 while one is).
    """

    job_id: str
    state: str
    hostnames: list[str]
    time_left: str
    attached: str
    idle_for: float


def reservations() -> list[ReservationInfo]:
    """This user's reservations whose keepers are (or were last seen) running, by job id."""
    found = []
    for record in ReservationRecord.all():
        job = job_wait(record.job_id)
        idle = time.time() - record.idle_since if record.idle_since and not record.attached else 0
        found.append(
            ReservationInfo(
                record.job_id,
                job.state if job is not None else GONE,
                [host for host in record.hostnames if host not in record.lost],
                job.left if job is not None else "",
                record.attached,
                max(0.0, idle),
            )
        )
    return found


def release(job_id: str, *, timeout: float = 60.0) -> str:
    """Cancels reservation `job_id` and waits until SLURM says it has ended.

    Returns:
        Its final state (``CANCELLED``, or how it ended before).

    Raises:
        TimeoutError: SLURM still lists it as running after `timeout` seconds.
        RuntimeError: scancel refused (another user's job, say).
    """
    job_id = str(job_id)
    done = _scancel(job_id)
    if done.returncode != 0:
        raise RuntimeError(f"scancel {job_id} failed: {done.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while True:
        state: Any = query_states([job_id]).get(job_id, GONE)
        if state in FINAL_STATES or state == GONE:
            ReservationRecord.remove(job_id)
            return str(state)
        if time.monotonic() > deadline:
            raise TimeoutError(f"reservation {job_id} is still {state} after {timeout:g} s")
        time.sleep(POLL)
