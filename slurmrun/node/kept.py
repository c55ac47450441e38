"""Workers kept from one run to the next (`Launcher.keep_workers`).

A run that asks for it (`protocol.Start.keep`) leaves its workers waiting for the next FUNC
once each sent its result; if the run succeeds, the launcher's END says to keep them, and the
agent hands the next run to them instead of forking new ones: no fork, no imports, no new
process group, and `slurmrun.worker_state()` as the last run left it.

A worker takes a later run only if that run starts it as the first did (`FIXED`: its rank,
world, process group, environment, paths; not where its log file is, which the agent moves);
otherwise, or if one of them exited or is stopped (SIGSTOP: it would never answer), or the
last run failed or was stopped, the run gets new workers and the launcher is told why
(`protocol.Started.fresh_why`), so that no run mistakes an empty state for a kept one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slurmrun import protocol
from slurmrun.node.relay import WorkerLink

__all__ = ["FIXED", "KeptWorkers", "adopt", "ended_by", "is_stopped", "lost_after", "servable"]

# What a worker took from its first run's START and keeps: a run that differs needs new ones.
FIXED = (
    "workers",
    "rank_offset",
    "world_size",
    "node_rank",
    "master_addr",
    "backend",
    "timeout",
    "log_level",
    "sys_path",
    "own_path",
    "cwd",
    "env",
    "unset",
    "tasks_per_node",
)


@dataclass
class KeptWorkers:
    """The workers a run left for the next, and the START they were made for."""

    start: protocol.Start
    links: list[WorkerLink]

    def why_not(self, start: protocol.Start) -> str:
        """Why these workers cannot take `start` ("" if they can)."""
        changed = [name for name in FIXED if getattr(start, name) != getattr(self.start, name)]
        if changed:
            names = ", ".join(changed)
            return f"the run's {names} differ from the kept workers' (run {self.start.run})"
        gone = [w.local_rank for w in self.links if not w.process.is_alive()]
        if gone:
            return f"kept worker(s) of local rank {gone} exited after run {self.start.run}"
        stopped = [w.local_rank for w in self.links if is_stopped(w.process.pid)]
        if stopped:
            return (
                f"kept worker(s) of local rank {stopped} is stopped (SIGSTOP, Ctrl-Z) since "
                f"run {self.start.run}: it would never take this run"
            )
        return ""


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc; False where unknown).

    A traced stop (``t``: a debugger or py-spy attached) is not counted: it is someone's
    choice, and py-spy's lasts a moment.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The name (in parentheses) may hold anything, spaces and ")" included: the state follows
    # the last ")".
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"


def lost_after(run: int) -> str:
    """Why a run has new workers after `run`, whose workers were not kept."""
    return (
        f"run {run} did not end with every worker's result (it failed or was stopped, or a "
        "worker ended its process group), so its workers were ended"
    )


def ended_by(run: int, kept_run: int) -> str:
    """Why a run has new workers: run `run`, which kept none (a map's), ended `kept_run`'s."""
    return (
        f"run {run} (a map, or a run without keep_workers) came after run {kept_run} and "
        "ended the workers it had kept"
    )


def servable(worker: WorkerLink) -> bool:
    """Whether a worker can take the next run: alive, and its result said it stays."""
    return worker.outcome is protocol.Result and worker.stays and worker.process.is_alive()


def adopt(worker: WorkerLink, start: protocol.Start, wake: Callable[[], None]) -> None:
    """Makes a kept worker one of the run `start` (its frames then carry that run's id)."""
    worker.run = start.run
    worker.delivered = worker.judged = worker.stays = False
    worker.outcome = None
    worker.last_lines.clear()
    forward = start.forward_ranks
    worker.forward = forward is None or worker.local_rank in forward
    worker.wake = wake
