"""Forks that die with their parent.

The spawner dies with its agent, workers and preload probes with the spawner: nothing of a
node's run outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

__all__ = ["be_subreaper", "die_with_parent", "outlive_parent"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(parent_pid: int, *, reaper: bool = False) -> None:
    """Asks the kernel to SIGKILL this fresh fork when its parent goes away.

    With `reaper`, this process also becomes the child subreaper of its descendants. Not
    Linux: the agent's socket closing still ends spawner and workers.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if reaper:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(70)


def be_subreaper() -> bool:
    """Makes this process the child subreaper of its descendants; False where it cannot be."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def outlive_parent() -> None:
    """Undoes `die_with_parent`'s signal: this process is to outlive its parent (a successor)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
