"""The launcher's agents, connected once and kept: started, watched, closed.

A pool lives as long as a warm launcher (`Launcher` used as a context manager), or one call
of a cold one; each run (`slurmrun.launcher.run.Run`) borrows its agents. The pool reads every
event (`slurmrun.launcher.pump`) and routes it: what concerns agents whatever the run (hello,
heartbeats, SLURM ending a step, an agent ready again, a connection that ended) is its own;
a message of the run in progress goes to the run; a message of any other run (a process a
finished run left behind, a run cut short by Ctrl-C) is dropped and counted. Once an agent
failed, the pool is `PoolState.BROKEN`: the launcher closes it, and the next run starts new
agents.

Threads only move bytes (`slurmrun.launcher.listener`): every decision is taken by the calling
thread, in `slurmrun.launcher.pump.pump`. Closing the agents is `slurmrun.launcher.closing`'s.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from slurmrun import protocol
from slurmrun.errors import AgentFailedError, VersionMismatchError
from slurmrun.events import AgentConnected, Trace
from slurmrun.launcher.agents.starters import AgentStarter
from slurmrun.launcher.closing import close_agents
from slurmrun.launcher.health import AgentHealth, StepEndings
from slurmrun.launcher.listener import Listener
from slurmrun.launcher.output_stage import Credits, output_window
from slurmrun.launcher.pump import Closed, Event, Local, Received, all_of, drain, pump
from slurmrun.launcher.share import PoolAgent
from slurmrun.logs import UNSHARED_LOG_DIR_ADVICE, LogDir
from slurmrun.transport import Connection, Frame
from slurmrun.versions import mismatch

__all__ = ["AgentPool", "PoolBroken", "PoolState", "RunOwner"]

# Beyond the workers' grace period: how long agents may take to say IDLE after END.
IDLE_WAIT = 5.0
NAMED_HOSTS = 4  # the hosts a line of the launcher names; more are "..."
# Seconds agents may take to connect before the launcher says it is waiting for them.
STARTING_NOTE = 1.0
log = logging.getLogger("slurmrun")


class PoolState(enum.Enum):
    """Where a pool is in its life.

    NEW -> OPENING (agents start and connect) -> READY <-> RUNNING (a run holds the agents);
    any state -> BROKEN (an agent failed: the pool takes no other run) -> CLOSED.
    """

    NEW = "new"
    OPENING = "opening"
    READY = "ready"
    RUNNING = "running"
    BROKEN = "broken"
    CLOSED = "closed"


class PoolBroken(AgentFailedError):
    """The pool's agents cannot take another run (it broke earlier, or was closed)."""


class RunOwner(Protocol):
    """What a run takes from the pool's loop (`slurmrun.launcher.run.Run`)."""

    id: int
    ending: bool  # END was sent: only output still counts, nothing is judged

    def on_message(
        self, agent: PoolAgent, message: protocol.Message, frame: Frame, now: float
    ) -> None:
        """A message of this run from `agent`."""

    def on_streamed(self, conn: Connection, message: protocol.Result, frame: Frame) -> None:
        """A result of this run that came over a connection of its own."""

    def on_closed(self, agent: PoolAgent, why: str) -> None:
        """`agent`'s connection ended during the run."""

    def on_tick(self, now: float) -> None:
        """What time alone reveals about the run (also once it is ending)."""

    def on_local(self, event: Local, now: float) -> None:
        """A request of this process for the run (stacks, a line typed for a debugger)."""


def some_hosts(hostnames: Sequence[str]) -> str:
    """``2 hosts (node1, node2)``: how many distinct hosts, and the first `NAMED_HOSTS`."""
    hosts = list(dict.fromkeys(hostnames))
    names = ", ".join(hosts[:NAMED_HOSTS]) + (", ..." if len(hosts) > NAMED_HOSTS else "")
    return f"{len(hosts)} host{'s' * (len(hosts) != 1)} ({names})"


@dataclass
class AgentPool:
    """The agents of a launcher: `open` starts and connects them, `close` ends them.

    Args:
        hostnames: one agent per entry, in node-rank order.
        starter: starts the agent processes (local subprocesses, or one srun step).
        server: the listening socket; the pool closes it.
        secret: what every connection must prove.
        connect_timeout: seconds for every agent to connect.
        silence: seconds without a frame after which an agent counts as dead.
        log_dir: where agents and workers write logs; removed on close unless kept.
    """

    hostnames: Sequence[str]
    starter: AgentStarter
    server: socket.socket
    secret: bytes
    connect_timeout: float
    silence: float
    log_dir: LogDir | None = None
    agents: dict[int, PoolAgent] = field(default_factory=dict)
    state: PoolState = PoolState.NEW
    broken: str | None = None  # why its agents cannot take another run
    trace: Trace | None = None  # the current launch's events (set by the launcher)
    run: RunOwner | None = None  # the run in progress
    dropped: int = 0  # messages of other runs than the one in progress
    # Given a line while agents take over `STARTING_NOTE` s to connect (None: silent).
    starting_note: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.listener = Listener(self.server, self.secret, self.silence)
        self.credits = Credits(output_window(len(self.hostnames)))  # for the agents' output
        self.events = self.listener.events
        self.health = AgentHealth(
            self.hostnames, self.starter, self.silence, self.listener.heard_at
        )
        self._by_conn: dict[int, PoolAgent] = {}
        self.endings = StepEndings()  # agents whose step SLURM is ending
        self.last_run = 0
        self.router = Router(self)  # what `pump` hands the loop's events to

    # ------------------------------------------------------------------ life
    def open(self, env: Mapping[str, str]) -> None:
        """Starts the agents and waits until every one said hello.

        Raises:
            AgentFailedError: an agent failed to start, exited, or did not connect in time.
        """
        self.state = PoolState.OPENING
        self.listener.start()
        self.starter.start(env)
        started = time.monotonic()
        deadline = started + self.connect_timeout
        connected = lambda: len(self.agents) == len(self.hostnames)  # noqa: E731
        early = pump(self.events, self.router, connected, min(deadline, started + STARTING_NOTE))
        if not early and self.starting_note is not None:
            self.starting_note(self._starting_line())
        if not early and not pump(self.events, self.router, connected, deadline):
            missing = [i for i in range(len(self.hostnames)) if i not in self.agents]
            raise AgentFailedError(
                f"agents on {[self.hostnames[i] for i in missing]} did not connect within "
                f"timeout={self.connect_timeout:.0f} s. Their output: "
                f"{self.starter.log_file(None) or self.starter.log_file(0)}",
                hostname=self.hostnames[missing[0]],
                node_rank=missing[0],
            )
        self.state = PoolState.READY

    def _starting_line(self) -> str:
        """What the launcher says while agents are slow to connect (srun queued, ssh, images)."""
        return (
            f"slurmrun: starting agents on {some_hosts(self.hostnames)}: "
            f"{len(self.agents)} of {len(self.hostnames)} connected, waiting up to "
            f"{self.connect_timeout:.0f} s (--timeout)"
        )

    def close(self, grace: float = 3.0) -> None:
        """Tells every live agent to exit, waits for them (bounded), then kills what is left.

        Agents stop their workers first (SIGTERM, `grace`, SIGKILL). Agents declared dead, or
        lost with their node, are not waited for.
        """
        opened = self.state is not PoolState.NEW
        self.breaks("closed")
        self.state = PoolState.CLOSED
        self.run = None
        try:
            if opened:
                close_agents(self, grace)
        finally:
            with contextlib.suppress(OSError):
                self.server.close()
            if self.log_dir is not None and not self.log_dir.keep:
                shutil.rmtree(self.log_dir.path, ignore_errors=True)

    def ready(self, grace: float = 3.0) -> None:
        """Before a run: takes in what happened since the last one, and checks every agent.

        Agents still ending an earlier run (one cut short by Ctrl-C) are waited for, bounded.

        Raises:
            PoolBroken: the pool broke earlier, or agents did not end an earlier run in time.
            AgentFailedError: an agent exited, closed its connection or went silent while idle.
        """
        self._check_usable()
        drain(self.events, self.router)
        busy = [a for a in self.agents.values() if a.run is not None]
        if busy:
            deadline = time.monotonic() + self.endings.stop_wait(grace) + IDLE_WAIT
            ended = all_of(busy, lambda agent: agent.run is None)
            if not pump(self.events, self.router, ended, deadline):
                late = sorted(a.hostname for a in busy if a.run is not None)
                self.breaks(f"the agents on {late} did not end an earlier run in time")
        self._end_of_run()
        self._check_usable()
        now = time.monotonic()
        self.health.check_processes(self.agents, now, running=False)
        self.health.check_silence(self.agents, now)

    def _check_usable(self) -> None:
        if self.state in {PoolState.BROKEN, PoolState.CLOSED}:
            raise PoolBroken(f"the launcher's agents cannot run again ({self.broken})")

    def begin(self, run: RunOwner) -> int:
        """`run` holds the agents from now on; returns its id (new for every run)."""
        self.last_run += 1
        run.id = self.last_run
        self.run = run
        if self.state is PoolState.READY:
            self.state = PoolState.RUNNING
        return run.id

    def finish(self, run: RunOwner) -> None:
        """`run` is over (its agents may still be ending it: `ready` waits for them)."""
        if self.run is run:
            self.run = None
        self._end_of_run()
        if self.state is PoolState.RUNNING:
            self.state = PoolState.READY
        if self.dropped:
            log.debug("slurmrun: %d message(s) of other runs dropped so far", self.dropped)

    def _end_of_run(self) -> None:
        """After a run: agents whose step SLURM is ending cannot take another (broken)."""
        if self.endings.hosts:
            self.breaks(f"SLURM is ending the step of the agents on {sorted(self.endings.hosts)}")

    def breaks(self, why: str) -> None:
        """Marks the pool broken (the first reason is kept): it takes no other run."""
        self.broken = self.broken or why
        if self.state is not PoolState.CLOSED:
            self.state = PoolState.BROKEN

    @property
    def dead(self) -> set[int]:
        """Node ranks of agents declared dead (silent): not waited for."""
        return self.health.dead

    def agent_of(self, conn: Connection) -> PoolAgent | None:
        """The agent whose control connection `conn` is (None: a streamed result, or new)."""
        return self._by_conn.get(id(conn))

    def exit_error(self, node_rank: int, why: str) -> AgentFailedError:
        """The error for an agent that ended too early (the pool is broken)."""
        self.breaks(why)
        return self.health.exit_error(self.agents, node_rank, why)

    def on_hello(self, conn: Connection, hello: protocol.Hello) -> None:
        """Takes in a new agent (or raises for a connection that is not one)."""
        agent = _admit(self, conn, hello)
        self._by_conn[id(conn)] = agent
        if hello.unseen_mark:
            folder = os.path.dirname(hello.unseen_mark)
            raise AgentFailedError(
                f"the agent on {agent.hostname} could not start: {agent.hostname} cannot see "
                f"the log directory {folder} (the file {hello.unseen_mark} that the launcher "
                f"wrote there is not there), so its log file "
                f"{self.starter.log_file(agent.node_rank)} and its workers' would be where the "
                f"launcher never reads them: {UNSHARED_LOG_DIR_ADVICE}",
                hostname=agent.hostname,
                node_rank=agent.node_rank,
            )
        if hello.error:
            raise AgentFailedError(
                f"the agent on {agent.hostname} could not prepare its workers: {hello.error}",
                hostname=agent.hostname,
                log_file=self.starter.log_file(agent.node_rank),
                node_rank=agent.node_rank,
            )

    # ------------------------------------------------------------------ sending
    def send(self, agent: PoolAgent, header: dict[str, Any], body: bytes = b"") -> None:
        """Sends one message to `agent`; a failure breaks the pool and raises."""
        try:
            agent.conn.send(header, body)
        except OSError as e:
            self.breaks(f"could not reach the agent on {agent.hostname}")
            raise AgentFailedError(
                f"could not send to the agent on {agent.hostname}: {e}",
                hostname=agent.hostname,
                log_file=self.starter.log_file(agent.node_rank),
                node_rank=agent.node_rank,
            ) from e


# What an agent says about itself, whatever the run (a heartbeat needs nothing: it was heard).
_AGENT_KINDS = frozenset({protocol.Heartbeat, protocol.Terminating, protocol.Idle, protocol.Hello})


class Router:
    """What each event of the pool's loop means: the pool's own, the run's, or dropped.

    Hello, heartbeats, SLURM ending a step, an agent idle again and connections that end are
    the pool's; a message of the run in progress goes to the run; a message of any other run
    (a process a finished run left behind, a run cut short by Ctrl-C) is dropped and counted.
    """

    def __init__(self, pool: AgentPool) -> None:
        self.pool = pool

    def on_event(self, event: Event, now: float) -> None:
        """Routes one event: the pool's own, the run's, or another run's (dropped)."""
        if isinstance(event, Local):
            if self.pool.run is not None:
                self.pool.run.on_local(event, now)
            else:
                event.unowned()
            return
        agent = self.pool.agent_of(event.conn)
        if isinstance(event, Closed):
            if agent is not None:
                self._on_closed(agent, event.why)
            return
        message = self._parse(agent, event)
        if message is None:
            return
        run = self.pool.run
        if agent is None:
            self._on_stranger(event.conn, message, event.frame)
        elif type(message) in _AGENT_KINDS:
            self._on_agents_own(agent, message)
        elif run is not None and getattr(message, "run", None) == run.id:
            run.on_message(agent, message, event.frame, now)
        else:
            self.pool.dropped += 1
            if isinstance(message, protocol.Log):  # taken all the same: the agent may send more
                cost = protocol.log_cost(len(event.frame.body))
                self.pool.credits.give(event.conn, message.run, cost, at_once=True)

    def _on_agents_own(self, agent: PoolAgent, message: protocol.Message) -> None:
        """A message about the agent itself, whatever the run."""
        if isinstance(message, protocol.Terminating):
            self.pool.endings.note(agent, self.pool.trace)
        elif isinstance(message, protocol.Idle):
            self._on_idle(agent, message)
        elif isinstance(message, protocol.Hello):
            raise self.pool.exit_error(agent.node_rank, "it said hello twice")

    def on_tick(self, now: float) -> None:
        """Judges agents (and the run's own clock)."""
        if self.pool.run is not None and self.pool.run.ending:
            self.pool.run.on_tick(now)  # the outcome stands: it judges nothing now
            return  # `Run._end`'s wait is bounded
        self.pool.health.check_processes(self.pool.agents, now, running=self.pool.run is not None)
        if self.pool.state is not PoolState.OPENING:
            self.pool.health.check_silence(self.pool.agents, now)
        if self.pool.run is not None:
            self.pool.run.on_tick(now)

    def _parse(self, agent: PoolAgent | None, event: Received) -> protocol.Message | None:
        header = event.frame.header
        if agent is None and header.get("t") == protocol.Hello.kind:
            other = mismatch(header)  # before parsing: another version's hello may not parse
            if other is not None:
                event.conn.close()
                self.pool.breaks("an agent runs another slurmrun")
                raise VersionMismatchError(other, hostname=str(header.get("hostname", "")))
        try:
            return protocol.parse(header)
        except protocol.ProtocolError as e:
            event.conn.close()
            if agent is None:
                return None
            why = f"it sent a message the launcher does not know ({e})"
            raise self.pool.exit_error(agent.node_rank, why) from e

    def _on_stranger(self, conn: Connection, message: protocol.Message, frame: Frame) -> None:
        """A message on a connection that is no agent's (yet)."""
        if isinstance(message, protocol.Hello) and self.pool.state is PoolState.OPENING:
            self.pool.on_hello(conn, message)
        elif (
            isinstance(message, protocol.Result)
            and self.pool.run
            and message.run == self.pool.run.id
        ):
            self.pool.run.on_streamed(conn, message, frame)
        elif isinstance(message, protocol.Result) and not 0 < message.run < self.pool.last_run:
            conn.close()  # no run of ours: forged, never unpickled
            raise AgentFailedError(
                f"a result arrived for an unknown or finished worker (node rank "
                f"{message.node_rank!r}, local rank {message.local_rank!r})"
            )
        elif self.pool.state is PoolState.OPENING:
            conn.close()
            raise AgentFailedError(f"an agent sent {message.kind!r} before hello")
        else:
            conn.close()  # a streamed result of another run, or an agent too late to count
            self.pool.dropped += 1

    def _on_idle(self, agent: PoolAgent, idle: protocol.Idle) -> None:
        if agent.run == idle.run:
            agent.run = None
            agent.master_port = idle.master_port

    def _on_closed(self, agent: PoolAgent, why: str) -> None:
        agent.closed = True
        self.pool.breaks(f"the agent on {agent.hostname} closed its connection")
        if self.pool.state is PoolState.CLOSED:
            return
        if self.pool.run is not None:
            self.pool.run.on_closed(agent, why)
            return
        time.sleep(0.2)  # give the exit code a moment to appear, for the message
        detail = f" ({why})" if why else ""
        why = f"it closed its connection before its work was done{detail}"
        raise self.pool.exit_error(agent.node_rank, why)


def _admit(pool: AgentPool, conn: Connection, hello: protocol.Hello) -> PoolAgent:
    """The agent that said `hello`, now one of `pool`'s (raises for one that is not ours)."""
    rank = _rank_of(hello, pool.hostnames)
    if rank < 0 or rank in pool.agents:
        conn.close()
        raise AgentFailedError(
            f"an agent on {hello.hostname!r} connected, but it is not one of the expected "
            f"hosts {list(pool.hostnames)} (or its host connected twice)",
            hostname=hello.hostname,
        )
    agent = PoolAgent(rank, pool.hostnames[rank], conn, hello, hello.master_port)
    pool.starter.agent_hello(rank, hello.header())
    pool.agents[rank] = agent
    pool.listener.add_agent(conn)
    if pool.trace is not None:
        seconds = pool.trace.seconds()
        pool.trace.emit(AgentConnected(host=agent.hostname, node_rank=rank, seconds=seconds))
    return agent


def _rank_of(hello: protocol.Hello, hostnames: Sequence[str]) -> int:
    """The node rank of the agent that said `hello` (-1: none of ours)."""
    rank = hello.node_rank
    if rank < 0:
        # Agents of an srun step are known by their node name.
        candidates = [i for i, h in enumerate(hostnames) if h == hello.hostname]
        rank = candidates[0] if len(candidates) == 1 else -1
    return rank if rank < len(hostnames) else -1
