"""Jobs from a login node: `submit`, the `SubmittedLaunch` handle, `attach`, `jobs`."""

from __future__ import annotations

from slurmrun.batch.handle import JobFailedError, SubmittedLaunch, attach
from slurmrun.batch.listing import JobInfo, jobs
from slurmrun.batch.submit import SubmitDryRun, submit

__all__ = [
    "JobFailedError",
    "JobInfo",
    "SubmitDryRun",
    "SubmittedLaunch",
    "attach",
    "jobs",
    "submit",
]
