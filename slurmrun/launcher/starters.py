"""How agent processes are started and stopped: local subprocesses, or one `srun` step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from slurmrun.launcher.containers import PLAIN
from slurmrun.logs import agent_log_path, host_labels
from slurmrun.variables import HOSTNAME_VAR, NODE_RANK_VAR
from slurmrun.waiting import wait_readable

__all__ = [
    "AgentStarter",
    "HostAgents",
    "LocalAgents",
    "SrunAgents",
    "local_agent_env",
]


def package_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH that makes this very slurmrun importable, even from an uninstalled checkout."""
    # The directory that holds the slurmrun package (this file is slurmrun/launcher/starters.py).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _exited_unreaped(proc: subprocess.Popen[Any]) -> int | None:
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
    if _exited_unreaped(proc) is not None:
        return
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while _exited_unreaped(proc) is None and time.monotonic() < deadline:
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


def _wait_or_kill_group(proc: subprocess.Popen[bytes], deadline: float) -> None:
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


@dataclass
class LocalAgents(HostAgents):
    """Agents as subprocesses of the launcher, one per (local) host entry.

    `command` runs each (`slurmrun.launcher.containers.AgentCommand.agent`).
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
            code = _exited_unreaped(proc)  # reaped in stop(), after its group was killed
            if code is not None:
                codes[rank] = code
        return codes

    def stop(self, grace: float) -> None:
        """See `AgentStarter`."""
        deadline = time.monotonic() + grace
        try:
            for proc in self.procs:
                _wait_or_kill_group(proc, deadline)
        finally:
            self._close_logs()


SRUN_TERM_WAIT = 2.0


@dataclass
class SrunAgents:
    """All agents as one SLURM job step, started with the `srun` command line `command`."""

    command: list[str]
    log_path: str
    node_logs: Mapping[str, str]
    hostnames: Sequence[str]
    proc: subprocess.Popen[bytes] | None = None
    step: str | None = None  # "<job id>.<step id>", once an agent said
    _log: IO[bytes] | None = None

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """See `AgentStarter`."""
        job, step = hello.get("slurm_job"), hello.get("slurm_step")
        if job and step:
            self.step = f"{job}.{step}"

    def log_file(self, node_rank: int | None) -> str | None:
        """See `AgentStarter`."""
        if node_rank is None:
            return self.log_path
        return self.node_logs.get(self.hostnames[node_rank], self.log_path)

    def start(self, env: Mapping[str, str]) -> None:
        """See `AgentStarter`."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(
                self.command,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            raise RuntimeError(f"could not run srun ({e}); is SLURM's client installed?") from e

    def _cancel_step(self) -> None:
        if self.step is None:
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", self.step], capture_output=True, timeout=10.0, check=False)

    def exit_codes(self) -> dict[int | None, int]:
        """See `AgentStarter`."""
        if self.proc is None or self.proc.poll() is None:
            return {}
        return {None: self.proc.returncode}

    def stop(self, grace: float) -> None:
        """See `AgentStarter`."""
        killed = True  # unless srun is seen to end by itself: then the step ended with it
        try:
            if self.proc is not None and self.proc.poll() is None:
                wait_exit(self.proc, grace)
                if self.proc.poll() is None:
                    # srun forwards SIGTERM to the step's tasks and ends the step. A task on a
                    # lost node keeps srun waiting (up to KillWait and longer): then kill srun
                    # and cancel the step, which slurmctld ends even on a node it cannot reach.
                    self.proc.send_signal(signal.SIGTERM)
                    wait_exit(self.proc, SRUN_TERM_WAIT)
                if self.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)  # not reaped: still its group
                    wait_exit(self.proc, 5.0)
                else:
                    killed = False
            else:
                killed = False
        finally:
            try:
                if killed:  # also when anything above raised (a Ctrl-C while we wait)
                    self._cancel_step()
            finally:
                if self._log is not None:
                    self._log.close()
