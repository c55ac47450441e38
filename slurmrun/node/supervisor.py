"""One run's workers on one node: forked, watched, stopped, and all they started ended.

The agent (`slurmrun.node.agent`) lives across runs; a `RunWorkers` lives for one. It forks
the run's workers from the spawner, tells the launcher when one dies without a result, stops
the survivors (SIGTERM to each worker's process group, the grace period, SIGKILL; or only a
wait when SLURM is ending the step), and at the end of the run ends every process the workers
started and left behind (`slurmrun.node.spawner.Spawner.end_strays`), so that their output
threads end, their log files close, and nothing of this run is shown as the next run's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun import protocol
from slurmrun.errors import signal_name
from slurmrun.logs import WorkerLog, run_header, worker_log_path
from slurmrun.map_messages import Item, ItemCancel, SlotRestart
from slurmrun.node.kept import adopt, servable
from slurmrun.node.link import say
from slurmrun.node.relay import Relay, WorkerLink, end_item
from slurmrun.node.spawner import Spawner, SpawnError, WorkerProcess
from slurmrun.node.store_port import StorePort
from slurmrun.node.worker import WorkerSpec, place_of
from slurmrun.transport import Connection
from slurmrun.waiting import wait_readable

__all__ = [
    "RunWorkers",
    "ToWorker",
    "exit_description",
    "no_stacks",
    "signal_group",
    "stop_workers",
]

# Once a worker exited: how long its result and last output may take to be forwarded.
DRAIN_TIMEOUT = 2.0
# Once the strays were ended: how long the output threads may take to see the end.
READER_JOIN = 2.0
# A worker SIGTERMed in a SLURM step: SLURM's signal to the agent may come a moment after the
# worker's death woke it; waited for this long, so that the death is told as SLURM's doing.
STEP_SIGTERM_WAIT = 0.5
_POLL = 0.05
# What the launcher sends to one worker through its agent (`RunWorkers.pass_on`).
ToWorker = protocol.DebugInput | protocol.DebugComplete | Item | ItemCancel | SlotRestart


def exit_description(exitcode: int | None) -> tuple[str, str | None]:
    """How a worker ended, in words, and the signal's name if a signal killed it."""
    if exitcode is None:
        return "did not exit", None
    if exitcode < 0:
        name = signal_name(-exitcode)
        return f"was killed by {name}", name
    return f"exited with code {exitcode}", None


def no_stacks(launcher: Connection, ask: protocol.AskStacks, why: str) -> None:
    """Answers `ask` for every worker of this agent at once (local rank -1): none, and why."""
    answer = protocol.Stacks(request=ask.request, source="none", note=why, run=ask.run)
    with contextlib.suppress(OSError):  # cut: the launcher sees the end
        launcher.send(answer.header())


def signal_group(process: WorkerProcess, signum: int) -> None:
    """Signals a live worker's process group: the worker and what it started and did not move.

    The worker leads the group (the spawner gave it a session of its own, which it cannot
    leave), so the group's signal is its one: a second, sent to its pid, would run a Python
    handler (a checkpoint) twice whenever the first was delivered in between.
    """
    if not process.is_alive():  # never signal a pid that the spawner may have reaped already
        return
    try:
        os.killpg(process.pid, signum)
    except OSError:
        process.send_signal(signum)


@dataclass
class RunWorkers:
    """The workers of one run on this node.

    Args:
        start: the run's share of this agent.
        spawner: forks the workers.
        hostname: this node's name, as the launcher knows it.
        launcher: the agent's connection to the launcher.
        relay: carries the workers' frames and output to the launcher.
        store_port: the port held for the run's store, if rank 0 runs here.
        slurm_ending: set once SLURM is ending the step (its SIGTERM reached the workers).
        say_terminating: tells the launcher that SLURM is ending the step (once).
        in_step: the agent runs in a SLURM step (SLURM's SIGTERM reaches the workers itself).
    """

    start: protocol.Start
    spawner: Spawner
    hostname: str
    launcher: Connection
    relay: Relay
    store_port: StorePort
    slurm_ending: threading.Event
    say_terminating: Callable[[], None]
    in_step: bool = False
    workers: list[WorkerLink] = field(default_factory=list)
    spawned: threading.Event = field(default_factory=threading.Event)  # every worker was forked

    def __post_init__(self) -> None:
        self._header = run_header(self.start.run, self.start.title)  # of each worker's log
        # A worker's final frame wakes `supervise` (a kept worker does not exit after it).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)

    # ------------------------------------------------------------------ start
    def spawn(
        self, func_payload: bytes, kept: list[WorkerLink] | None = None, fresh_why: str = ""
    ) -> None:
        """Forks one worker per local rank and hands each the pickled function.

        Args:
            func_payload: the pickled call.
            kept: the last run's workers, which take this run instead (`slurmrun.node.kept`).
            fresh_why: why the last run's workers could not, for the launcher's warning.

        Raises:
            SpawnError: the spawner is gone (what was forked is stopped by `finish`).
        """
        start = self.start
        if kept is not None:
            self.workers = kept
            for worker in kept:
                adopt(worker, start, self._wake_up)
                open_log(worker, self.start, self.hostname, self._header)
        else:
            self._fork_all()
        func = protocol.Func(run=start.run).header()
        for worker in self.workers:
            with contextlib.suppress(OSError):  # a worker that died already: judged as such
                worker.conn.send(func, func_payload)
        pids = [w.process.pid for w in self.workers]
        self.spawned.set()
        started = protocol.Started(
            run=start.run, pids=pids, reused=kept is not None, fresh_why=fresh_why
        )
        with contextlib.suppress(OSError):  # the launcher is gone: the agent's reader ends it
            self.launcher.send(started.header())

    def _fork_all(self) -> None:
        start = self.start
        store_listener = _store_listener(start, self.store_port)
        for local_rank in range(start.workers):
            spec = WorkerSpec(self.hostname, start, place_of(start, local_rank))
            listener = store_listener if local_rank == 0 else None
            self.workers.append(self._fork(spec, listener))

    def _fork(self, spec: WorkerSpec, store_listener: socket.socket | None) -> WorkerLink:
        pairs: list[tuple[socket.socket, socket.socket]] = []
        try:
            for _ in range(4):  # control, stdout, stderr, streams
                pairs.append(socket.socketpair())
            fds = [theirs.fileno() for _, theirs in pairs]
            if store_listener is not None:
                fds.append(store_listener.fileno())  # rank 0 serves the store on it
            process = self.spawner.spawn(spec, fds)
        except BaseException:
            for mine, _ in pairs:
                mine.close()
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
            if store_listener is not None:
                store_listener.close()  # the worker holds it now (or the spawn failed)
        worker = WorkerLink(spec.place.local_rank, process, Connection(pairs[0][0]), pairs[3][0])
        worker.run = self.start.run
        worker.outputs = [mine for mine, _ in pairs[1:3]]
        open_log(worker, self.start, self.hostname, self._header)
        forward = self.start.forward_ranks
        worker.forward = forward is None or worker.local_rank in forward
        worker.wake = self._wake_up
        self.relay.start(worker)
        return worker

    # ------------------------------------------------------------------ watch
    def supervise(self, ended: Callable[[], bool], lag: Callable[[], float]) -> None:
        """Waits until every worker exited, one died without a result, or `ended()`.

        Sends DONE when every worker exited with its result forwarded (or, for workers to be
        kept, forwarded its result); DIED (by `_judge`) for one that did not. Then stops
        whatever is left, unless DONE was sent: kept workers wait for END. `lag()`: how long
        to wait for SLURM's own SIGTERM first (`protocol.SIGTERM_LAG`).
        """
        failed = done = False
        keep = self.start.keep
        while not ended() and not failed:
            self._between()
            live = [w for w in self.workers if not w.judged]
            if all(keep and w.stays for w in live):
                with contextlib.suppress(OSError):  # the launcher is gone: nobody waits
                    self.launcher.send(protocol.Done(run=self.start.run).header())
                done = True
                break
            for worker in self._exited(live):
                if self._judge(worker) and self._ends_run(worker):
                    failed = True
        if not done:
            self.stop(lag())

    def _between(self) -> None:
        """What a kind of run does on each turn of `supervise` (a map's: `node.slot_workers`)."""

    def _ends_run(self, worker: WorkerLink) -> bool:
        """Whether `worker`'s death (reported) ends the run: it does, but in a map's run."""
        return True

    def _exited(self, live: list[WorkerLink]) -> list[WorkerLink]:
        """Those of `live` that exited, waiting up to `_POLL` for one to, or for a final frame."""
        wait_readable([*(w.process.sentinel for w in live), self._wake_r.fileno()], _POLL)
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        return [w for w in live if w.process.poll() is not None]

    def _wake_up(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: run over
            self._wake_w.send(b"w")

    def _judge(self, worker: WorkerLink) -> bool:
        """Called once a worker exited; reports it if it died without a result. True if it did."""
        worker.judged = True
        # Its result or error may still be on its way: the relay forwards it as one step (after
        # the logging records before it, which may wait for the launcher's window: a result is
        # never taken for a death because the launcher's terminal is slow). Its output is
        # waited for (`Relay.drain_output`) until nothing unread is left, not until the
        # sockets close: a process it started may hold them open.
        if worker.relay is not None and not worker.delivered:
            self.relay.join_relay(worker, DRAIN_TIMEOUT)
        # A death is not held back by a stalled terminal: the other ranks may wait for it.
        self.relay.drain_output(worker, DRAIN_TIMEOUT, hold=False)
        if worker.delivered:
            return False
        what, sig = exit_description(worker.process.exitcode)
        if self.in_step and worker.process.exitcode == -signal.SIGTERM:
            self.slurm_ending.wait(STEP_SIGTERM_WAIT)
        died = protocol.Died(
            run=self.start.run,
            local_rank=worker.local_rank,
            exitcode=worker.process.exitcode,
            signal=sig,
            what=what,
            stderr_tail="\n".join(worker.last_lines),
        )
        self.say_terminating()  # first: the launcher then knows why the worker died
        with contextlib.suppress(OSError):  # the launcher is gone: nobody waits
            self.launcher.send(died.header())
        return True

    def stacks(self, ask: protocol.AskStacks) -> None:
        """Answers the launcher's ASK_STACKS for every worker (`node.stacks_answer`).

        A report waits for the workers' answers and dumps the silent; a sample is only passed
        on (the workers answer it themselves; the launcher waits).
        """
        from slurmrun.node import stacks_answer  # noqa: PLC0415 - only when asked

        sample = not ask.dumps()
        if not (self.spawned.is_set() if sample else self.spawned.wait(ask.answer_wait)):
            no_stacks(self.launcher, ask, "its workers are starting")
            return
        answer = stacks_answer.ask_workers if sample else stacks_answer.answer_stacks
        answer(self.workers, self.launcher, ask)

    def pass_on(self, message: ToWorker, body: bytes) -> None:
        """Passes a message of the launcher on to worker `message.local_rank`.

        A line the user typed (or Tab's question) for its debugger, a map's item (a map's
        other orders: `slurmrun.node.slot_workers`).
        """
        if self.spawned.is_set() and 0 <= message.local_rank < len(self.workers):
            with contextlib.suppress(OSError):  # it exited: the launcher hears of that
                self.workers[message.local_rank].conn.send(message.header(), body)

    def forward_signal(self, signum: int) -> None:
        """Passes a signal from SLURM (e.g. ``--signal=USR1@60``) on to every live worker."""
        for worker in self.workers:
            worker.process.send_signal(signum)

    # ------------------------------------------------------------------ stop
    def stop(self, lag: float = 0.0) -> None:
        """Stops every live worker of the run (`stop_workers`)."""
        stop_workers(self.workers, self.start.grace, self.slurm_ending, lag)

    def finish(self, keep: bool = False, lag: float = 0.0) -> list[WorkerLink] | None:
        """Ends what the workers left behind, then their output threads and log files.

        Args:
            keep: the launcher keeps this run's workers for the next (END said so); they are
                kept if each is alive and forwarded its result.
            lag: how long to wait for SLURM's own SIGTERM first (`protocol.SIGTERM_LAG`).

        Returns:
            The workers kept (their threads and files go on), or None: every one was stopped.
        """
        kept = None
        if keep and self.workers and all(servable(w) for w in self.workers):
            kept, self.workers = self.workers, []
            for worker in kept:
                worker.wake = None
        self.stop(lag)
        strays = 0
        if self.workers or kept:  # (a spawner still importing torch would answer only once done)
            with contextlib.suppress(SpawnError):  # a dead spawner took its strays with it
                strays = self.spawner.end_strays()
        if strays:
            say(
                self.hostname,
                f"ended {strays} process(es) that the workers of run {self.start.run} had "
                "started and left running",
            )
        # Every process that held the workers' sockets is gone: their threads see the end.
        deadline = time.monotonic() + READER_JOIN
        for worker in self.workers:
            for thread in [worker.relay, *worker.readers]:
                if thread is not None:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
            worker.conn.close()
            worker.streams.close()
            if worker.log is not None:
                worker.log.close()
            end_item(worker)
        self.workers = []
        self._wake_r.close()
        self._wake_w.close()
        return kept


def open_log(worker: WorkerLink, start: protocol.Start, hostname: str, header: bytes) -> None:
    """Begins the run's part of `worker`'s log file (`header`), which exists from now on.

    A kept worker whose run logs elsewhere (a later launcher's folder: a reservation's next
    script) writes there from now on.
    """
    if start.log_dir is None:
        return
    name = start.log_name or hostname
    path = worker_log_path(start.log_dir, name, worker.local_rank)
    if worker.log is None or worker.log.path != path:
        if worker.log is not None:
            worker.log.close()
        worker.log = WorkerLog(start.log_dir, name, worker.local_rank, start.log_level)
    worker.log.begin(header)


def stop_workers(
    workers: list[WorkerLink], grace: float, slurm_ending: threading.Event, lag: float = 0.0
) -> None:
    """SIGTERM every live worker's group, then SIGKILL what is alive after `grace` seconds.

    When SLURM is ending the step, the workers got its SIGTERM already: a second one could
    cut a checkpoint short (a Python handler runs again), so they are only waited for, up
    to `protocol.SLURM_TERM_WAIT`; also when SLURM's SIGTERM comes during the grace period.
    The launcher's END can arrive first when SLURM signals it too: `lag` (END said the
    launcher got SIGTERM) is how long SLURM's own signal is waited for before ours is sent.
    """
    alive = [w.process for w in workers if w.process.is_alive()]
    ending = slurm_ending.is_set() or (bool(alive) and lag > 0 and slurm_ending.wait(lag))
    if not ending:
        for process in alive:
            signal_group(process, signal.SIGTERM)
    start = time.monotonic()
    for process in alive:
        while process.is_alive():
            ending = ending or slurm_ending.is_set()
            wait = max(grace, protocol.SLURM_TERM_WAIT) if ending else grace
            left = start + wait - time.monotonic()
            if left <= 0:
                break
            process.join(timeout=min(left, _POLL))
    for process in alive:
        if process.is_alive():
            signal_group(process, signal.SIGKILL)
            process.join(timeout=5.0)


def _store_listener(start: protocol.Start, store_port: StorePort) -> socket.socket | None:
    """The listening socket of the run's store, if rank 0 runs here on our port.

    With no process group of slurmrun's (``backend=None``, a torchrun-style script), the
    function binds ``MASTER_PORT`` itself: the port is released for it instead.
    """
    if start.rank_offset != 0 or start.workers == 0 or not store_port.held():
        return None
    if start.master_port != store_port.port:
        return None
    if start.backend is None:
        store_port.release()
        return None
    return store_port.take()
