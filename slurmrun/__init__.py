"""slurmrun: run one Python function on every GPU (or CPU) of a SLURM allocation.

    >>> import slurmrun
    >>> result = slurmrun.launch(my_function, (arg,), workers_per_host=2)
    >>> result.rank(0)

Names are imported on first use, so that agents and workers, which import parts of this
package, do not pay for the launcher's modules (and ``import slurmrun`` stays light);
``slurmrun.__version__`` too, read from the installed package's metadata.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmrun.batch.array import submit_array
    from slurmrun.batch.handle import SubmittedLaunch, SubmittedMap, attach
    from slurmrun.batch.listing import jobs
    from slurmrun.batch.map_submit import submit_map
    from slurmrun.batch.requeue import Requeue, requeue_requested
    from slurmrun.batch.reserve import Reservation, release, reserve
    from slurmrun.batch.submit import submit
    from slurmrun.errors import (
        AgentFailedError,
        HangError,
        ItemTimeoutError,
        MapFailedError,
        NodeUnhealthyError,
        OptionsError,
        OptionsTypeError,
        OptionsValueError,
        VersionMismatchError,
        WorkerFailedError,
    )
    from slurmrun.handlers import add_filter_to_handler, file_handler, stream_handler
    from slurmrun.launcher import Launcher, launch
    from slurmrun.node.debugger import breakpoint
    from slurmrun.node.worker_state import worker_state
    from slurmrun.result import LaunchResult
    from slurmrun.slurm.job import SlurmAllocation, slurm_allocation

    __version__: str

_EXPORTS = {
    "AgentFailedError": "slurmrun.errors",
    "HangError": "slurmrun.errors",
    "ItemTimeoutError": "slurmrun.errors",
    "MapFailedError": "slurmrun.errors",
    "NodeUnhealthyError": "slurmrun.errors",
    "LaunchResult": "slurmrun.result",
    "OptionsError": "slurmrun.errors",
    "OptionsTypeError": "slurmrun.errors",
    "OptionsValueError": "slurmrun.errors",
    "Launcher": "slurmrun.launcher",
    "SlurmAllocation": "slurmrun.slurm.job",
    "SubmittedLaunch": "slurmrun.batch",
    "SubmittedMap": "slurmrun.batch",
    "VersionMismatchError": "slurmrun.errors",
    "WorkerFailedError": "slurmrun.errors",
    "add_filter_to_handler": "slurmrun.handlers",
    "file_handler": "slurmrun.handlers",
    "launch": "slurmrun.launcher",
    "slurm_allocation": "slurmrun.slurm.job",
    "stream_handler": "slurmrun.handlers",
    "attach": "slurmrun.batch",
    "jobs": "slurmrun.batch",
    "submit": "slurmrun.batch",
    "submit_array": "slurmrun.batch",
    "submit_map": "slurmrun.batch",
    "Requeue": "slurmrun.batch",
    "Reservation": "slurmrun.batch.reserve",
    "release": "slurmrun.batch.reserve",
    "reserve": "slurmrun.batch.reserve",
    "requeue_requested": "slurmrun.batch.requeue",
    "breakpoint": "slurmrun.node.debugger",
    "worker_state": "slurmrun.node.worker_state",
}

__all__ = [
    "AgentFailedError",
    "HangError",
    "ItemTimeoutError",
    "LaunchResult",
    "Launcher",
    "MapFailedError",
    "NodeUnhealthyError",
    "OptionsError",
    "OptionsTypeError",
    "OptionsValueError",
    "Requeue",
    "Reservation",
    "SlurmAllocation",
    "SubmittedLaunch",
    "SubmittedMap",
    "VersionMismatchError",
    "WorkerFailedError",
    "add_filter_to_handler",
    "attach",
    "breakpoint",
    "file_handler",
    "jobs",
    "launch",
    "release",
    "requeue_requested",
    "reserve",
    "slurm_allocation",
    "stream_handler",
    "submit",
    "submit_array",
    "submit_map",
    "worker_state",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = _version()
        return globals()[name]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slurmrun' has no attribute {name!r}")
    imported = importlib.import_module(module)
    for export, source in _EXPORTS.items():
        if source == module:
            globals()[export] = getattr(imported, export)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})


def _version() -> str:
    """The installed distribution's version; ``0+unknown`` for a checkout never installed."""
    from slurmrun.versions import slurmrun_version  # noqa: PLC0415 - ``import slurmrun`` stays light

    return slurmrun_version()
