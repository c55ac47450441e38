"""A job as a launcher waiting for it is told: its state, owner, SLURM's reason, its start.

One squeue of the one job (``squeue --start`` gives the expected start of a pending job; a
running one has none).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from slurmrun.slurm.queue import run_query

__all__ = ["JobWait", "job_wait"]

QUERY_TIMEOUT = 15.0


@dataclass(frozen=True)
class JobWait:
    """A job as squeue sees it now.

    Attributes:
        state: ``PENDING``, ``RUNNING``...
        uid: its owner's uid (-1: not said).
        reason: why it waits (``Resources``, ``Priority``; ``None`` once it runs).
        start: its expected start (``2026-11-27T18:00:00``, ``N/A``), for a pending job.
        left: its time left (``9:58``, ``1-02:00:00``; ``UNLIMITED``).
    """

    state: str
    uid: int
    reason: str
    start: str
    left: str = ""

    def __str__(self) -> str:
        if self.state != "PENDING":
            return self.state
        start = "" if self.start in {"", "N/A", "Unknown"} else f", expected to start {self.start}"
        return f"PENDING ({self.reason}{start})"


def job_wait(job_id: str) -> JobWait | None:
    """What squeue says of `job_id` now; None: it does not know the job (ended, or no squeue)."""
    if shutil.which("squeue") is None:
        return None
    argv = ["squeue", "--noheader", f"--jobs={job_id}", "--format=%T|%U|%r|%S|%L"]
    done = run_query(argv, QUERY_TIMEOUT)
    if done is None:
        return None
    for line in done.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 5:
            state, uid, reason, start, left = fields
            return JobWait(state, int(uid) if uid.isdigit() else -1, reason, start, left)
    return None
