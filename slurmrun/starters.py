"""How agent processes are started and stopped: local subprocesses, or one `srun` step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from slurmrun.logs import agent_log_path
from slurmrun.spawner import wait_readable

__all__ = ["AgentStarter", "LocalAgents", "SrunAgents", "agent_command"]


def agent_command() -> list[str]:
    """The command that runs an agent with the launcher's interpreter."""
    return [sys.executable, "-m", "slurmrun.agent_main"]


def package_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH that makes this very slurmrun importable, even from an uninstalled checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = environ.get("PYTHONPATH", "")
    return root if not rest else f"{root}{os.pathsep}{rest}"


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


def wait_exit(proc: subprocess.Popen[Any], timeout: float) -> None:
    """`proc.wait(timeout)` (without raising) that returns the moment the process exits.

    Popen.wait polls with sleeps of up to 50 ms; a pidfd wakes us at once (Linux 5.3+).
    """
    timeout = max(0.0, timeout)
    if proc.poll() is not None:
        return
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        return
    try:
        wait_readable([pidfd], timeout)  # with a thousand agents connected, it is past fd 1024
    finally:
        os.close(pidfd)
    proc.poll()


def _wait_or_kill_group(proc: subprocess.Popen[bytes], deadline: float) -> None:
    wait_exit(proc, deadline - time.monotonic())
    # The agent is the leader of its own session: this reaches its spawner and workers too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


@dataclass
class LocalAgents:
    """Agents as subprocesses of the launcher, one per (local) host entry."""

    hostnames: Sequence[str]
    log_dir: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def log_file(self, node_rank: int | None) -> str | None:
        """See `AgentStarter`."""
        if node_rank is None:
            return None
        return agent_log_path(self.log_dir, self.hostnames[node_rank])

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """See `AgentStarter`."""

    def start(self, env: Mapping[str, str]) -> None:
        """See `AgentStarter`."""
        for rank, host in enumerate(self.hostnames):
            agent_env = dict(env)
            agent_env.update(SLURMRUN_NODE_RANK=str(rank), SLURMRUN_HOSTNAME=host)
            log_path = self.log_file(rank)
            assert log_path is not None  # noqa: S101 - rank is not None here
            log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    agent_command(),
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
            code = proc.poll()
            if code is not None:
                codes[rank] = code
        return codes

    def stop(self, grace: float) -> None:
        """See `AgentStarter`."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            _wait_or_kill_group(proc, deadline)
        for log in self._logs:
            log.close()


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
        if self.proc is not None and self.proc.poll() is None:
            wait_exit(self.proc, grace)
            if self.proc.poll() is None:
                # srun forwards SIGTERM to the step's tasks and ends the step. A task on a lost
                # node keeps srun waiting (up to KillWait and longer): then kill srun and
                # cancel the step, which slurmctld ends even on a node it cannot reach.
                self.proc.send_signal(signal.SIGTERM)
                wait_exit(self.proc, SRUN_TERM_WAIT)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5.0)
                self._cancel_step()
        if self._log is not None:
            self._log.close()
