"""The launcher's agents, connected once and kept: started, watched, closed.

A pool lives as long as a warm launcher (`Launcher` used as a context manager), or one call
of a cold one; each run (`slurmrun.launcher.session.Session`) borrows its agents. The pool
judges what concerns agents whatever the run: an agent process that exited, an agent silent
for longer than its heartbeat timeout, a connection that closed. Once such a failure was seen
the pool is `broken`: the launcher closes it, and the next run starts new agents.

Threads only move bytes (`slurmrun.launcher.listener`): every decision is taken by the calling
thread from the listener's single event queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun import protocol
from slurmrun.errors import AgentFailedError
from slurmrun.events import AgentConnected, StepEnding, Trace
from slurmrun.launcher.failures import agent_exit_error
from slurmrun.launcher.listener import Listener
from slurmrun.launcher.starters import AgentStarter
from slurmrun.logs import LogDir, tail_file
from slurmrun.transport import Connection, Frame

__all__ = ["AgentPool", "PoolAgent"]

# After an agent's process exits, how long its connection may take to deliver what it sent.
DRAIN_TIMEOUT = 2.0
# Once agents closed their connections, how long their processes (or srun) may take to exit.
STOP_WAIT = 1.0
TICK = 0.05
log = logging.getLogger("slurmrun")
_SRUN_TASK_EXIT = re.compile(r"srun: error: (\S+): task \d+: Exited with exit code (\d+)")


@dataclass
class PoolAgent:
    """One connected agent, as long as the pool lives."""

    node_rank: int
    hostname: str
    conn: Connection
    hello: protocol.Hello
    master_port: int  # for the next run's rank 0, if this agent hosts it
    closed: bool = False  # its connection ended


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
    broken: str | None = None  # why its agents cannot take another run
    trace: Trace | None = None  # the current launch's events (set by the launcher)

    def __post_init__(self) -> None:
        self.listener = Listener(self.server, self.secret, self.silence)
        self.events = self.listener.events
        self._by_conn: dict[int, PoolAgent] = {}
        self._exited_at: dict[int | None, float] = {}
        self._dead: set[int] = set()  # node ranks declared dead (no heartbeat): not waited for
        self._slurm_ending: set[int] = set()  # node ranks whose step SLURM is ending
        self._next_silence_check = 0.0
        self._opened = False

    # ------------------------------------------------------------------ life
    def open(self, env: Mapping[str, str]) -> None:
        """Starts the agents and waits until every one said hello.

        Raises:
            AgentFailedError: an agent failed to start, exited, or did not connect in time.
        """
        self._opened = True
        self.listener.start()
        self.starter.start(env)
        deadline = time.monotonic() + self.connect_timeout
        next_check = 0.0
        while len(self.agents) < len(self.hostnames):
            now = time.monotonic()
            if now >= next_check:
                if now > deadline:
                    missing = [h for i, h in enumerate(self.hostnames) if i not in self.agents]
                    raise AgentFailedError(
                        f"agents on {missing} did not connect within timeout="
                        f"{self.connect_timeout:.0f} s. Their output: "
                        f"{self.starter.log_file(None) or self.starter.log_file(0)}",
                        hostname=missing[0],
                    )
                self.check_processes(now, running=False)
                next_check = now + TICK
            try:
                kind, conn, data = self.events.get(timeout=max(0.0, next_check - now))
            except queue.Empty:
                continue
            if kind == "eof":
                self.on_eof(conn, data, running=False)
            elif self.agent_of(conn) is None:
                self.on_hello(conn, data)
        self.listener.idle = True  # until the first run (see Listener.idle)

    def close(self, grace: float = 3.0) -> None:
        """Tells every live agent to exit, waits for them (bounded), then kills what is left.

        Agents stop their workers first (SIGTERM, `grace`, SIGKILL). Agents declared dead, or
        lost with their node, are not waited for.
        """
        self.broken = self.broken or "closed"
        try:
            if self._opened:
                self._close_agents(grace)
        finally:
            with contextlib.suppress(OSError):
                self.server.close()
            if self.log_dir is not None and not self.log_dir.keep:
                shutil.rmtree(self.log_dir.path, ignore_errors=True)

    def _close_agents(self, grace: float) -> None:
        self.listener.close()
        live = [a for a in self.agents.values() if not a.closed and a.node_rank not in self._dead]
        for agent in live:
            with contextlib.suppress(OSError):
                agent.conn.send({"t": protocol.CLOSE})
        waiting = {id(a.conn) for a in live}
        start = time.monotonic()
        try:
            while waiting and time.monotonic() < start + self.stop_wait(grace) + 3.0:
                try:
                    kind, conn, data = self.events.get(timeout=TICK)
                except queue.Empty:
                    continue
                sender = self.agent_of(conn)
                if kind == "eof":
                    waiting.discard(id(conn))
                elif sender is None:
                    conn.close()  # authenticated, but too late to take part
                else:
                    self.on_frame_between_runs(sender, data)
        finally:  # also on Ctrl-C during a long wait for SLURM: nothing may be left running
            self.starter.stop(STOP_WAIT if not waiting else 0.0)
            for agent in self.agents.values():
                agent.conn.close()
            while True:  # connections that were still in the accept queue
                try:
                    _, conn, _ = self.events.get_nowait()
                except queue.Empty:
                    break
                if id(conn) not in self._by_conn:
                    conn.close()
            self.listener.join()

    def ready(self) -> None:
        """Before a run: takes in what happened since the last one, and checks every agent.

        Raises:
            AgentFailedError: an agent exited, closed its connection or went silent while idle.
        """
        if self.broken:
            raise AgentFailedError(f"the launcher's agents cannot run again ({self.broken})")
        while True:
            try:
                kind, conn, data = self.events.get_nowait()
            except queue.Empty:
                break
            agent = self.agent_of(conn)
            if kind == "eof":
                self.on_eof(conn, data, running=False)
            # unknown connections (a streamed result of a run that failed) are dropped
            elif agent is None:
                conn.close()
            else:
                self.on_frame_between_runs(agent, data)
        self.end_of_run()
        if self.broken:
            raise AgentFailedError(f"the launcher's agents cannot run again ({self.broken})")
        now = time.monotonic()
        self.check_processes(now, running=False)
        self.check_silence(now)
        self.listener.idle = False
        if self.listener.dropped:
            log.warning(
                "slurmrun: %d messages from agents were dropped between runs (output of "
                "processes a run left behind?)",
                self.listener.dropped,
            )
            self.listener.dropped = 0

    # ------------------------------------------------------------------ decisions
    def on_frame_between_runs(self, agent: PoolAgent, frame: Frame) -> None:
        """Takes in what an agent sends outside a run (heartbeats, its workers' late lines)."""
        if frame.kind == protocol.TERMINATING:
            self.on_slurm_ending(agent)

    def on_slurm_ending(self, agent: PoolAgent) -> None:
        """SLURM is ending `agent`'s step: its workers may take until SLURM's kill to exit.

        The run goes on to its end (its workers' last output and errors still count); the
        pool then cannot take another run (`end_of_run`).
        """
        if agent.node_rank in self._slurm_ending:
            return
        if not self._slurm_ending:  # once per pool: a job of 4096 nodes would say it 4096 times
            log.warning(
                "slurmrun: SLURM is ending the step on %s (SIGTERM); its workers got the signal "
                "too, and are given until SLURM's kill to exit (at most %g s)",
                agent.hostname,
                protocol.SLURM_TERM_WAIT,
            )
        self._slurm_ending.add(agent.node_rank)
        if self.trace is not None:
            self.trace.emit(StepEnding, host=agent.hostname, node_rank=agent.node_rank)

    def end_of_run(self) -> None:
        """After a run: agents whose step SLURM is ending cannot take another (broken)."""
        self.listener.idle = True  # between runs: the listener bounds what it queues
        if self._slurm_ending and not self.broken:
            hosts = sorted(self.agents[r].hostname for r in self._slurm_ending)
            self.broken = f"SLURM is ending the step of the agents on {hosts}"

    def slurm_ending(self, agent: PoolAgent) -> bool:
        """Whether `agent` said that SLURM is ending its step."""
        return agent.node_rank in self._slurm_ending

    def stop_wait(self, grace: float) -> float:
        """How long agents may take to stop their workers: `grace`, or SLURM's time."""
        return max(grace, protocol.SLURM_TERM_WAIT) if self._slurm_ending else grace

    def agent_of(self, conn: Connection) -> PoolAgent | None:
        """The agent whose control connection `conn` is (None: a streamed result, or new)."""
        return self._by_conn.get(id(conn))

    def on_hello(self, conn: Connection, frame: Frame) -> None:
        """Takes in a new agent (or raises for a connection that is not one)."""
        if frame.kind == protocol.RESULT:  # no worker is running yet: it is not theirs
            conn.close()
            raise AgentFailedError(
                "a result arrived for an unknown or finished worker (node rank "
                f"{frame.header.get('node_rank')!r}, local rank {frame.header.get('local_rank')!r})"
            )
        if frame.kind != protocol.HELLO:
            conn.close()
            raise AgentFailedError(f"an agent sent {frame.kind!r} before hello")
        hello = protocol.Hello.from_header(frame.header)
        rank = hello.node_rank
        if rank < 0:
            # Agents of an srun step are known by their node name.
            candidates = [i for i, h in enumerate(self.hostnames) if h == hello.hostname]
            rank = candidates[0] if len(candidates) == 1 else -1
        if rank < 0 or rank >= len(self.hostnames) or rank in self.agents:
            conn.close()
            raise AgentFailedError(
                f"an agent on {hello.hostname!r} connected, but it is not one of the expected "
                f"hosts {list(self.hostnames)} (or its host connected twice)",
                hostname=hello.hostname,
            )
        agent = PoolAgent(rank, self.hostnames[rank], conn, hello, hello.master_port)
        self.starter.agent_hello(rank, frame.header)
        self.agents[rank] = agent
        self._by_conn[id(conn)] = agent
        self.listener.add_agent(conn)
        if self.trace is not None:
            self.trace.emit(
                AgentConnected, host=agent.hostname, node_rank=rank, seconds=self.trace.seconds()
            )
        if hello.error:
            raise AgentFailedError(
                f"the agent on {agent.hostname} could not prepare its workers: {hello.error}",
                hostname=agent.hostname,
                log_file=self.starter.log_file(rank),
            )

    def on_eof(self, conn: Connection, why: str, *, running: bool) -> PoolAgent | None:
        """An agent's connection ended: raises unless a run may let it go (`running`).

        Returns the agent (None: not an agent's connection). The pool is broken either way.
        """
        agent = self.agent_of(conn)
        if agent is None:
            return None
        agent.closed = True
        self.broken = f"the agent on {agent.hostname} closed its connection"
        if not running:
            time.sleep(0.2)  # give the exit code a moment to appear, for the message
            detail = f" ({why})" if why else ""
            raise self.exit_error(
                agent.node_rank, f"it closed its connection before its work was done{detail}"
            )
        return agent

    def exit_error(self, node_rank: int | None, why: str) -> AgentFailedError:
        """The error for an agent (None: the srun step) that ended too early."""
        self.broken = self.broken or why
        hostname = ""
        if node_rank is not None:
            agent = self.agents.get(node_rank)
            hostname = agent.hostname if agent else self.hostnames[node_rank]
        return agent_exit_error(self.starter, node_rank, hostname, why)

    def check_processes(self, now: float, *, running: bool) -> None:
        """Turns agent process exits into errors once their connections had time to drain."""
        for node_rank in self.starter.exit_codes():
            first_seen = self._exited_at.setdefault(node_rank, now)
            if node_rank is None:
                agents = [a for a in self.agents.values() if not a.closed]
                if not agents and len(self.agents) < len(self.hostnames):
                    # srun ended before every agent connected (e.g. it could not create the
                    # step, or an agent gave up reaching us): name the agent that ended first
                    raise self.exit_error(self._first_failed(), "the srun step ended early")
                if agents and (not running or now - first_seen > DRAIN_TIMEOUT):
                    raise self.exit_error(agents[0].node_rank, "the srun step ended early")
                continue
            agent = self.agents.get(node_rank)
            drained = agent is not None and (agent.closed or now - first_seen <= DRAIN_TIMEOUT)
            if not running or not drained:
                raise self.exit_error(node_rank, "it ended before its workers did")

    def _first_failed(self) -> int | None:
        """The node rank of the first task srun saw fail on its own (not from its SIGTERM)."""
        step_log = self.starter.log_file(None)
        for host, code in _SRUN_TASK_EXIT.findall(tail_file(step_log, 100)):
            if host in self.hostnames and int(code) != 128 + 15:
                return self.hostnames.index(host)
        return None

    def check_silence(self, now: float) -> None:
        """Raises for an agent that sent nothing (not even a heartbeat) for `silence` s.

        It looks at most every `silence` / 10 s (and at least every second): each look goes
        over every agent, and a run calls it every `TICK`.
        """
        if now < self._next_silence_check:
            return
        self._next_silence_check = now + min(1.0, self.silence / 10)
        for agent in self.agents.values():
            if agent.closed or agent.conn.receiving:
                continue
            if now - self.listener.heard_at(agent.conn) > self.silence:
                self._dead.add(agent.node_rank)
                self.broken = f"the agent on {agent.hostname} went silent"
                raise AgentFailedError(
                    f"the agent on {agent.hostname} sent nothing for {self.silence:g} s "
                    "(no heartbeat): its node may be hung or unreachable. Its log: "
                    f"{self.starter.log_file(agent.node_rank)}",
                    hostname=agent.hostname,
                    log_file=self.starter.log_file(agent.node_rank),
                )

    def send(self, agent: PoolAgent, header: dict[str, Any], body: bytes = b"") -> None:
        """Sends one message to `agent`; a failure breaks the pool and raises."""
        try:
            agent.conn.send(header, body)
        except OSError as e:
            self.broken = f"could not reach the agent on {agent.hostname}"
            raise AgentFailedError(
                f"could not send to the agent on {agent.hostname}: {e}",
                hostname=agent.hostname,
                log_file=self.starter.log_file(agent.node_rank),
            ) from e
