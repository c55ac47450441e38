"""Jobs from a login node: `submit`, the `SubmittedLaunch` handle, `attach`, `jobs`.

``slurmrun.jobs`` is this package, and calling it lists a folder's jobs:
``slurmrun.jobs(folder=...)`` is `slurmrun.jobs.listing.jobs` (the package's class makes
it callable, so that the name means one thing whether or not the package is imported yet).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from slurmrun.jobs.handle import JobFailedError, SubmittedLaunch, attach
from slurmrun.jobs.listing import JobInfo, jobs
from slurmrun.jobs.submit import SubmitDryRun, submit

__all__ = [
    "JobFailedError",
    "JobInfo",
    "SubmitDryRun",
    "SubmittedLaunch",
    "attach",
    "jobs",
    "submit",
]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return jobs(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
