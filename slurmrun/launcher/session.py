"""One run on the pool's agents: hand out the call, gather results, judge failures.

A run borrows the agents of a `slurmrun.launcher.pool.AgentPool`: it sends each its share (START),
takes every event of the pool's queue until every result is in or something failed, and ends
by telling every agent to stop its workers and waiting until each says IDLE. Whether the pool
lives on afterwards (a warm launcher) or is closed (a cold launch) is the launcher's business.

The calling thread makes every decision from the pool's single event queue, so the order of
events is the order of decisions. Failures that time alone reveals are judged on a clock,
whatever the traffic.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun import protocol
from slurmrun.errors import AgentFailedError, add_note
from slurmrun.events import Trace, WorkerFailed, WorkersStarted
from slurmrun.launcher.failures import WorkerPlace, step_ended, worker_died, worker_error
from slurmrun.launcher.pool import TICK, AgentPool, PoolAgent
from slurmrun.logs import RunOutput, default_handlers, worker_log_path
from slurmrun.result import LaunchResult
from slurmrun.transport import Connection, Frame, loads

__all__ = ["Session"]

# How long a communication error ("peer reset") waits for the failure that caused it.
ROOT_CAUSE_WAIT = 1.0
# After the last result, how long to wait for agents to forward their workers' last output.
DONE_WAIT = 2.0
# Beyond the workers' grace period: how long agents may take to say IDLE after END.
IDLE_WAIT = 5.0


@dataclass
class _Share:
    """One agent's part of the run."""

    agent: PoolAgent
    workers: int = 0
    rank_offset: int = 0  # global rank of its local rank 0
    results: dict[int, Frame] = field(default_factory=dict)
    # Large results come over connections of their own (the frame), announced by the agent
    # behind the worker's earlier output (the local rank); a result counts once both arrived.
    streamed: dict[int, Frame] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)
    started: bool = False  # its agent reported its workers' pids
    done: bool = False  # all its workers exited and their output was forwarded
    idle: bool = False  # its workers are gone: ready for the next run

    @property
    def hostname(self) -> str:
        return self.agent.hostname


@dataclass
class Session:
    """One run of the call `payload` on every agent of `pool`. Use once."""

    pool: AgentPool
    workers_per_host: Sequence[int] | None  # None: each agent's own count
    backend: str | None
    timeout: float
    grace: float
    payload: bytes
    start_header: dict[str, Any]  # sys_path, cwd, env (see protocol.Start)
    local_master: bool = False
    handlers: list[logging.Handler] | None = None  # None: the defaults (see logs.py)
    log_dir: str | None = None  # where the default handlers write one file per worker
    # The agents see `log_dir` and write their workers' files themselves (srun and local
    # agents); with the default handlers they then send only the records shown live.
    agents_write_logs: bool = False
    log_level: int = logging.INFO
    trace: Trace | None = None  # the launch's events and milestones

    def __post_init__(self) -> None:
        self._events = self.pool.events
        self._shares: dict[int, _Share] = {}
        self._held: tuple[BaseException, float] | None = None
        self._last_result = 0.0
        # Counted, not recounted per event: 4096 agents x 8 workers would make that quadratic.
        self._results_left = 0
        self._done_left = 0
        self._handlers: list[logging.Handler] = list(self.handlers or [])
        self._own_handlers = self.handlers is None
        self._output = RunOutput()  # each worker's unfinished lines

    # ------------------------------------------------------------------ main
    def run(self) -> LaunchResult[Any]:
        """Runs the call on the pool's agents, and always ends the run (workers stopped)."""
        self.pool.ready()
        try:
            self._hand_out()
            return self._drive()
        finally:
            try:
                self._end()
            finally:
                if self._own_handlers:
                    for handler in self._handlers:
                        handler.close()

    def _drive(self) -> LaunchResult[Any]:
        next_check = 0.0
        while True:
            now = time.monotonic()
            if self._finished(now):
                break
            # On a clock, not when the queue runs dry: steady output must not postpone them.
            if now >= next_check:
                self._check(now)
                next_check = now + TICK
            try:
                kind, conn, data = self._events.get(timeout=max(0.0, next_check - now))
            except queue.Empty:
                continue
            self._handle(kind, conn, data, time.monotonic())
        return self._collect()

    def _end(self) -> None:
        """Tells every agent to stop the run's workers, and waits until each is idle.

        An agent that does not say so in time breaks the pool (the launcher then closes it);
        the run's outcome stands.
        """
        if self.pool.broken:
            return  # the launcher closes the pool, which stops every worker
        waiting = [s for s in self._shares.values() if not s.agent.closed]
        for each in waiting:
            try:
                self.pool.send(each.agent, {"t": protocol.END})
            except AgentFailedError:
                return
        start = time.monotonic()
        # Counted down, not rescanned per event: 4096 agents would make that quadratic.
        busy = {s.agent.node_rank for s in waiting if not s.idle}
        while busy:
            if time.monotonic() > start + self.pool.stop_wait(self.grace) + IDLE_WAIT:
                late = [s.hostname for s in waiting if not s.idle]
                self.pool.broken = f"the agents on {late} did not end the run in time"
                return
            try:
                kind, conn, data = self._events.get(timeout=TICK)
            except queue.Empty:
                continue
            share = self._share_of(conn)
            if kind == "eof":
                self.pool.on_eof(conn, data, running=True)
                if self.pool.broken:
                    return
            elif share is None:
                conn.close()  # a streamed result of a failed run
            elif data.kind == protocol.IDLE:
                busy.discard(share.agent.node_rank)
                share.idle = True
                share.agent.master_port = protocol.Idle.from_header(data.header).master_port
            elif data.kind == protocol.LOG:
                self._on_log(share, data)
            elif data.kind == protocol.TERMINATING:
                self.pool.on_slurm_ending(share.agent)
        self.pool.end_of_run()

    # ------------------------------------------------------------------ hand-out
    def _hand_out(self) -> None:
        pool = self.pool
        order = [pool.agents[i] for i in range(len(pool.hostnames))]
        counts = (
            list(self.workers_per_host)
            if self.workers_per_host is not None
            else [a.hello.auto_workers for a in order]
        )
        world_size = sum(counts)
        # The default handlers show rank 0; each worker's file is written by its agent where
        # the agents see the log directory, else here (then every line must come here).
        own = self._own_handlers
        agent_files = own and self.agents_write_logs and self.log_dir is not None
        forward_all = not own or (self.log_dir is not None and not agent_files)
        if own:
            files_here = None if agent_files else self.log_dir
            self._handlers = default_handlers(pool.hostnames, files_here, self.log_level)
        master_addr = "127.0.0.1" if self.local_master else order[0].hello.addr
        # What every agent's START shares is built once; each gets its own share on top.
        shared = protocol.Start(
            workers=0,
            rank_offset=0,
            world_size=world_size,
            node_rank=0,
            master_addr=master_addr,
            master_port=order[0].master_port,
            backend=self.backend,
            timeout=self.timeout,
            grace=self.grace,
            log_level=self.log_level,
            sys_path=list(self.start_header["sys_path"]),
            cwd=str(self.start_header["cwd"]),
            env=dict(self.start_header["env"]),
            log_dir=self.log_dir if agent_files else None,
        ).header()
        offset = 0
        for agent, count in zip(order, counts, strict=True):
            share = _Share(agent, count, offset)
            self._shares[agent.node_rank] = share
            self._results_left += count
            self._done_left += 1
            start = protocol.start_header(
                shared,
                workers=count,
                rank_offset=offset,
                node_rank=agent.node_rank,
                forward_ranks=None if forward_all else self._shown_ranks(agent),
            )
            pool.send(agent, start, self.payload)
            offset += count

    def _shown_ranks(self, agent: PoolAgent) -> list[int]:
        """The local ranks of `agent` that the default handlers show: rank 0 of the first host."""
        return [0] if agent.hostname == self.pool.hostnames[0] else []

    # ------------------------------------------------------------------ events
    def _share_of(self, conn: Connection) -> _Share | None:
        agent = self.pool.agent_of(conn)
        return None if agent is None else self._shares.get(agent.node_rank)

    def _handle(self, kind: str, conn: Connection, data: Any, now: float) -> None:
        share = self._share_of(conn)
        if kind == "eof":
            agent = self.pool.on_eof(conn, data, running=True)
            if share is not None and len(share.results) < share.workers:
                assert agent is not None  # noqa: S101 - a share's connection is an agent's
                time.sleep(0.2)  # give the exit code a moment to appear, for the message
                detail = f" ({data})" if data else ""
                raise self.pool.exit_error(
                    agent.node_rank, f"it closed its connection before all results{detail}"
                )
            return
        frame: Frame = data
        if share is None:
            if frame.kind == protocol.RESULT:
                self._on_streamed(conn, frame, now)
                return
            self.pool.on_hello(conn, frame)  # raises: every agent is known by now
            return
        if frame.kind == protocol.LOG:
            self._on_log(share, frame)
        elif frame.kind == protocol.RESULT:
            self._on_result(share, frame, now)
        elif frame.kind == protocol.DONE:
            self._done_left -= not share.done
            share.done = True
        elif frame.kind == protocol.STARTED:
            self._on_started(share, frame)
        elif frame.kind == protocol.ERROR:
            exc = self._worker_failure(share, frame)
            if frame.header.get("secondary") and self._held is None:
                self._held = (exc, now)  # likely a consequence: wait briefly for the cause
                return
            raise self._with_held(exc)
        elif frame.kind == protocol.DIED:
            raise self._with_held(self._worker_failure(share, frame))
        elif frame.kind == protocol.TERMINATING:
            self.pool.on_slurm_ending(share.agent)

    def _on_log(self, share: _Share, frame: Frame) -> None:
        local_rank = frame.header.get("local_rank")
        rank = None if local_rank is None else share.rank_offset + int(local_rank)
        self._output.dispatch(frame.header, frame.body, share.hostname, rank, self._handlers)

    def _on_result(self, share: _Share, frame: Frame, now: float) -> None:
        local_rank = int(frame.header["local_rank"])
        if not frame.header.get("streamed"):
            self._got_result(share, local_rank, frame, now)
        elif local_rank in share.streamed:
            self._got_result(share, local_rank, share.streamed.pop(local_rank), now)
        else:
            share.announced.add(local_rank)

    def _on_started(self, share: _Share, frame: Frame) -> None:
        share.started = True
        if self.trace is None:
            return
        pids = tuple(int(p) for p in frame.header.get("pids", ()))
        self.trace.emit(
            WorkersStarted,
            host=share.hostname,
            node_rank=share.agent.node_rank,
            pids=pids,
            seconds=self.trace.seconds(),
        )
        if all(s.started for s in self._shares.values()):
            self.trace.mark("workers_started")

    def _got_result(self, share: _Share, local_rank: int, frame: Frame, now: float) -> None:
        self._results_left -= local_rank not in share.results
        share.results[local_rank] = frame
        self._last_result = now
        if self.trace is not None:
            self.trace.mark("first_result")
            self.trace.mark("last_result", last=True)

    def _on_streamed(self, conn: Connection, frame: Frame, now: float) -> None:
        """A large result that arrived over a connection of its own (see worker._send_result)."""
        conn.close()
        node_rank, local_rank = frame.header.get("node_rank"), frame.header.get("local_rank")
        share = self._shares.get(node_rank) if isinstance(node_rank, int) else None
        if (
            share is None
            or not isinstance(local_rank, int)
            or not 0 <= local_rank < share.workers
            or local_rank in share.results
            or local_rank in share.streamed
        ):
            raise AgentFailedError(
                f"a result arrived for an unknown or finished worker (node rank {node_rank!r}, "
                f"local rank {local_rank!r})"
            )
        if local_rank in share.announced:
            share.announced.discard(local_rank)
            self._got_result(share, local_rank, frame, now)
        else:
            share.streamed[local_rank] = frame

    # ------------------------------------------------------------------ verdicts
    def _worker_log(self, share: _Share, local_rank: int) -> str | None:
        if not self._own_handlers or self.log_dir is None:
            return None
        return worker_log_path(self.log_dir, share.hostname, local_rank)

    def _worker_failure(self, share: _Share, frame: Frame) -> BaseException:
        local_rank = int(frame.header.get("local_rank", -1))
        where = WorkerPlace(
            share.hostname,
            local_rank,
            share.rank_offset + local_rank,
            self._worker_log(share, local_rank),
        )
        exc: BaseException
        if frame.kind == protocol.DIED:
            exc = worker_died(where, frame.header)
            if self.pool.slurm_ending(share.agent):  # SIGTERM, or its own exit once it got it
                exc = step_ended(where, exc)
        else:
            exc = worker_error(where, frame)
        if self.trace is not None:
            header = frame.header
            self.trace.emit(
                WorkerFailed,
                host=share.hostname,
                local_rank=local_rank,
                rank=where.rank,
                exitcode=header.get("exitcode") if frame.kind == protocol.DIED else None,
                signal=header.get("signal") if frame.kind == protocol.DIED else None,
                error=None if frame.kind == protocol.DIED else type(exc).__name__,
                last_lines="\n".join(
                    str(header.get("stderr_tail") or header.get("traceback") or "").splitlines()[
                        -20:
                    ]
                ),
            )
        return exc

    def _with_held(self, exc: BaseException) -> BaseException:
        if self._held is not None and self._held[0] is not exc:
            held = self._held[0]
            add_note(exc, f"slurmrun: another rank then failed with {type(held).__name__}: {held}")
        return exc

    def _without_cause(self, exc: BaseException) -> BaseException:
        """A communication error that no other failure explains: say who had already left."""
        returned = sorted(s.rank_offset + lr for s in self._shares.values() for lr in s.results)
        if returned:
            listed = ", ".join(map(str, returned[:10])) + (", ..." if len(returned) > 10 else "")
            add_note(
                exc,
                f"slurmrun: rank(s) {listed} had already returned and left the process group: "
                "this rank was most likely waiting in a collective that they never joined.",
            )
        return exc

    def _check(self, now: float) -> None:
        """Raises the failure that time alone reveals: a dead or silent agent, a lone error."""
        if self._held is not None and now - self._held[1] > ROOT_CAUSE_WAIT:
            raise self._without_cause(self._held[0])
        self.pool.check_processes(now, running=True)
        self.pool.check_silence(now)

    def _finished(self, now: float) -> bool:
        if self._results_left > 0:
            return False
        # Output written just before returning may still be on its way: wait (briefly) for
        # every agent to say that its workers exited and their output was forwarded.
        return self._done_left <= 0 or now - self._last_result > DONE_WAIT

    def _collect(self) -> LaunchResult[Any]:
        order = [self._shares[i] for i in range(len(self.pool.hostnames))]
        values: list[list[Any]] = []
        rank = 0
        for share in order:
            host_values = []
            for local_rank in range(share.workers):
                frame = share.results[local_rank]
                try:
                    host_values.append(loads(frame.body, frame.buffers))
                except Exception as e:
                    raise RuntimeError(
                        f"the return value of rank {rank} (host {share.hostname}) could not be "
                        f"unpickled in the launcher: {type(e).__name__}: {e}. Return types that "
                        "the launcher's Python can import."
                    ) from e
                share.results[local_rank] = Frame({})  # let go of the raw bytes early
                rank += 1
            values.append(host_values)
        return LaunchResult(hostnames=[s.hostname for s in order], return_values=values)
