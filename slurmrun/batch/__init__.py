"""Jobs from a login node: `submit`, `submit_array`, `submit_map`, their handles, `attach`."""

from __future__ import annotations

from slurmrun.batch.array import submit_array
from slurmrun.batch.folder import JobFolderError
from slurmrun.batch.handle import (
    JobFailedError,
    SubmittedJob,
    SubmittedLaunch,
    SubmittedMap,
    attach,
)
from slurmrun.batch.job_resources import JobResources
from slurmrun.batch.listing import JobInfo, jobs
from slurmrun.batch.map_submit import submit_map
from slurmrun.batch.requeue import Requeue, RequeueLimitError, requeue_count, requeue_requested
from slurmrun.batch.submit import SubmitDryRun, submit

__all__ = [
    "JobFailedError",
    "JobFolderError",
    "JobInfo",
    "JobResources",
    "Requeue",
    "RequeueLimitError",
    "SubmitDryRun",
    "SubmittedJob",
    "SubmittedLaunch",
    "SubmittedMap",
    "attach",
    "jobs",
    "requeue_count",
    "requeue_requested",
    "submit",
    "submit_array",
    "submit_map",
]
