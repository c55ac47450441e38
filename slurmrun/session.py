"""The launcher's side of one launch: accept agents, hand out work, gather results.

Threads only move bytes (`slurmrun.listener`): they turn frames into events, and the calling
thread makes every decision from that single event queue, so the order of events is the order
of decisions. Failures that time alone reveals are judged on a clock, whatever the traffic.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun.errors import AgentFailedError, add_note
from slurmrun.failures import WorkerPlace, agent_exit_error, worker_died, worker_error
from slurmrun.listener import Listener
from slurmrun.logs import default_handlers, dispatch, make_record, worker_log_path
from slurmrun.result import LaunchResult
from slurmrun.starters import AgentStarter
from slurmrun.transport import Connection, Frame, loads

__all__ = ["Session"]

# After an agent's process exits, how long its connection may take to deliver what it sent.
DRAIN_TIMEOUT = 2.0
# How long a communication error ("peer reset") waits for the failure that caused it.
ROOT_CAUSE_WAIT = 1.0
# After the last result, how long to wait for agents to forward their workers' last output.
DONE_WAIT = 2.0
# Once agents closed their connections, how long their processes (or srun) may take to exit.
STOP_WAIT = 1.0
_TICK = 0.05


@dataclass
class _Agent:
    node_rank: int
    hostname: str
    conn: Connection
    hello: dict[str, Any]
    workers: int = 0
    rank_offset: int = 0  # global rank of its local rank 0
    results: dict[int, Frame] = field(default_factory=dict)
    # Large results come over connections of their own (the frame), announced by the agent
    # behind the worker's earlier output (the local rank); a result counts once both arrived.
    streamed: dict[int, Frame] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)
    closed: bool = False
    done: bool = False  # all its workers exited and their output was forwarded


@dataclass
class Session:
    """One launch, from listening socket to results. Use once."""

    hostnames: Sequence[str]
    workers_per_host: Sequence[int] | None  # None: each agent's own count
    backend: str | None
    timeout: float
    agent_timeout: float
    grace: float
    payload: bytes
    secret: bytes
    starter: AgentStarter
    server: socket.socket
    start_header: dict[str, Any]
    local_master: bool = False
    handlers: list[logging.Handler] | None = None  # None: the defaults (see logs.py)
    log_dir: str | None = None  # where the default handlers write one file per worker
    log_level: int = logging.INFO

    def __post_init__(self) -> None:
        self._listener = Listener(self.server, self.secret, self.agent_timeout)
        self._events = self._listener.events
        self._agents: dict[int, _Agent] = {}
        self._by_conn: dict[int, _Agent] = {}
        self._exited_at: dict[int | None, float] = {}
        self._held: tuple[BaseException, float] | None = None
        self._last_result = 0.0
        self._dead: set[int] = set()  # node ranks of agents declared dead (no heartbeat)
        self._handlers: list[logging.Handler] = list(self.handlers or [])
        self._own_handlers = self.handlers is None

    # ------------------------------------------------------------------ decisions
    def _agent_exit_error(
        self, agent: _Agent | None, node_rank: int | None, why: str
    ) -> AgentFailedError:
        hostname = agent.hostname if agent else ""
        if not hostname and node_rank is not None:
            hostname = self.hostnames[node_rank]
        return agent_exit_error(self.starter, node_rank, hostname, why)

    def _check_processes(self, now: float) -> None:
        """Turns agent process exits into errors once their connections had time to drain."""
        for node_rank in self.starter.exit_codes():
            first_seen = self._exited_at.setdefault(node_rank, now)
            if node_rank is None:
                agents = [a for a in self._agents.values() if not a.closed]
                if not agents and len(self._agents) < len(self.hostnames):
                    # srun ended before every agent connected (e.g. it could not create the step)
                    raise self._agent_exit_error(None, None, "the srun step ended early")
                if agents and now - first_seen > DRAIN_TIMEOUT:
                    raise self._agent_exit_error(
                        agents[0], agents[0].node_rank, "the srun step ended early"
                    )
                continue
            agent = self._agents.get(node_rank)
            drained = agent is not None and (agent.closed or now - first_seen <= DRAIN_TIMEOUT)
            if not drained:
                raise self._agent_exit_error(agent, node_rank, "it ended before its workers did")

    def _check_silence(self, now: float) -> None:
        for agent in self._agents.values():
            if agent.closed or agent.conn.receiving:
                continue
            if now - self._listener.heard_at(agent.conn) > self.agent_timeout:
                self._dead.add(agent.node_rank)
                raise AgentFailedError(
                    f"the agent on {agent.hostname} sent nothing for {self.agent_timeout:g} s "
                    "(no heartbeat): its node may be hung or unreachable. Its log: "
                    f"{self.starter.log_file(agent.node_rank)}",
                    hostname=agent.hostname,
                    log_file=self.starter.log_file(agent.node_rank),
                )

    def _on_hello(self, conn: Connection, header: dict[str, Any]) -> None:
        rank = int(header.get("node_rank", -1))
        hostname = str(header.get("hostname", ""))
        if rank < 0:
            # Agents of an srun step are known by their node name.
            candidates = [i for i, h in enumerate(self.hostnames) if h == hostname]
            rank = candidates[0] if len(candidates) == 1 else -1
        if rank < 0 or rank >= len(self.hostnames) or rank in self._agents:
            conn.close()
            raise AgentFailedError(
                f"an agent on {hostname!r} connected, but it is not one of the expected hosts "
                f"{list(self.hostnames)} (or its host connected twice)",
                hostname=hostname,
            )
        agent = _Agent(rank, self.hostnames[rank], conn, header)
        self.starter.agent_hello(rank, header)
        self._agents[rank] = agent
        self._by_conn[id(conn)] = agent
        self._listener.add_agent(conn)
        if header.get("error"):
            raise AgentFailedError(
                f"the agent on {agent.hostname} could not prepare its workers: {header['error']}",
                hostname=agent.hostname,
                log_file=self.starter.log_file(rank),
            )

    def _hand_out(self) -> None:
        order = [self._agents[i] for i in range(len(self.hostnames))]
        counts = (
            list(self.workers_per_host)
            if self.workers_per_host is not None
            else [int(a.hello["auto_workers"]) for a in order]
        )
        world_size = sum(counts)
        if self._own_handlers:
            self._handlers = default_handlers(self.hostnames, self.log_dir, self.log_level)
        first = order[0].hello
        master_addr = "127.0.0.1" if self.local_master else str(first["addr"])
        offset = 0
        for agent, count in zip(order, counts, strict=True):
            agent.workers = count
            agent.rank_offset = offset
            header = dict(self.start_header)
            header.update(
                t="start",
                workers=count,
                rank_offset=offset,
                world_size=world_size,
                node_rank=agent.node_rank,
                master_addr=master_addr,
                master_port=int(first["master_port"]),
                backend=self.backend,
                timeout=self.timeout,
                grace=self.grace,
                log_level=self.log_level,
            )
            try:
                agent.conn.send(header, self.payload)
            except OSError as e:
                raise AgentFailedError(
                    f"could not send the function to the agent on {agent.hostname}: {e}",
                    hostname=agent.hostname,
                    log_file=self.starter.log_file(agent.node_rank),
                ) from e
            offset += count

    def _worker_log(self, agent: _Agent, local_rank: int) -> str | None:
        if not self._own_handlers or self.log_dir is None:
            return None
        return worker_log_path(self.log_dir, agent.hostname, local_rank)

    @staticmethod
    def _rank(agent: _Agent, local_rank: int) -> int:
        return agent.rank_offset + local_rank

    def _worker_failure(self, agent: _Agent, frame: Frame) -> BaseException:
        local_rank = int(frame.header.get("local_rank", -1))
        where = WorkerPlace(
            agent.hostname,
            local_rank,
            self._rank(agent, local_rank),
            self._worker_log(agent, local_rank),
        )
        if frame.kind == "died":
            return worker_died(where, frame.header)
        return worker_error(where, frame)

    def _handle(self, kind: str, conn: Connection, data: Any, now: float) -> None:
        agent = self._by_conn.get(id(conn))
        if kind == "eof":
            if agent is None:
                return
            agent.closed = True
            if len(agent.results) < agent.workers or not self._handed_out:
                time.sleep(0.2)  # give the exit code a moment to appear, for the message
                detail = f" ({data})" if data else ""
                raise self._agent_exit_error(
                    agent, agent.node_rank, f"it closed its connection before all results{detail}"
                )
            return
        frame: Frame = data
        if agent is None:
            if frame.kind == "result":
                self._on_streamed(conn, frame, now)
                return
            if frame.kind != "hello":
                conn.close()
                raise AgentFailedError(f"an agent sent {frame.kind!r} before hello")
            self._on_hello(conn, frame.header)
            return
        if frame.kind == "log":
            local_rank = frame.header.get("local_rank")
            rank = None if local_rank is None else self._rank(agent, int(local_rank))
            dispatch(make_record(frame.header, agent.hostname, rank), self._handlers)
        elif frame.kind == "result":
            self._on_result(agent, frame, now)
        elif frame.kind == "done":
            agent.done = True
        elif frame.kind == "error":
            exc = self._worker_failure(agent, frame)
            if frame.header.get("secondary") and self._held is None:
                self._held = (exc, now)  # likely a consequence: wait briefly for the cause
                return
            raise self._with_held(exc)
        elif frame.kind == "died":
            raise self._with_held(self._worker_failure(agent, frame))

    def _on_result(self, agent: _Agent, frame: Frame, now: float) -> None:
        local_rank = int(frame.header["local_rank"])
        if not frame.header.get("streamed"):
            self._got_result(agent, local_rank, frame, now)
        elif local_rank in agent.streamed:
            self._got_result(agent, local_rank, agent.streamed.pop(local_rank), now)
        else:
            agent.announced.add(local_rank)

    def _got_result(self, agent: _Agent, local_rank: int, frame: Frame, now: float) -> None:
        agent.results[local_rank] = frame
        self._last_result = now

    def _on_streamed(self, conn: Connection, frame: Frame, now: float) -> None:
        """A large result that arrived over a connection of its own (see worker._send_result)."""
        conn.close()
        node_rank, local_rank = frame.header.get("node_rank"), frame.header.get("local_rank")
        agent = self._agents.get(node_rank) if isinstance(node_rank, int) else None
        if (
            agent is None
            or not isinstance(local_rank, int)
            or not 0 <= local_rank < agent.workers
            or local_rank in agent.results
            or local_rank in agent.streamed
        ):
            raise AgentFailedError(
                f"a result arrived for an unknown or finished worker (node rank {node_rank!r}, "
                f"local rank {local_rank!r})"
            )
        if local_rank in agent.announced:
            agent.announced.discard(local_rank)
            self._got_result(agent, local_rank, frame, now)
        else:
            agent.streamed[local_rank] = frame

    def _with_held(self, exc: BaseException) -> BaseException:
        if self._held is not None and self._held[0] is not exc:
            held = self._held[0]
            add_note(exc, f"slurmrun: another rank then failed with {type(held).__name__}: {held}")
        return exc

    def _without_cause(self, exc: BaseException) -> BaseException:
        """A communication error that no other failure explains: say who had already left."""
        returned = sorted(self._rank(a, lr) for a in self._agents.values() for lr in a.results)
        if returned:
            listed = ", ".join(map(str, returned[:10])) + (", ..." if len(returned) > 10 else "")
            add_note(
                exc,
                f"slurmrun: rank(s) {listed} had already returned and left the process group: "
                "this rank was most likely waiting in a collective that they never joined.",
            )
        return exc

    # ------------------------------------------------------------------ main
    def run(self, env: dict[str, str]) -> LaunchResult[Any]:
        """Starts the agents, runs the launch, and always cleans up."""
        self._handed_out = False
        self._listener.start()
        try:
            self.starter.start(env)
            return self._drive()
        finally:
            self._shutdown()
            self._listener.join()

    def _drive(self) -> LaunchResult[Any]:
        n = len(self.hostnames)
        connect_deadline = time.monotonic() + self.timeout
        next_check = 0.0
        while True:
            now = time.monotonic()
            if not self._handed_out and len(self._agents) == n:
                self._hand_out()
                self._handed_out = True
            if self._handed_out and self._finished(now):
                break
            # On a clock, not when the queue runs dry: steady output must not postpone them.
            if now >= next_check:
                self._check(now, connect_deadline)
                next_check = now + _TICK
            try:
                kind, conn, data = self._events.get(timeout=max(0.0, next_check - now))
            except queue.Empty:
                continue
            self._handle(kind, conn, data, time.monotonic())
        return self._collect()

    def _check(self, now: float, connect_deadline: float) -> None:
        """Raises the failure that time alone reveals: no agent, a dead or silent one."""
        if not self._handed_out and now > connect_deadline:
            n = len(self.hostnames)
            missing = [self.hostnames[i] for i in range(n) if i not in self._agents]
            raise AgentFailedError(
                f"agents on {missing} did not connect within timeout={self.timeout:.0f} s. "
                f"Their output: {self.starter.log_file(None) or self.starter.log_file(0)}",
                hostname=missing[0],
            )
        if self._held is not None and now - self._held[1] > ROOT_CAUSE_WAIT:
            raise self._without_cause(self._held[0])
        self._check_processes(now)
        if self._handed_out:
            self._check_silence(now)

    def _finished(self, now: float) -> bool:
        if not all(len(a.results) == a.workers for a in self._agents.values()):
            return False
        # Output written just before returning may still be on its way: wait (briefly) for
        # every agent to say that its workers exited and their output was forwarded.
        return all(a.done for a in self._agents.values()) or now - self._last_result > DONE_WAIT

    def _collect(self) -> LaunchResult[Any]:
        order = [self._agents[i] for i in range(len(self.hostnames))]
        values: list[list[Any]] = []
        rank = 0
        for agent in order:
            host_values = []
            for local_rank in range(agent.workers):
                frame = agent.results[local_rank]
                try:
                    host_values.append(loads(frame.body, frame.buffers))
                except Exception as e:
                    raise RuntimeError(
                        f"the return value of rank {rank} (host {agent.hostname}) could not be "
                        f"unpickled in the launcher: {type(e).__name__}: {e}. Return types that "
                        "the launcher's Python can import."
                    ) from e
                agent.results[local_rank] = Frame({})  # let go of the raw bytes early
                rank += 1
            values.append(host_values)
        return LaunchResult(hostnames=[a.hostname for a in order], return_values=values)

    def _shutdown(self) -> None:
        self._listener.close()
        live = [a for a in self._agents.values() if not a.closed and a.node_rank not in self._dead]
        for agent in live:
            with contextlib.suppress(OSError):
                agent.conn.send({"t": "stop"})
        # Agents stop their workers (SIGTERM, grace, SIGKILL), then exit and close their
        # connections. Agents declared dead, or lost with their node, are not waited for.
        waiting = {id(a.conn) for a in live}
        deadline = time.monotonic() + self.grace + 3.0
        while waiting and time.monotonic() < deadline:
            try:
                kind, conn, _ = self._events.get(timeout=_TICK)
            except queue.Empty:
                continue
            if kind == "eof":
                waiting.discard(id(conn))
            elif id(conn) not in self._by_conn:
                conn.close()  # authenticated, but too late to take part
        self.starter.stop(STOP_WAIT if not waiting else 0.0)
        for agent in self._agents.values():
            agent.conn.close()
        while True:  # connections that were still in the accept queue
            try:
                _, conn, _ = self._events.get_nowait()
            except queue.Empty:
                break
            if id(conn) not in self._by_conn:
                conn.close()
        if self._own_handlers:
            for handler in self._handlers:
                handler.close()
