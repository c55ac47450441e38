"""Local agents: subprocesses of the launcher, every host this machine (``localhost``).

The kind (`Local`) and its starter (`LocalAgents`). Each agent writes its own log file, and
the workers' master address is loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from slurmrun.devices import visible_gpu_count
from slurmrun.launcher.address import Address, loopback
from slurmrun.launcher.agents.common import agent_env
from slurmrun.launcher.agents.containers import PLAIN
from slurmrun.launcher.agents.kind import AgentKind, AgentStart, DryWorkers, StartOrder
from slurmrun.launcher.agents.starters import (
    HostAgents,
    exited_unreaped,
    local_agent_env,
    wait_or_kill_group,
)
from slurmrun.slurm.job import agent_auto_workers, env_job_id

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.providers import Hosts

__all__ = ["Local", "LocalAgents", "is_local"]

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_local(host: str) -> bool:
    """Whether `host` names this machine."""
    return host in _LOCAL_NAMES or host == socket.gethostname()


@dataclass(frozen=True)
class Local(AgentKind):
    """Agents as subprocesses of the launcher (`slurmrun.launcher.agents.kind.AgentKind`)."""

    name: ClassVar[str] = "local"
    shown: ClassVar[str] = "local subprocesses of the launcher"
    env_on_stdin: ClassVar[bool] = False
    local_master: ClassVar[bool] = True
    writes_logs: ClassVar[bool] = True

    @classmethod
    def provided(cls, cfg: Options, found: Hosts) -> Local:
        """See `AgentKind`: every host must be this machine."""
        hosts = list(found.hostnames)
        if not all(is_local(h) for h in hosts):
            raise ValueError(
                f"the allocation provider {found.provider!r} found hosts {hosts} and asks for "
                "local agents, but not all of them are this machine"
            )
        return cls()

    def address(self, hostnames: Sequence[str]) -> Address:
        """See `AgentKind`: loopback."""
        return loopback()

    def start(self, order: StartOrder) -> AgentStart:
        """See `AgentKind`: each agent's place goes in front of its command line."""
        env = agent_env(order.cfg, os.environ, order.control)
        agent = order.command.agent()
        starter = LocalAgents(list(order.hostnames), order.log_dir.path, command=agent)
        per_agent = [local_agent_env(rank, host) for rank, host in enumerate(order.hostnames)]
        commands = tuple((*(f"{k}={v}" for k, v in extra.items()), *agent) for extra in per_agent)
        return AgentStart(starter, env, commands, tuple(sorted({*env, *per_agent[0]})))

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        """See `AgentKind`: local agents see this machine's GPUs."""
        gpus = visible_gpu_count(env)
        if gpus > 0:
            return DryWorkers(gpus, [gpus] * len(hostnames), "one per GPU it sees")
        counts = [
            agent_auto_workers({**env, **local_agent_env(rank, host)}, host)
            for rank, host in enumerate(hostnames)
        ]
        if env_job_id(env) is None:
            return DryWorkers(gpus, counts, "no GPU: one per CPU the agent may use")
        return DryWorkers(gpus, counts, "no GPU: the job's tasks on the node, else 1")


@dataclass
class LocalAgents(HostAgents):
    """Agents as subprocesses of the launcher, one per (local) host entry.

    `command` runs each (`slurmrun.launcher.agents.containers.AgentCommand.agent`).
    """

    command: list[str] = field(default_factory=PLAIN.agent)

    def start(self, env: Mapping[str, str]) -> None:
        """See `AgentStarter`."""
        for rank, host in enumerate(self.hostnames):
            agent_env = {**env, **local_agent_env(rank, host)}
            log = self._open_log(rank)
            self.procs.append(
                subprocess.Popen(
                    self.command,
                    env=agent_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Own session: a Ctrl-C in the terminal reaches only the launcher, which then
                    # stops agents in order; and killpg() reaches every process an agent made.
                    start_new_session=True,
                )
            )

    def exit_codes(self) -> dict[int | None, int]:
        """See `AgentStarter`."""
        codes: dict[int | None, int] = {}
        for rank, proc in enumerate(self.procs):
            code = exited_unreaped(proc)  # reaped in stop(), after its group was killed
            if code is not None:
                codes[rank] = code
        return codes

    def stop(self, grace: float) -> None:
        """See `AgentStarter`."""
        deadline = time.monotonic() + grace
        try:
            for proc in self.procs:
                wait_or_kill_group(proc, deadline)
        finally:
            self._close_logs()
