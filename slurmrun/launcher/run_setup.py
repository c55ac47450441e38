"""What a run is given, one object per concern (`slurmrun.launcher.run.Run`).

`slurmrun.launcher.warm` makes them from the launch's options and plan for each run: the call
and the world its workers make (`Call`), where their output goes (`Output`), and what watches
the run (`Watching`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from slurmrun.start_parts import Surroundings

if TYPE_CHECKING:
    from slurmrun.events import Trace

__all__ = ["Call", "Output", "Watching"]


@dataclass(frozen=True)
class Call:
    """What the run runs, and how its workers meet.

    Attributes:
        payload: the pickled call.
        surroundings: where the workers run (paths, directory, variables, title).
        workers_per_host: each node's worker count; None: each agent's own (``"auto"``).
        backend: the process group's backend (None: no process group).
        timeout: the process group's timeout, in seconds.
        grace: seconds from SIGTERM to SIGKILL when the workers are stopped.
        local_master: rank 0's store is reached at 127.0.0.1 (the agents are local).
        keep_workers: the workers of a successful run serve the next (`Launcher.keep_workers`).
        health_check: the command each node runs before its fresh workers start (None: none).
        gpu_check: the built-in check of each node's GPUs ("auto", "on", "off").
        workers_per_item: a map's run, of slots of this many workers (`Launcher.map`); 0: not.
    """

    payload: bytes
    surroundings: Surroundings
    workers_per_host: Sequence[int] | None
    backend: str | None
    timeout: float
    grace: float = 3.0
    local_master: bool = False
    keep_workers: bool = False
    health_check: str | None = None
    gpu_check: str = "auto"
    workers_per_item: int = 0


@dataclass(frozen=True)
class Output:
    """Where the run's output and logging records go.

    Attributes:
        handlers: the user's handlers; None: the defaults (`slurmrun.handlers`).
        log_dir: where the default handlers write a file per worker; None: nowhere.
        agents_write_logs: the agents see `log_dir` and write their workers' files themselves
            (srun and local agents); with the default handlers they then send only the
            records shown live.
        log_level: the workers' logging level.
        show_ranks: the ranks the default handlers show live.
    """

    handlers: list[logging.Handler] | None = None
    log_dir: str | None = None
    agents_write_logs: bool = False
    log_level: int = logging.INFO
    show_ranks: Literal["all"] | Collection[int] = (0,)


@dataclass(frozen=True)
class Watching:
    """What watches the run.

    Attributes:
        trace: the launch's events and milestones (None: none).
        stall_timeout: seconds without a word from any rank that make a stall (None: off;
            `slurmrun.launcher.watch`).
        stragglers: whether every rank's stacks are sampled for stragglers
            (`slurmrun.launcher.sampling`).
        hang_timeout: seconds every rank may be stuck, some in a collective, or ``"auto"``
            (`slurmrun.launcher.hangs`); None: off.
    """

    trace: Trace | None = None
    stall_timeout: float | None = None
    stragglers: bool = False
    hang_timeout: float | Literal["auto"] | None = None
