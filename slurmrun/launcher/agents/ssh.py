"""Agents on hosts outside SLURM, started over ssh: one ``ssh HOST python -m ...`` per host.

The ``ssh`` binary, not a Python library: it reads the user's ``~/.ssh/config`` (or the
``ssh_config_file`` given), agent forwarding, ProxyJump, Kerberos and known hosts exactly as
the user's own ``ssh`` does, and its process is ours to wait for and kill like any
subprocess; a library would reimplement all of that and add a dependency.

The agent's variables and the launch secret go to the agent through ssh's stdin, never on a
command line (where every user of either host can read them, ``ps``): first the variables
(`stdin_block`), which the agent (``SLURMRUN_SECRET_STDIN=1``) puts in its environment before
anything else, then the secret, which it reads only after it forked its worker spawner. The
pipe stays open for the agent's life: when it closes (the launcher exited, or the ssh
connection dropped) the agent sees end-of-file and stops its workers. The command line holds
only the interpreter and where slurmrun is; the hosts must see both at the same paths (a
shared filesystem, as for srun).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from slurmrun.launcher.address import Address, routed
from slurmrun.launcher.agents.common import agent_env
from slurmrun.launcher.agents.containers import PLAIN, AgentCommand
from slurmrun.launcher.agents.kind import AgentKind, AgentStart, DryWorkers, StartOrder
from slurmrun.launcher.agents.starters import (
    HostAgents,
    local_agent_env,
    package_pythonpath,
    wait_exit,
)
from slurmrun.variables import SECRET_STDIN_VAR, SECRET_VAR

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.providers import Hosts

__all__ = ["Ssh", "SshAgents", "ssh_command", "ssh_hostname", "stdin_block"]

# How long ssh may take to open a connection (a host that is down: no endless wait).
CONNECT_TIMEOUT = 10
# After the agents' stdin closed: how long they may take to stop their workers and exit.
EOF_WAIT = 5.0


# The agent's start on its host: slurmrun is found at the path given (its PYTHONPATH comes
# later, on stdin), then `slurmrun.node.agent_main` runs as ``python -m`` would run it.
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from slurmrun.node import agent_main; agent_main.run()"
)


def ssh_command(host: str, config_file: str | None, command: AgentCommand = PLAIN) -> list[str]:
    """The ssh command line that starts one agent on `host` (its variables: `stdin_block`)."""
    root = package_pythonpath({})
    agent = command.argv("-c", _BOOTSTRAP, root)
    remote = shlex.join(["env", f"{SECRET_STDIN_VAR}=1", *agent])
    options = ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
    options += ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    if config_file:
        options += ["-F", config_file]
    return ["ssh", *options, host, remote]


def stdin_block(env: Mapping[str, str]) -> bytes:
    """`env` (less the secret) as the agent reads it first from stdin (`read_variables`)."""
    variables = json.dumps({k: v for k, v in sorted(env.items()) if k != SECRET_VAR}).encode()
    return b"%d\n%s" % (len(variables), variables)


def ssh_hostname(host: str, config_file: str | None) -> str:
    """The name ssh connects to for `host` (its config's ``HostName``), asked of ``ssh -G``."""
    command = ["ssh", "-G", *(["-F", config_file] if config_file else []), host]
    try:
        cp = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in cp.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    return host


@dataclass(frozen=True)
class Ssh(AgentKind):
    """Agents over ssh, one per host (`slurmrun.launcher.agents.kind.AgentKind`).

    Attributes:
        config_file: the ssh config file (`Launcher.ssh_config_file`); None: the user's.
    """

    name: ClassVar[str] = "ssh"
    shown: ClassVar[str] = "one ssh per host"
    env_on_stdin: ClassVar[bool] = True
    local_master: ClassVar[bool] = False
    writes_logs: ClassVar[bool] = False  # ssh writes each agent's output, its own messages too

    config_file: str | None = None

    @classmethod
    def provided(cls, cfg: Options, found: Hosts) -> Ssh:
        """See `AgentKind`."""
        return cls(cfg.ssh_config_file)

    def address(self, hostnames: Sequence[str]) -> Address:
        """See `AgentKind`: toward the first host (the name an ssh alias stands for)."""
        first = hostnames[0]
        return routed(first, ssh_hostname(first, self.config_file))

    def start(self, order: StartOrder) -> AgentStart:
        """See `AgentKind`: the variables go on stdin, their values shown by a dry run."""
        env = agent_env(order.cfg, os.environ, order.control)
        hostnames = list(order.hostnames)
        starter = SshAgents(
            hostnames, order.log_dir.path, config_file=self.config_file, command=order.command
        )
        names = sorted({*env, *local_agent_env(0, hostnames[0])} - {SECRET_VAR})
        return AgentStart(starter, env, tuple(map(tuple, starter.commands())), tuple(names))

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        """See `AgentKind`: each agent decides on its host, unknown here."""
        return DryWorkers(
            0, [0] * len(hostnames), "each agent decides on its host (0: unknown here)"
        )


@dataclass
class SshAgents(HostAgents):
    """One agent per host, each the remote command of an ``ssh`` subprocess.

    Each host's log file (`log_file`) holds ssh's own messages too.
    """

    config_file: str | None = None
    command: AgentCommand = PLAIN

    def commands(self) -> list[list[str]]:
        """The ssh command line of each agent (no variable: they go through stdin)."""
        return [ssh_command(host, self.config_file, self.command) for host in self.hostnames]

    def start(self, env: Mapping[str, str]) -> None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`."""
        secret = env[SECRET_VAR].encode("ascii") + b"\n"
        for rank, command in enumerate(self.commands()):
            variables = stdin_block({**env, **local_agent_env(rank, self.hostnames[rank])})
            log = self._open_log(rank)
            try:
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C reaches the launcher, which stops us
                )
            except FileNotFoundError as e:
                raise RuntimeError(f"could not run ssh ({e}); is openssh-client installed?") from e
            self.procs.append(proc)
            assert proc.stdin is not None  # noqa: S101 - stdin=PIPE
            with contextlib.suppress(BrokenPipeError):  # ssh failed at once: exit_codes says
                proc.stdin.write(variables + secret)
                proc.stdin.flush()

    def exit_codes(self) -> dict[int | None, int]:
        """See `slurmrun.launcher.agents.starters.AgentStarter` (255: ssh could not connect)."""
        return {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}

    def stop(self, grace: float) -> None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`.

        After `grace`, the agents' stdin is closed (they stop their workers and exit on
        end-of-file); ssh processes still running after that are killed, which drops their
        connections, and agents see the same end-of-file.
        """
        deadline = time.monotonic() + grace
        try:
            for proc in self.procs:
                wait_exit(proc, deadline - time.monotonic())
            for proc in self.procs:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            deadline = time.monotonic() + EOF_WAIT
            for proc in self.procs:
                wait_exit(proc, deadline - time.monotonic())
            for proc in self.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    wait_exit(proc, 5.0)
        finally:
            self._close_logs()
