"""The launcher's side of a launch, and its public entry: `Launcher` and `launch`.

`Launcher` is a dataclass of options (`options`, the floor every module here reads them
from) that runs (`driver`), and `launch(func, ...)` a call of it. Its modules: the checks of
the options and the call (`checks`), a launch's plan (`plan`: its hosts and the kind of its
agents, with the launcher's address in `address`), how agents start (`agents`: a module per
way), the agents kept in a pool (`pool`, whose `Router` routes the events of its loop, `pump`,
read by `listener` and `incoming`), one run on them (`run`, given one object per concern by
`run_setup`, judged by `verdicts`, its errors built by `failures`, watched by `watch`, its
stacks gathered by `stacks_gather`), a launch's attempts and restarts (`attempts`), and what
a warm launcher keeps between runs (`warm`). It talks to `slurmrun.node` only through
`slurmrun.protocol` and `slurmrun.transport`.
"""

from __future__ import annotations

from slurmrun.launcher.driver import Launcher, launch
from slurmrun.launcher.options import LaunchOptions

__all__ = ["LaunchOptions", "Launcher", "launch"]
