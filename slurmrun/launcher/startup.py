"""What a plan's agents start with: their starter (srun, ssh or local) and their environment.

`slurmrun.launcher.plan` decides where the agents run, once per launch; this turns that plan
into how they start, at each start of agents (`slurmrun.launcher.warm.open_pool`) and for a
dry run (`slurmrun.launcher.dryrun.plan_dry_run`, with no secret and port 0). It asks SLURM
nothing: what it needs of the job is in the plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from slurmrun.environment import user_env
from slurmrun.launcher import srun
from slurmrun.launcher.ssh import SshAgents
from slurmrun.launcher.starters import AgentStarter, LocalAgents, package_pythonpath
from slurmrun.protocol import HEARTBEATS_PER_TIMEOUT
from slurmrun.variables import (
    ENV_FILE_VAR,
    HEARTBEAT_VAR,
    JOB_ENV_VAR,
    JOB_TASKS_VAR,
    LAUNCHER_ADDR_VAR,
    LEARN_PRELOADS_VAR,
    PORT_VAR,
    PRELOAD_LATER_VAR,
    PRELOAD_VAR,
    SECRET_VAR,
)
from slurmrun.worker_env import job_vars

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.launcher.plan import Plan
    from slurmrun.log_dirs import LogDir

__all__ = ["agent_start", "silence"]


def silence(cfg: Options) -> float:
    """How long an agent may be silent before it counts as dead, and the launcher for agents.

    Heartbeats must come often enough for the shorter of the two timeouts.
    """
    return float(min(cfg.timeout, cfg.heartbeat_timeout))


def agent_start(
    cfg: Options, plan: Plan, log_dir: LogDir, *, secret: str, advertise: str, port: str
) -> tuple[AgentStarter, dict[str, str]]:
    """The agents' starter, and the environment to start them with.

    What a run starts its agents with (`slurmrun.launcher.warm.open_pool`), and what a dry
    run shows (`slurmrun.launcher.dryrun.plan_dry_run`, with no secret and port 0).

    Args:
        cfg: the launch's options.
        plan: the launch's plan.
        log_dir: the launch's log directory.
        secret: the launch's secret (hex), which agents prove they know.
        advertise: the launcher's address the agents connect to.
        port: the launcher's port.
    """
    control = _control_env(cfg, plan, secret, advertise, port)
    return _agent_starter(cfg, plan, log_dir, control)


def _control_env(
    cfg: Options, plan: Plan, secret: str, advertise: str, port: str
) -> dict[str, str]:
    """The variables the launcher sets for its agents (`_agent_starter` adds the job's tasks)."""
    # Modules the spawner imports before forking workers (the command's script mode asks for
    # torch although it initialises no process group). Without a process group torch is
    # imported after the first run instead: a one-shot launch never waits for it, and later
    # runs of a warm launcher find it loaded. A value the user set is taken as it is.
    preload = os.environ.get(PRELOAD_VAR)
    control = {
        SECRET_VAR: secret,
        LAUNCHER_ADDR_VAR: advertise,
        PORT_VAR: port,
        PRELOAD_VAR: preload or ("" if cfg.backend is None else "torch"),
        PRELOAD_LATER_VAR: "torch" if not preload and cfg.backend is None else "",
        LEARN_PRELOADS_VAR: "1" if cfg.learn_preloads else "0",
        HEARTBEAT_VAR: str(max(0.05, silence(cfg) / HEARTBEATS_PER_TIMEOUT)),
    }
    if not plan.command.contained:  # this slurmrun; a container has its own
        control["PYTHONPATH"] = package_pythonpath(os.environ)
    if cfg.env_file:
        control[ENV_FILE_VAR] = os.path.abspath(cfg.env_file)
    return control


def _agent_starter(
    cfg: Options, plan: Plan, log_dir: LogDir, control: dict[str, str]
) -> tuple[AgentStarter, dict[str, str]]:
    if plan.alloc is not None and plan.alloc.tasks_per_node is not None:
        control[JOB_TASKS_VAR] = ",".join(map(str, plan.alloc.tasks_per_node))
    environ: Mapping[str, str] = os.environ
    if not plan.local and not plan.ssh:
        # srun runs with our environment less what would reshape the agents' step (the driver's
        # own step, SLURM_CPUS_PER_TASK...); the agents get only the names listed in --export,
        # with their values taken from srun's environment, so no value is on a command line.
        environ = srun.srun_environment(os.environ)
        control[JOB_ENV_VAR] = job_vars(os.environ)  # the workers' SLURM_JOB_NAME, ...
    agent_env = user_env(cfg.default_env_vars, cfg.extra_env_vars, environ) | control
    if plan.local:
        return LocalAgents(plan.hostnames, log_dir.path, command=plan.command.agent()), agent_env
    if plan.ssh:
        ssh = SshAgents(
            plan.hostnames, log_dir.path, config_file=cfg.ssh_config_file, command=plan.command
        )
        return ssh, agent_env
    assert plan.step is not None  # noqa: S101 - make_plan resolves srun agents' step
    starter = srun.srun_agents(
        plan.step, log_dir.path, sorted(agent_env), node_logs=log_dir.keep, command=plan.command
    )
    return starter, {**environ, **agent_env}
