"""One run on the pool's agents: hand out the call, gather results, judge failures.

A run borrows the agents of a `slurmrun.launcher.pool.AgentPool`: it sends each its share
(START, with the run's id), takes the messages of its own run that the pool's loop hands it
until every result is in or something failed, and ends by telling every agent to stop its
workers (END) and waiting until each says IDLE. Messages of other runs never reach it.
Whether the pool lives on afterwards (a warm launcher) or is closed (a cold launch) is the
launcher's business.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from slurmrun import protocol
from slurmrun.errors import AgentFailedError
from slurmrun.events import Trace, WorkersStarted
from slurmrun.handlers import begin_files, default_handlers
from slurmrun.launcher.output_stage import OutputStage
from slurmrun.launcher.pool import IDLE_WAIT, AgentPool
from slurmrun.launcher.pump import Local, all_of, pump
from slurmrun.launcher.records import RunOutput, flush_handlers
from slurmrun.launcher.run_setup import Call, Output, Watching
from slurmrun.launcher.share import PoolAgent, Share
from slurmrun.launcher.verdicts import Verdicts
from slurmrun.launcher.watch import RunWatch
from slurmrun.logs import host_labels, run_header
from slurmrun.pickling import loads
from slurmrun.result import LaunchResult
from slurmrun.transport import Connection, Frame
from slurmrun.worker_env import compress_counts

__all__ = ["Run"]

log = logging.getLogger("slurmrun")

# After the last result, how long to wait for agents to forward their workers' last output.
DONE_WAIT = 2.0


@dataclass
class Run:
    """One run of the call `payload` on every agent of `pool`. Use once."""

    pool: AgentPool
    call: Call  # what it runs, and how its workers meet
    output: Output  # where its output goes
    watching: Watching  # its events and stall timeout
    id: int = 0  # given by the pool (`AgentPool.begin`)

    def __post_init__(self) -> None:
        self._shares: dict[int, Share] = {}
        self._last_result = 0.0
        # Counted, not recounted per event: 4096 agents x 8 workers would make that quadratic.
        self._results_left = 0
        self._done_left = 0
        self._handlers: list[logging.Handler] = list(self.output.handlers or [])
        self._own_handlers = self.output.handlers is None
        self._output = RunOutput()  # each worker's unfinished lines
        self._stage = OutputStage(self._output, self.pool.credits)  # shows them, off the loop
        # A host named twice has a label per node (records, prefixes, file names).
        self.labels = host_labels(self.pool.hostnames)
        self.ending = False  # END was sent: only output still counts, nothing is judged
        self._succeeded = False  # every result is in: kept workers serve the next run
        self._after_sigterm = False  # the launcher got SIGTERM during the run (`protocol.End`)
        self.verdicts = Verdicts(self.pool, self._shares, self.watching.trace, self.labels)
        self.watch = RunWatch(
            self.pool, self._shares, self.labels, self.watching, self.output.log_dir
        )

    # ------------------------------------------------------------------ main
    def run(self) -> LaunchResult[Any]:
        """Runs the call on the pool's agents, and always ends the run (workers stopped).

        The pool must be ready (`AgentPool.ready`, which `slurmrun.launcher.warm` calls).
        """
        self.pool.begin(self)
        try:
            try:
                self._hand_out()
                self.watch.begin(self.id)
                self._pump()
                result = self._collect()
            except SystemExit as e:  # `warm.sigterm_as_exit`: SLURM may be ending the job
                self._after_sigterm = e.code == 128 + signal.SIGTERM
                raise
            except (KeyboardInterrupt, Exception) as e:
                self.ending = True  # the outcome stands: the dump only looks
                self.watch.before_stop(e)
                raise
            else:
                self._succeeded = True
                return result
            finally:
                self.watch.close()
                self._end()
        except Exception as e:  # judged again: SLURM may have said meanwhile it ends the step
            failure = self.verdicts.after_end(e)
            if failure is e:
                raise
            raise failure from e
        finally:
            try:  # every line the run's workers wrote is shown before it ends (Ctrl-C: not)
                self._stage.close()
            finally:
                self.pool.finish(self)
                _release(self._handlers, own=self._own_handlers)

    def _pump(self) -> None:
        """Hands the pool's events to the run until it is finished (raises what fails it)."""
        pump(self.pool.events, self.pool.router, self._finished)

    def _end(self) -> None:
        """Tells every agent to stop the run's workers, and waits until each is idle.

        An agent that does not say so in time breaks the pool (the launcher then closes it);
        the run's outcome stands. Ctrl-C here leaves agents ending the run: the pool's next
        `ready` waits for them (bounded).
        """
        self.ending = True
        if self.pool.dead:  # silent agents answer nothing: waiting for them would only delay
            self.pool.breaks(f"agents declared dead: node ranks {sorted(self.pool.dead)}")
        busy = [s.agent for s in self._shares.values() if s.agent.run == self.id]
        keep = self.call.keep_workers and self._succeeded
        end = protocol.End(run=self.id, keep=keep, after_sigterm=self._after_sigterm).header()
        for agent in busy:
            if agent.closed or self.pool.broken:
                return  # the launcher closes the pool, which stops every worker
            self.pool.send(agent, end)
        deadline = time.monotonic() + self.pool.endings.stop_wait(self.call.grace) + IDLE_WAIT
        idle = all_of(busy, lambda agent: agent.run != self.id)
        ended = lambda: idle() or bool(self.pool.broken)  # noqa: E731
        if not pump(self.pool.events, self.pool.router, ended, deadline):
            late = [a.hostname for a in busy if a.run == self.id]
            self.pool.breaks(f"the agents on {late} did not end the run in time")

    # ------------------------------------------------------------------ hand-out
    def _hand_out(self) -> None:
        pool, call, out = self.pool, self.call, self.output
        order = [pool.agents[i] for i in range(len(pool.hostnames))]
        counts = (
            list(call.workers_per_host)
            if call.workers_per_host is not None
            else [a.hello.auto_workers for a in order]
        )
        # The default handlers show `show_ranks`; each worker's file is written by its agent where
        # the agents see the log directory, else here (then every line must come here).
        own = self._own_handlers
        agent_files = own and out.agents_write_logs and out.log_dir is not None
        if own and out.log_dir is not None:  # where the verdicts find each worker's file
            self.verdicts.files(out.log_dir, written_here=not agent_files)
        forward_all = (
            not own or (out.log_dir is not None and not agent_files) or out.show_ranks == "all"
        )
        if own:
            files_here = None if agent_files else out.log_dir
            self._handlers = default_handlers(
                pool.hostnames, files_here, out.log_level, out.show_ranks
            )
            begin_files(
                self._handlers, self.labels, counts, run_header(self.id, call.surroundings.title)
            )
        # What every agent's START shares is built once; each gets its own share on top.
        shared = _run_part(
            self.id,
            call,
            counts,
            order[0],
            log_level=out.log_level,
            log_dir=out.log_dir if agent_files else None,
            output_window=pool.credits.window,
        )
        offset = 0
        for agent, count in zip(order, counts, strict=True):
            self._shares[agent.node_rank] = Share(agent, count, offset)
            self._results_left += count
            self._done_left += 1
            share = protocol.AgentShare(
                workers=count,
                rank_offset=offset,
                node_rank=agent.node_rank,
                forward_ranks=None if forward_all else _shown(out.show_ranks, offset, count),
                log_name=self.labels[agent.node_rank],
            )
            agent.run = self.id  # busy until its IDLE for this run
            pool.send(agent, protocol.start_header(shared, share), call.payload)
            offset += count

    # ------------------------------------------------------------------ the run's messages
    def on_message(
        self, agent: PoolAgent, message: protocol.Message, frame: Frame, now: float
    ) -> None:
        """A message of this run (the pool routes only those here)."""
        share = self._shares[agent.node_rank]
        if isinstance(message, protocol.Log):
            rank = None if message.local_rank < 0 else share.rank_offset + message.local_rank
            label = self.labels[agent.node_rank]
            self._stage.put(
                agent.conn, message, frame.body, label=label, rank=rank, handlers=self._handlers
            )
            self.watch.heard(now)
        elif isinstance(message, protocol.Stacks):
            self.watch.on_stacks(agent.node_rank, message, bytes(frame.body))
        elif isinstance(message, protocol.Debugger):
            self._stage.flush()  # the lines the debugger printed before its prompt come first
            self.watch.on_debugger(agent.node_rank, message, bytes(frame.body))
        elif isinstance(message, protocol.DebugCompletions):
            self.watch.on_completions(agent.node_rank, message)
        elif self.ending:
            return  # the run's outcome stands: what its workers say now changes nothing
        elif isinstance(message, protocol.Result):
            self._on_result(share, message, frame, now)
        elif isinstance(message, protocol.Done):
            self._done_left -= not share.done
            share.done = True
        elif isinstance(message, protocol.Started):
            _on_started(self.id, self.watching.trace, self._shares, share, message)
            self.watch.heard(now)  # a first word: a quiet spell counts from here
        elif isinstance(message, protocol.Error | protocol.Died | protocol.Unhealthy):
            self.watch.sessions.rank_ended((agent.node_rank, message.local_rank))
            self.verdicts.worker_failed(share, message, frame, now)

    def on_closed(self, agent: PoolAgent, why: str) -> None:
        """An agent's connection ended during the run: fatal unless its results are all in."""
        share = self._shares.get(agent.node_rank)
        if not self.ending and share is not None and len(share.results) < share.workers:
            time.sleep(0.2)  # give the exit code a moment to appear, for the message
            detail = f" ({why})" if why else ""
            raise self.pool.exit_error(
                agent.node_rank, f"it closed its connection before all results{detail}"
            )

    def on_local(self, event: Local, now: float) -> None:
        """A request of another thread (stacks), or a line typed for a debugger."""
        self.watch.on_local(event)

    def on_tick(self, now: float) -> None:
        """Raises the failure that time alone reveals (a lone error without its cause)."""
        self.watch.on_tick(now)
        if not self.ending:
            self.verdicts.check_held(now)

    def _on_result(self, share: Share, result: protocol.Result, frame: Frame, now: float) -> None:
        local_rank = result.local_rank
        if not result.streamed:
            self._got_result(share, local_rank, frame, now)
        elif local_rank in share.streamed:
            self._got_result(share, local_rank, share.streamed.pop(local_rank), now)
        else:
            share.announced.add(local_rank)

    def _got_result(self, share: Share, local_rank: int, frame: Frame, now: float) -> None:
        self.watch.heard(now)
        self.watch.sessions.rank_ended((share.agent.node_rank, local_rank))
        self._results_left -= local_rank not in share.results
        share.results[local_rank] = frame
        self._last_result = now
        if self.watching.trace is not None:
            self.watching.trace.mark("first_result")
            self.watching.trace.mark("last_result", last=True)

    def on_streamed(self, conn: Connection, result: protocol.Result, frame: Frame) -> None:
        """A large result that arrived over a connection of its own (see worker._send_result)."""
        conn.close()
        local_rank = result.local_rank
        share = self._shares.get(result.node_rank)
        if (
            share is None
            or not 0 <= local_rank < share.workers
            or local_rank in share.results
            or local_rank in share.streamed
        ):
            conn.close()
            raise AgentFailedError(
                f"a result arrived for an unknown or finished worker (node rank "
                f"{result.node_rank!r}, local rank {result.local_rank!r})"
            )
        if local_rank in share.announced:
            share.announced.discard(local_rank)
            self._got_result(share, local_rank, frame, time.monotonic())
        else:
            share.streamed[local_rank] = frame

    # ------------------------------------------------------------------ the end
    def _finished(self) -> bool:
        if self._results_left > 0:
            return False
        # Output written just before returning may still be on its way: wait (briefly) for
        # every agent to say that its workers exited and their output was forwarded.
        return self._done_left <= 0 or time.monotonic() - self._last_result > DONE_WAIT

    def _collect(self) -> LaunchResult[Any]:
        return _values([self._shares[i] for i in range(len(self.pool.hostnames))])


def _shown(show_ranks: Literal["all"] | Collection[int], offset: int, count: int) -> list[int]:
    """The local ranks shown live of an agent whose first worker is global rank `offset`."""
    if show_ranks == "all":
        return list(range(count))
    return sorted(r - offset for r in show_ranks if offset <= r < offset + count)


def _run_part(
    run: int,
    call: Call,
    counts: list[int],
    first: PoolAgent,
    *,
    log_level: int,
    log_dir: str | None,
    output_window: int,
) -> protocol.RunStart:
    """What every agent's START of run `run` shares; `first` hosts rank 0."""
    surroundings = call.surroundings
    return protocol.RunStart(
        sys_path=surroundings.sys_path,
        cwd=surroundings.cwd,
        env=surroundings.env,
        unset=surroundings.unset,
        own_path=surroundings.own_path,
        title=surroundings.title,
        run=run,
        world_size=sum(counts),
        master_addr="127.0.0.1" if call.local_master else first.hello.addr,
        master_port=first.master_port,
        backend=call.backend,
        timeout=call.timeout,
        grace=call.grace,
        log_level=log_level,
        log_dir=log_dir,
        tasks_per_node=compress_counts(counts),
        keep=call.keep_workers,
        output_window=output_window,
        health_check=call.health_check,
        gpu_check=call.gpu_check,
        workers_per_item=call.workers_per_item,
    )


def _values(order: list[Share]) -> LaunchResult[Any]:
    """Every worker's return value, unpickled, by host in node-rank order."""
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


def _on_started(
    run_id: int,
    trace: Trace | None,
    shares: dict[int, Share],
    share: Share,
    started: protocol.Started,
) -> None:
    """An agent forked the run's workers (or handed the run to kept ones)."""
    share.started = True
    if started.fresh_why:
        log.warning(
            "run %d has new workers on %s: %s. What the last run's workers kept in "
            "slurmrun.worker_state() is gone.",
            run_id,
            share.hostname,
            started.fresh_why,
        )
    if trace is None:
        return
    trace.emit(
        WorkersStarted(
            host=share.hostname,
            node_rank=share.agent.node_rank,
            pids=tuple(started.pids),
            seconds=trace.seconds(),
        )
    )
    if all(s.started for s in shares.values()):
        trace.mark("workers_started")


def _release(handlers: list[logging.Handler], own: bool) -> None:
    """Closes the run's own handlers; flushes a caller's (a progress line's final state shows)."""
    if own:
        for handler in handlers:
            handler.close()
    else:
        flush_handlers(handlers)
