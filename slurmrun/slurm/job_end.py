"""How SLURM ends a job: its time limit, what time SIGTERM leaves before SIGKILL, preemption.

SLURM ends a job's steps with SIGTERM to every process in them (workers included) and
SIGKILL ``KillWait`` later (the time limit, ``scancel``); a preempted job gets the partition's
``GraceTime`` first, then SIGTERM again and SIGKILL ``KillWait`` later. slurmrun leaves all of
that time to the workers (docs/slurm.md, "Cancellation, signals"). ``slurmrun info`` shows
it (`job_end`: three ``scontrol`` calls, each bounded; what scontrol does not say is None),
so that a user knows how long a checkpoint may take; a failed launch asks whether SLURM is
preempting its job (`preemption`: one ``scontrol`` call), and a run that ends for it whether
SLURM will requeue the job itself when its batch script ends (`requeued_when_batch_ends`).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurmrun.slurm.fields import config_fields, first_record
from slurmrun.slurm.scontrol import scontrol, scontrol_show_job

__all__ = [
    "GRACE_REQUEUE_SINCE",
    "PREEMPTED_RECENTLY",
    "JobEnd",
    "Preemption",
    "job_end",
    "preemption",
    "requeued_when_batch_ends",
]

_SECONDS = re.compile(r"(\d+)(?: sec)?")
_RELEASE = re.compile(r"(\d+)\.(\d+)")


@dataclass(frozen=True)
class JobEnd:
    """When and how SLURM ends a job (see `job_end`)."""

    time_limit: str  # as scontrol prints it: "00:05:00", "1-00:00:00", "UNLIMITED"
    end_time: str | None  # "2026-11-25T10:23:14"; None when unknown or unlimited
    kill_wait: int | None  # seconds from SIGTERM to SIGKILL at the time limit or scancel
    partition: str
    preempt_mode: str | None  # the partition's, else the cluster's: OFF, REQUEUE, CANCEL...
    # seconds from the first SIGTERM to the second when preempted (SIGKILL then follows after
    # KillWait); with PreemptType=preempt/qos the job's QOS sets it, not the partition
    grace_time: int | None
    # the cluster's: preempt/partition_prio, preempt/qos; none: preempt/none or (null)
    preempt_type: str | None = None

    @property
    def preemptible(self) -> bool:
        """Whether the job can be preempted (a preemption type, and a mode other than OFF)."""
        # 22.05 prints "preempt/none" for no preemption plugin, 24.11 and later "(null)".
        if self.preempt_type is not None and (
            self.preempt_type.endswith("/none") or self.preempt_type in ("(null)", "")
        ):
            return False
        return self.preempt_mode is not None and self.preempt_mode.upper() != "OFF"


def _seconds(value: str | None) -> int | None:
    match = _SECONDS.fullmatch(value.strip()) if value else None
    return int(match.group(1)) if match else None


def job_end(
    job_id: str, scontrol: Callable[[Sequence[str]], str | None] = scontrol
) -> JobEnd | None:
    """How SLURM will end job `job_id`; None when scontrol does not know the job.

    Args:
        job_id: the job, as scontrol names it (`slurmrun.slurm.job.own_job_id`).
        scontrol: runs scontrol with these arguments; its output, or None if it failed.
    """
    job = first_record(scontrol(["show", "job", job_id]) or "").fields
    if "TimeLimit" not in job:
        return None
    partition = job.get("Partition", "")
    part = first_record(scontrol(["show", "partition", partition]) or "").fields
    config = config_fields(scontrol(["show", "config"]) or "")
    end_time = job.get("EndTime")
    return JobEnd(
        time_limit=job["TimeLimit"],
        end_time=end_time if end_time and end_time[:1].isdigit() else None,
        kill_wait=_seconds(config.get("KillWait")),
        partition=partition,
        preempt_mode=part.get("PreemptMode") or config.get("PreemptMode"),
        grace_time=_seconds(part.get("GraceTime")),
        preempt_type=config.get("PreemptType"),
    )


# A launch fails seconds after SLURM terminates a preempted job's steps; an older PreemptTime
# is left from an earlier suspension (PreemptMode=SUSPEND), which SLURM never clears.
PREEMPTED_RECENTLY = 600.0


@dataclass(frozen=True)
class Preemption:
    """A job that SLURM is preempting (``scontrol show job``).

    Attributes:
        job_id: the job (``<array id>_<task id>`` for an array task).
        time: when SLURM selected it (``PreemptTime``).
        requeueable: whether SLURM may requeue it (``Requeue=1``: ``--requeue``, or the
            cluster's ``JobRequeue=1``).
        partition: its partition (whose ``PreemptMode`` applies).
    """

    job_id: str
    time: str
    requeueable: bool
    partition: str = ""


def preemption(
    job_id: str,
    scontrol: Callable[[str], str | None] | None = None,
    now: datetime.datetime | None = None,
) -> Preemption | None:
    """Whether SLURM is preempting job `job_id` (None: it is not, or scontrol fails).

    With a partition's ``GraceTime``, a preempted job's steps (agents and workers) get SIGTERM
    while the job runs on: a launch that fails then asks this (one ``scontrol`` call). Only a
    ``PreemptTime`` of the last `PREEMPTED_RECENTLY` seconds counts.

    Args:
        job_id: the job (`slurmrun.slurm.job.own_job_id`).
        scontrol: ``scontrol show job``'s output for a job id (default: run it).
        now: the time to compare ``PreemptTime`` with (default: now; SLURM prints local time).
    """
    fields = first_record((scontrol or scontrol_show_job)(job_id) or "").fields
    try:
        when = datetime.datetime.fromisoformat(fields.get("PreemptTime", ""))
    except ValueError:  # "None", "Unknown", or no such job
        return None
    age = ((now or datetime.datetime.now()) - when).total_seconds()
    if not -60 <= age <= PREEMPTED_RECENTLY:  # a minute of clock skew between hosts
        return None
    return Preemption(
        job_id, fields["PreemptTime"], fields.get("Requeue") == "1", fields.get("Partition", "")
    )


# From SLURM 24.05 on, slurmctld requeues a job that it signalled for a preemption's GraceTime
# when the job's batch script ends within the grace (Requeue=1, PreemptMode=REQUEUE): its
# _slurm_rpc_complete_batch_script sees the job's GRACE_PREEMPT mark and completes the job as
# requeued (CHANGELOG 24.05: "assume that job signalled for GraceTime was preempted"); 22.05 and
# 23.x end it COMPLETED. Only that requeue clears the mark (_job_complete): 24.11 keeps it
# through a `scontrol requeue` in the grace (or the requeue at the grace's end), and the next
# run's end then requeues the job once more (seen on the test cluster; 26.05.5 does not). No
# field of scontrol shows the mark, so the controller's release (SLURM_VERSION) tells.
GRACE_REQUEUE_SINCE = (24, 5)


def requeued_when_batch_ends(
    preempted: Preemption, scontrol: Callable[[Sequence[str]], str | None] = scontrol
) -> bool:
    """Whether SLURM requeues the `preempted` job itself once its batch script ends.

    True from SLURM 24.05 on (`GRACE_REQUEUE_SINCE`, the controller's ``SLURM_VERSION``) for
    a requeueable job whose partition's ``PreemptMode`` (else the cluster's) is ``REQUEUE``:
    ending the batch script within the grace requeues the job once, and a ``scontrol
    requeue`` then would requeue it twice. False where scontrol does not say (two calls).

    Args:
        preempted: the job, as `preemption` found it.
        scontrol: runs scontrol with these arguments; its output, or None if it failed.
    """
    if not preempted.requeueable:
        return False
    config = config_fields(scontrol(["show", "config"]) or "")
    release = _RELEASE.match(config.get("SLURM_VERSION", ""))
    if release is None or (int(release[1]), int(release[2])) < GRACE_REQUEUE_SINCE:
        return False
    partition = preempted.partition
    part = (
        first_record(scontrol(["show", "partition", partition]) or "").fields if partition else {}
    )
    mode = part.get("PreemptMode") or config.get("PreemptMode") or ""
    return "REQUEUE" in mode.upper().split(",")
