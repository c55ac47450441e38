"""slurmrun: run one Python function on every GPU (or CPU) of a SLURM allocation.

>>> import slurmrun
>>> result = slurmrun.launch(my_function, (arg,), workers_per_host=2)
>>> result.rank(0)
"""

from __future__ import annotations

from slurmrun.allocation import SlurmAllocation, slurm_allocation
from slurmrun.errors import AgentFailedError, WorkerFailedError
from slurmrun.launcher import Launcher, launch
from slurmrun.logs import add_filter_to_handler, file_handler, stream_handler
from slurmrun.result import LaunchResult
from slurmrun.submit import SubmittedLaunch, submit

__all__ = [
    "AgentFailedError",
    "LaunchResult",
    "Launcher",
    "SlurmAllocation",
    "SubmittedLaunch",
    "WorkerFailedError",
    "add_filter_to_handler",
    "file_handler",
    "launch",
    "slurm_allocation",
    "stream_handler",
    "submit",
]
