"""The signal on which a worker's faulthandler dumps its stacks (`slurmrun.node.inbox`).

Its own module: the spawner ignores the signal before any worker exists, and must not import
more than this to do so (it is forked first thing, before the agent's own imports).
"""

from __future__ import annotations

import signal

__all__ = ["stacks_signal"]

# A real-time signal: SIGUSR1/2 are the user's (and SLURM's --signal).
_OFFSET = 4


def stacks_signal() -> int:
    """The signal on which a worker's faulthandler dumps every thread's stack."""
    return int(signal.SIGRTMIN) + _OFFSET
