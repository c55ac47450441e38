"""The parts of a run's START (`slurmrun.protocol.Start`), each typed and built once.

A run sends every agent one START: what the run's workers share (`RunStart`, built once per
run by `slurmrun.launcher.run.Run`, its `Surroundings` by the launcher for each run) and the
agent's own share (`AgentShare`). `slurmrun.protocol.start_header` joins the two into the
frame header; `Start` is both, as the agent reads it, and each worker is forked with it and
its place (`slurmrun.worker_env.RankPlace`): no field is copied by name on the way from the
launcher's options to a worker's environment. Standard library only: workers import it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["AgentShare", "RunStart", "Surroundings"]


@dataclass(frozen=True, kw_only=True)
class Surroundings:
    """Where the run's workers run: the launcher's paths, directory and variables."""

    sys_path: list[str]
    cwd: str
    env: dict[str, str]  # set in every worker, on top of the agent's environment
    unset: list[str] = dataclasses.field(default_factory=list)  # removed from every worker's env
    # The workers run another interpreter than the launcher's (a container): they keep their
    # own ``sys.path`` after ``sys_path``, which then holds only the launcher's own entries
    # (its script's directory, PYTHONPATH), none of its interpreter's.
    own_path: bool = False
    # What the run runs (``func train``, ``script train.py``: `slurmrun.titles.run_title`),
    # for the header line that starts the run's part of each worker's log file.
    title: str = ""


@dataclass(frozen=True, kw_only=True)
class RunStart(Surroundings):
    """What every agent's START of one run shares: the run, its world and its workers' place."""

    run: int  # the run's id: every message of the run carries it back
    world_size: int
    master_addr: str
    master_port: int
    backend: str | None
    timeout: float
    grace: float  # seconds from SIGTERM to SIGKILL when workers are stopped
    log_level: int
    # Where the agent writes each worker's finished lines (`slurmrun.logs.WorkerLog`); None:
    # it does not (the launcher writes files, or there are none).
    log_dir: str | None = None
    # Every node's worker count in SLURM's compressed form ("2(x2),1"): the run's layout, as
    # workers see it in SLURM_TASKS_PER_NODE (`slurmrun.worker_env`). Empty: `workers` per node.
    tasks_per_node: str = ""
    # Keep the workers for the next run if this one succeeds (`Launcher.keep_workers`): the
    # agent then hands the next run to them (`slurmrun.node.kept`) instead of forking new ones.
    keep: bool = False
    # The agent's output window from now on, in `protocol.log_cost` units (see
    # `protocol.OUTPUT_WINDOW`); 0: as is.
    output_window: int = 0
    # A shell command each agent runs before it forks fresh workers (`Launcher.health_check`,
    # `slurmrun.node.health_check`); None: none.
    health_check: str | None = None
    # The built-in check of the node's GPUs (`Launcher.gpu_check`): "auto", where NVIDIA's
    # driver is; "on", wherever GPUs are given; "off", never.
    gpu_check: str = "auto"
    # A map's run (`Launcher.map`, `slurmrun.map_messages`): its workers are slots of this many;
    # a worker's death ends its slot only, not the run. 0: an ordinary run.
    workers_per_item: int = 0

    @functools.cached_property
    def shared_fields(self) -> dict[str, Any]:
        """This part's fields by name, made once (a run joins it to every agent's share)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunStart)}


@dataclass(frozen=True, kw_only=True)
class AgentShare:
    """One agent's share of a run: its workers' ranks, and what it forwards and writes."""

    workers: int
    rank_offset: int  # the global rank of its local rank 0
    node_rank: int
    # The local ranks whose output and logging records go to the launcher (None: every
    # rank's). The agent's own always do.
    forward_ranks: list[int] | None = None
    # The agent's name in log file names (`slurmrun.logs.host_labels`: a host named twice has
    # one per node); empty: its hostname.
    log_name: str = ""

    def own_fields(self) -> dict[str, Any]:
        """This part's fields by name."""
        return {name: getattr(self, name) for name in _SHARE_NAMES}


_SHARE_NAMES = tuple(f.name for f in dataclasses.fields(AgentShare))
