"""What time alone reveals about a pool's agents: a process that exited, an agent gone silent.

`slurmrun.launcher.pool.AgentPool` asks on every tick of its loop; the verdicts are
`AgentFailedError`s that name the agent, its log and what srun said.
"""

from __future__ import annotations

import fcntl
import logging
import math
import re
import struct
import termios
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from slurmrun import protocol
from slurmrun.errors import AgentFailedError
from slurmrun.events import StepEnding, Trace
from slurmrun.launcher.agents.starters import AgentStarter
from slurmrun.launcher.failures import agent_exit_error
from slurmrun.logs import tail_file
from slurmrun.transport import Connection

__all__ = ["DRAIN_TIMEOUT", "AgentHealth", "StepEndings", "Watched"]

# After an agent's process exits, how long its connection may take to deliver what it sent.
DRAIN_TIMEOUT = 2.0
log = logging.getLogger("slurmrun")
_SRUN_TASK_EXIT = re.compile(r"srun: error: (\S+): task \d+: Exited with exit code (\d+)")


class Watched(Protocol):
    """What the health checks read of one connected agent."""

    node_rank: int
    hostname: str
    conn: Connection
    closed: bool  # its connection ended


@dataclass
class AgentHealth:
    """Judges agents' processes and heartbeats; raises `AgentFailedError` for a failed one.

    Args:
        hostnames: one agent per entry, in node-rank order.
        starter: the agents' processes (exit codes, log files).
        silence: seconds without a frame after which an agent counts as dead.
        heard_at: when a connection last delivered a whole frame.
    """

    hostnames: Sequence[str]
    starter: AgentStarter
    silence: float
    heard_at: Callable[[Connection], float]
    dead: set[int] = field(default_factory=set)  # node ranks declared dead: not waited for
    _exited_at: dict[int | None, float] = field(default_factory=dict)
    _next_silence_check: float = 0.0
    _looked_at: float | None = None  # the last check_silence call
    _grace_from: float = -math.inf  # silence counts from here at the earliest

    def exit_error(
        self, agents: Mapping[int, Watched], node_rank: int | None, why: str
    ) -> AgentFailedError:
        """The error for an agent (None: the srun step) that ended too early."""
        hostname = ""
        if node_rank is not None:
            agent = agents.get(node_rank)
            hostname = agent.hostname if agent else self.hostnames[node_rank]
        return agent_exit_error(self.starter, node_rank, hostname, why)

    def check_processes(self, agents: Mapping[int, Watched], now: float, *, running: bool) -> None:
        """Turns agent process exits into errors once their connections had time to drain."""
        for node_rank in self.starter.exit_codes():
            first_seen = self._exited_at.setdefault(node_rank, now)
            if node_rank is None:
                live = [a for a in agents.values() if not a.closed]
                if not live and len(agents) < len(self.hostnames):
                    # srun ended before every agent connected (e.g. it could not create the
                    # step, or an agent gave up reaching us): name the agent that ended first
                    raise self.exit_error(agents, self._first_failed(), "the srun step ended early")
                if live and (not running or now - first_seen > DRAIN_TIMEOUT):
                    raise self.exit_error(agents, live[0].node_rank, "the srun step ended early")
                continue
            agent = agents.get(node_rank)
            drained = agent is not None and (agent.closed or now - first_seen <= DRAIN_TIMEOUT)
            if not running or not drained:
                raise self.exit_error(agents, node_rank, "it ended before its workers did")

    def _first_failed(self) -> int | None:
        """The node rank of the first task srun saw fail on its own (not from its SIGTERM)."""
        step_log = self.starter.log_file(None)
        for host, code in _SRUN_TASK_EXIT.findall(tail_file(step_log, 100)):
            if host in self.hostnames and int(code) != 128 + 15:
                return self.hostnames.index(host)
        return None

    def check_silence(self, agents: Mapping[int, Watched], now: float) -> None:
        """Raises for an agent that sent nothing (not even a heartbeat) for `silence` s.

        It looks at most every `silence` / 10 s (and at least every second): each look goes
        over every agent, and a run calls it every tick.

        Silence the launcher did not read is not the agent's: bytes waiting unread in its
        socket count as heard, and after a gap in the launcher's own looks (it was stopped:
        Ctrl-Z, SIGSTOP, a background job's SIGTTIN; or not scheduled) every agent gets a
        fresh `silence` s, as if it had just been heard.
        """
        if self._looked_at is not None and now - self._looked_at > self.silence / 2:
            self._grace_from = now
        self._looked_at = now
        if now < self._next_silence_check:
            return
        self._next_silence_check = now + min(1.0, self.silence / 10)
        for agent in agents.values():
            if agent.closed or agent.conn.receiving:
                continue
            heard = max(self.heard_at(agent.conn), self._grace_from)
            if now - heard > self.silence and not _unread(agent.conn):
                self.dead.add(agent.node_rank)
                raise AgentFailedError(
                    f"the agent on {agent.hostname} sent nothing for {self.silence:g} s "
                    "(no heartbeat): its node may be hung or unreachable. Its log: "
                    f"{self.starter.log_file(agent.node_rank)}",
                    hostname=agent.hostname,
                    log_file=self.starter.log_file(agent.node_rank),
                    node_rank=agent.node_rank,  # two agents of one host: told apart by place
                )


def _unread(conn: Connection) -> bool:
    """Whether bytes that the agent sent wait in `conn`'s socket, not read yet."""
    try:
        count = fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, bytes(4))
    except (OSError, ValueError):  # closed meanwhile: its end is judged elsewhere
        return False
    return bool(struct.unpack("i", count)[0])


@dataclass
class StepEndings:
    """The agents that said SLURM is ending their step (TERMINATING).

    Their workers got SLURM's SIGTERM too, and may take until SLURM's kill to exit (to
    checkpoint): the run goes on to its end (their last output and errors still count), waits
    for them that long, and the pool then takes no other run.
    """

    hosts: set[str] = field(default_factory=set)
    _ranks: set[int] = field(default_factory=set)

    def note(self, agent: Watched, trace: Trace | None) -> None:
        """`agent` said SLURM is ending its step."""
        if agent.node_rank in self._ranks:
            return
        if not self._ranks:  # once per pool: a job of 4096 nodes would say it 4096 times
            log.warning(
                "slurmrun: SLURM is ending the step on %s (SIGTERM); its workers got the signal "
                "too, and are given until SLURM's kill to exit (at most %g s)",
                agent.hostname,
                protocol.SLURM_TERM_WAIT,
            )
        self._ranks.add(agent.node_rank)
        self.hosts.add(agent.hostname)
        if trace is not None:
            trace.emit(StepEnding(host=agent.hostname, node_rank=agent.node_rank))

    def ending(self, agent: Watched) -> bool:
        """Whether SLURM is ending `agent`'s step."""
        return agent.node_rank in self._ranks

    def stop_wait(self, grace: float) -> float:
        """How long agents may take to stop their workers: `grace`, or SLURM's time."""
        return max(grace, protocol.SLURM_TERM_WAIT) if self._ranks else grace
