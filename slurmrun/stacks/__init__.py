"""Every rank's stacks, during a run: the whole feature, but for what each side does of it.

``launcher.stacks()``, ``slurmrun stacks``, a stall (``stall_timeout``), Ctrl-C and a failure
ask a running launcher for every rank's stacks; the launcher asks its agents (ASK_STACKS),
each agent asks its workers and dumps with faulthandler those that do not answer, and the
launcher groups the answers into one report. Here, on the ground floor both sides stand on:

- `slurmrun.stacks.report`: a worker's capture of its threads (`capture`), its parsing, and
  the report (`StackReport`: ranks grouped by stack, written to the log directory);
- `slurmrun.stacks.control`, `slurmrun.stacks.control_dir`: the launcher's private control
  socket, through which ``slurmrun stacks`` reaches it from another terminal;
- `slurmrun.stacks.verb`: the ``slurmrun stacks`` command;
- `stacks_signal`: the signal on which a worker's faulthandler dumps.

Each side's part lives on its side (the launcher and the nodes import nothing of each other):
`slurmrun.launcher.stacks_gather` asks the agents and gathers their answers, and
`slurmrun.node.stacks_answer` is an agent's answer. This module imports only `signal`: the
spawner reads `stacks_signal` before any worker exists, first thing, before the agent's own
imports; the report's names (``slurmrun.stacks.StackReport``) load when first used.
"""

from __future__ import annotations

import importlib
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmrun.stacks.report import Frame as Frame
    from slurmrun.stacks.report import RankStacks as RankStacks
    from slurmrun.stacks.report import StackReport as StackReport
    from slurmrun.stacks.report import StackSource as StackSource
    from slurmrun.stacks.report import ThreadStack as ThreadStack

# The report's types (`slurmrun.stacks.report`), as `Launcher.stacks` returns them.
__all__ = ["Frame", "RankStacks", "StackReport", "StackSource", "ThreadStack", "stacks_signal"]

# A real-time signal: SIGUSR1/2 are the user's (and SLURM's --signal).
_OFFSET = 4


def stacks_signal() -> int:
    """The signal on which a worker's faulthandler dumps every thread's stack."""
    return int(signal.SIGRTMIN) + _OFFSET


def __getattr__(name: str) -> Any:
    """The report's names, imported when first used (`slurmrun.stacks.report`)."""
    if name in __all__:
        return getattr(importlib.import_module("slurmrun.stacks.report"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
