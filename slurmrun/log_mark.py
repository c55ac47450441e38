"""Whether an srun agent sees the launcher's log directory (the standard library only).

Before it starts its agents' step, the launcher writes a file of its own in the launch's log
directory (`slurmrun.launcher.agents.srun_step.log_dir_mark`) and names it in
``LOG_DIR_MARK_VAR``. An agent that cannot see that file writes its log files where the
launcher never reads them: SLURM 22.05 fails such an agent's task when it cannot open srun's
``--output``, but 24.11+ creates the missing folders on the node instead. The agent asks
first thing (`unseen_mark`), and says so in its hello; the launcher then fails the launch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

from slurmrun.variables import LOG_DIR_MARK_VAR

__all__ = ["unseen_mark"]


def unseen_mark(env: Mapping[str, str]) -> str:
    """The launcher's mark in its log directory, if this agent cannot see it; else "".

    Unseen, the log directory here is a folder of this node alone: this agent's log file
    there is removed, and the folder if that leaves it empty, so that the failed launch
    leaves nothing behind on the node.

    Args:
        env: the agent's environment (``LOG_DIR_MARK_VAR``: srun agents writing log files).
    """
    mark = env.get(LOG_DIR_MARK_VAR, "")
    if not mark or os.path.exists(mark):
        return ""
    folder = os.path.dirname(mark)
    with contextlib.suppress(OSError):
        output = os.readlink("/proc/self/fd/1")  # srun's --output, as slurmstepd opened it
        if os.path.dirname(output) == folder:
            os.unlink(output)
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # fails while another agent's file is there: that agent removes it
    return mark
