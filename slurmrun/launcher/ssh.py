"""Agents on hosts outside SLURM, started over ssh: one ``ssh HOST python -m ...`` per host.

The ``ssh`` binary, not a Python library: it reads the user's ``~/.ssh/config`` (or the
``ssh_config_file`` given), agent forwarding, ProxyJump, Kerberos and known hosts exactly as
the user's own ``ssh`` does, and its process is ours to wait for and kill like any
subprocess; a library would reimplement all of that and add a dependency.

The launch secret goes to the agent through ssh's stdin, never on a command line: the agent
(``SLURMRUN_SECRET_STDIN=1``) forks its worker spawner first and then reads it. The pipe
stays open for the agent's life: when it closes (the launcher exited, or the ssh connection
dropped) the agent sees end-of-file and stops its workers. The other variables travel on
the remote command line (``env NAME=VALUE ...``). The hosts must see this interpreter and
this slurmrun at the same paths (a shared filesystem, as for srun).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from slurmrun.launcher.starters import HostAgents, agent_command, local_agent_env, wait_exit
from slurmrun.protocol import SECRET_STDIN_VAR, SECRET_VAR

__all__ = ["SshAgents", "ssh_command", "ssh_hostname"]

# How long ssh may take to open a connection (a host that is down: no endless wait).
CONNECT_TIMEOUT = 10
# After the agents' stdin closed: how long they may take to stop their workers and exit.
EOF_WAIT = 5.0


def ssh_command(host: str, env: Mapping[str, str], config_file: str | None) -> list[str]:
    """The ssh command line that starts one agent on `host` with `env` (less the secret)."""
    variables = [f"{k}={v}" for k, v in sorted(env.items()) if k != SECRET_VAR]
    remote = shlex.join(["env", *variables, f"{SECRET_STDIN_VAR}=1", *agent_command()])
    options = ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
    options += ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    if config_file:
        options += ["-F", config_file]
    return ["ssh", *options, host, remote]


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


@dataclass
class SshAgents(HostAgents):
    """One agent per host, each the remote command of an ``ssh`` subprocess.

    Each host's log file (`log_file`) holds ssh's own messages too.
    """

    config_file: str | None = None

    def commands(self, env: Mapping[str, str]) -> list[list[str]]:
        """The ssh command line of each agent."""
        return [
            ssh_command(host, {**env, **local_agent_env(rank, host)}, self.config_file)
            for rank, host in enumerate(self.hostnames)
        ]

    def start(self, env: Mapping[str, str]) -> None:
        """See `slurmrun.launcher.starters.AgentStarter`."""
        secret = env[SECRET_VAR].encode("ascii") + b"\n"
        for rank, command in enumerate(self.commands(env)):
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
                proc.stdin.write(secret)
                proc.stdin.flush()

    def exit_codes(self) -> dict[int | None, int]:
        """See `AgentStarter` in `slurmrun.launcher.starters` (255: ssh could not connect)."""
        return {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}

    def stop(self, grace: float) -> None:
        """See `slurmrun.launcher.starters.AgentStarter`.

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
