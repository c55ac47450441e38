"""What every kind of agents starts with: the launcher's control variables, the user's variables.

A kind (`slurmrun.launcher.agents.kind.AgentKind`) adds its own (srun: the job's variables for
the workers) and decides how they travel (srun's ``--export``, ssh's stdin, a subprocess's
environment). It asks SLURM nothing: what it needs of the job is in the plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from slurmrun.environment import user_env
from slurmrun.launcher.agents.starters import package_pythonpath
from slurmrun.protocol import HEARTBEATS_PER_TIMEOUT
from slurmrun.variables import (
    ENV_FILE_VAR,
    HEARTBEAT_VAR,
    JOB_TASKS_VAR,
    LAUNCHER_ADDR_VAR,
    LEARN_PRELOADS_VAR,
    PORT_VAR,
    PRELOAD_LATER_VAR,
    PRELOAD_VAR,
    SECRET_VAR,
)

if TYPE_CHECKING:
    from slurmrun.launcher.agents.containers import AgentCommand
    from slurmrun.launcher.options import Options
    from slurmrun.slurm.job import SlurmAllocation

__all__ = ["agent_env", "control_env", "silence"]


def silence(cfg: Options) -> float:
    """How long an agent may be silent before it counts as dead, and the launcher for agents.

    Heartbeats must come often enough for the shorter of the two timeouts.
    """
    return float(min(cfg.timeout, cfg.heartbeat_timeout))


def control_env(
    cfg: Options,
    command: AgentCommand,
    alloc: SlurmAllocation | None,
    *,
    secret: str,
    advertise: str,
    port: str,
    once: bool = False,
) -> dict[str, str]:
    """The variables the launcher sets for every agent, whatever starts it.

    Args:
        cfg: the launch's options.
        command: the agents' command (in a container, slurmrun's PYTHONPATH is not given).
        alloc: the job the launch runs in, if any (its tasks per node go to the agents).
        secret: the launch's secret (hex), which agents prove they know.
        advertise: the launcher's address the agents connect to.
        port: the launcher's port.
        once: the agents serve one run (`slurmrun.launcher.plan.Plan.once`).
    """
    # Modules the spawner imports before forking workers (the command's script mode asks for
    # torch although it initialises no process group). Without a process group torch is
    # imported after the first run instead, for a warm launcher's later runs: a one-shot
    # launch has none, and neither imports it nor learns what its workers import (a fork of
    # each spawner would import it all again, beside the run, for nothing). A value the
    # user set is taken as it is.
    preload = os.environ.get(PRELOAD_VAR)
    later = not preload and cfg.backend is None and not once
    control = {
        SECRET_VAR: secret,
        LAUNCHER_ADDR_VAR: advertise,
        PORT_VAR: port,
        PRELOAD_VAR: preload or ("" if cfg.backend is None else "torch"),
        PRELOAD_LATER_VAR: "torch" if later else "",
        LEARN_PRELOADS_VAR: "1" if cfg.learn_preloads and not once else "0",
        HEARTBEAT_VAR: str(max(0.05, silence(cfg) / HEARTBEATS_PER_TIMEOUT)),
    }
    if not command.contained:  # this slurmrun; a container has its own
        control["PYTHONPATH"] = package_pythonpath(os.environ)
    if cfg.env_file:
        control[ENV_FILE_VAR] = os.path.abspath(cfg.env_file)
    if alloc is not None and alloc.tasks_per_node is not None:
        control[JOB_TASKS_VAR] = ",".join(map(str, alloc.tasks_per_node))
    return control


def agent_env(
    cfg: Options, environ: Mapping[str, str], control: Mapping[str, str]
) -> dict[str, str]:
    """The agents' own variables: the user's (`user_env`, read in `environ`), then `control`."""
    return user_env(cfg.default_env_vars, cfg.extra_env_vars, environ) | dict(control)
