"""What every way of starting agents shares at run time: the `AgentStarter` protocol, processes.

Each kind of agents (`slurmrun.launcher.agents`) has its starter: local subprocesses
(`local.LocalAgents`), one ssh per host (`ssh.SshAgents`), one srun step
(`srun_step.SrunAgents`). The pool, its health checks and its closing know them only as
`AgentStarter`s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from slurmrun.launcher.agents.containers import slurmrun_root
from slurmrun.logs import agent_log_path, host_labels
from slurmrun.variables import HOSTNAME_VAR, NODE_RANK_VAR
from slurmrun.waiting import wait_readable

__all__ = [
    "AgentStarter",
    "HostAgents",
    "exited_unreaped",
    "local_agent_env",
    "package_pythonpath",
    "wait_exit",
    "wait_or_kill_group",
]


def package_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH that makes this very slurmrun importable, even from an uninstalled checkout."""
    root = slurmrun_root()
    rest = environ.get("PYTHONPATH", "")
    return root if not rest else f"{root}{os.pathsep}{rest}"


def local_agent_env(rank: int, host: str) -> dict[str, str]:
    """What a local agent gets on top of the launch's environment: which agent it is."""
    return {NODE_RANK_VAR: str(rank), HOSTNAME_VAR: host}


class AgentStarter(Protocol):
    """Starts the agents of one launch and makes sure none survive it."""

    def start(self, env: Mapping[str, str]) -> None:
        """Starts every agent with `env` as its environment."""

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """Learns what an agent said of itself when it connected (e.g. its SLURM step)."""

    def exit_codes(self) -> dict[int | None, int]:
        """Agents that have exited: node rank (None: all of them, e.g. srun) to exit code."""

    def log_file(self, node_rank: int | None) -> str | None:
        """Where an agent's own output (or srun's) goes."""

    def stop(self, grace: float) -> None:
        """Waits up to `grace` seconds for agents to exit, then kills whatever is left."""


def exited_unreaped(proc: subprocess.Popen[Any]) -> int | None:
    """`proc`'s exit code if it has exited, else None, leaving it unreaped (a zombie)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # someone reaped it behind Popen's back
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _wait_unreaped(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Waits up to `timeout` seconds for `proc` to exit, without reaping it.

    A pidfd wakes us the moment it exits (Linux 5.3+); Popen.wait would poll with sleeps of
    up to 50 ms, and reap.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    if exited_unreaped(proc) is not None:
        return
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while exited_unreaped(proc) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return
    try:
        # poll(), not select(): with a thousand agents connected, it is past fd 1024
        wait_readable([pidfd], deadline - time.monotonic())
    finally:
        os.close(pidfd)


def wait_exit(proc: subprocess.Popen[Any], timeout: float) -> None:
    """`proc.wait(timeout)` (without raising) that returns the moment the process exits."""
    _wait_unreaped(proc, timeout)
    proc.poll()


def wait_or_kill_group(proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Waits for an agent until `deadline`, then kills whatever is left of its process group.

    The agent leads its own session, so its group holds its spawner and workers, which may
    outlive it. The group id is the agent's pid, so killpg() must never run once the agent
    was reaped: with no member left, the pid could belong to someone else by then. Nothing
    here reaps it before the kill (`exit_codes` looks without reaping either), and an exited,
    unreaped agent is a zombie that keeps its pid, and with it the group id, to itself.
    """
    _wait_unreaped(proc, deadline - time.monotonic())
    if proc.returncode is None:  # not reaped: its pid is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    wait_exit(proc, 5.0)


@dataclass
class HostAgents:
    """One agent process per host entry, each writing into a log file of its own.

    What local and ssh agents share; each opens its hosts' logs in ``start`` (`_open_log`)
    and closes them at the end of ``stop`` (`_close_logs`).
    """

    hostnames: Sequence[str]
    log_dir: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def log_file(self, node_rank: int | None) -> str | None:
        """See `AgentStarter`."""
        if node_rank is None:
            return None
        return agent_log_path(self.log_dir, host_labels(self.hostnames)[node_rank])

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """See `AgentStarter`."""

    def _open_log(self, node_rank: int) -> IO[bytes]:
        path = self.log_file(node_rank)
        assert path is not None  # noqa: S101 - a node rank always has one
        log = open(path, "ab")  # noqa: SIM115 - closed by _close_logs, at the end of stop()
        self._logs.append(log)
        return log

    def _close_logs(self) -> None:
        for log in self._logs:
            log.close()
