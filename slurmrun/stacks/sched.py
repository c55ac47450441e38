"""How much of the CPU a worker's main thread got: Linux's schedstat, carried by each sample.

A rank that works while the others wait for it holds them back; so does a rank that wanted to
work but waited for a CPU (a busy core, shared with the launcher, its agent, other jobs). Each
answer to a sample carries the main thread's time on a CPU and its time runnable but waiting
for one (``/proc/self/task/<tid>/schedstat``), both counted since the thread began; the
straggler judge (`slurmrun.launcher.stragglers`) takes the difference between two samples.

Standard library only: every worker imports this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Sched", "main_thread_sched"]


@dataclass(frozen=True)
class Sched:
    """A thread's scheduler figures, in nanoseconds since it began."""

    cpu_ns: int  # on a CPU
    queued_ns: int  # runnable, waiting for a CPU (the run queue)


def main_thread_sched() -> Sched | None:
    """This process's main thread's `Sched`; None where the kernel does not keep them."""
    # The main thread is the process's first (its id is the pid): a worker forked from another
    # process keeps that one's `threading.main_thread().native_id`, so it is not asked.
    try:
        with open(f"/proc/self/task/{os.getpid()}/schedstat", "rb") as f:
            cpu, queued, _ = f.read().split()
        return Sched(int(cpu), int(queued))
    except (OSError, ValueError):  # not Linux, or a kernel without schedstats
        return None
