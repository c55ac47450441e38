"""How a launch's agents start: one kind per way (`kind.AgentKind`), one module each.

- `local`: subprocesses of the launcher (every host is this machine);
- `ssh`: one ``ssh`` per host, outside any scheduler;
- `srun`: one step of the SLURM job this runs in (its step's command line, environment and
  process: `srun_step`);
- `reserved`: the agents a reservation keeps (`slurmrun.reserve`), reached through its keeper
  from outside the job (``job=JOB_ID``).

What they share: the control variables and the user's (`common`), the agent's command and
its container (`containers`), the starters' processes (`starters`). The plan holds one kind,
chosen when it is made (`slurmrun.launcher.plan.make_plan`); the run and the dry run ask it,
never which kind it is.

`KINDS` names them, as an allocation provider does (`slurmrun.providers.Hosts.agents`): a new
way of starting agents is a module with a class that follows `AgentKind`, and its entry here.
"""

from __future__ import annotations

from slurmrun.launcher.agents.kind import AgentKind, AgentStart, DryWorkers, StartOrder
from slurmrun.launcher.agents.local import Local
from slurmrun.launcher.agents.reserved import Reserved
from slurmrun.launcher.agents.srun import Srun
from slurmrun.launcher.agents.ssh import Ssh

__all__ = [
    "KINDS",
    "AgentKind",
    "AgentStart",
    "DryWorkers",
    "Local",
    "Reserved",
    "Srun",
    "Ssh",
    "StartOrder",
]

KINDS: dict[str, type[AgentKind]] = {kind.name: kind for kind in (Local, Ssh, Srun, Reserved)}
