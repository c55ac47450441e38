"""The agent: one per node. It connects back to the launcher, forks workers and relays results.

Started by `slurmrun.node.agent_main` (which forks the worker spawner first) with the launcher's
address, port and secret in the environment (``SLURMRUN_LAUNCHER_ADDR``,
``SLURMRUN_LAUNCHER_PORT``, ``SLURMRUN_SECRET``). The spawner is forked before the secret is
read into any Python object, and both processes wipe every copy of it from their environment
(`slurmrun.node.spawner.forget_variable`), so no worker can find it in its memory.

The agent lives as long as its launcher keeps it (`slurmrun.protocol` draws the exchange):
each START forks that run's workers from the spawner, and END stops them; the agent then says
IDLE and waits for the next run, until CLOSE, the launcher's connection ending, or the
launcher's silence.

The agent never unpickles anything: `func` travels from the launcher to the workers, and the
workers' results travel back, as opaque bytes that the agent only forwards.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from slurmrun import allocation, protocol
from slurmrun.environment import FORWARDED_SIGNALS
from slurmrun.errors import signal_name
from slurmrun.logs import WorkerLog
from slurmrun.node.relay import Relay, WorkerLink
from slurmrun.node.spawner import Spawner, wait_any
from slurmrun.node.store_port import StorePort
from slurmrun.node.worker import WorkerSpec
from slurmrun.protocol import HEARTBEAT_VAR, HEARTBEATS_PER_TIMEOUT
from slurmrun.transport import (
    AuthenticationError,
    Connection,
    Frame,
    HandshakeBrokeOff,
    bound_unacknowledged_sends,
    client_handshake,
)

__all__ = ["main"]

HANDSHAKE_TIMEOUT = 30.0
DRAIN_TIMEOUT = 2.0
_POLL = 0.05
# How long an agent keeps trying to reach its launcher (seconds; the agent then exits with 1,
# which fails the launch at once, naming this host). A launcher that thousands of agents reach
# within a second can see its listen backlog full: such connects are refused or time out.
CONNECT_RETRY_VAR = "SLURMRUN_CONNECT_RETRY"
CONNECT_RETRY = 60.0
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 2.0
STREAM_CONNECT_RETRY = 2.0


def _exit_description(exitcode: int | None) -> tuple[str, str | None]:
    if exitcode is None:
        return "did not exit", None
    if exitcode < 0:
        name = signal_name(-exitcode)
        return f"was killed by {name}", name
    return f"exited with code {exitcode}", None


@dataclass
class Agent:
    """State of one agent process: kept from run to run, with each run's workers."""

    launcher: Connection
    hostname: str
    spawner: Spawner | None  # None: workers cannot start here (hello said why)
    connect: Callable[[], socket.socket]  # a new authenticated connection to the launcher
    store_port: StorePort = field(default_factory=StorePort)  # for the next run's rank 0
    silence: float = 15.0  # a launcher silent this long is gone (see _expect_heartbeats)
    # START frames, then None once the launcher closed, went away or went silent.
    inbox: queue.Queue[Frame | None] = field(default_factory=queue.Queue)
    gone: threading.Event = field(default_factory=threading.Event)  # no more runs
    run_stop: threading.Event = field(default_factory=threading.Event)  # END (or gone)
    workers: list[WorkerLink] = field(default_factory=list)  # this run's
    grace: float = 3.0
    relay: Relay = field(init=False)  # carries the workers' output and frames to the launcher
    # SLURM is ending our step: the workers got its SIGTERM and have until its SIGKILL.
    slurm_ending: threading.Event = field(default_factory=threading.Event)
    # TERMINATING was sent (once, and before any DIED that follows)
    _ending_said: bool = field(default=False, init=False)
    _ending_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.relay = Relay(self.launcher, self.connect)

    def _read_launcher(self) -> None:
        try:
            while True:
                frame = self.launcher.recv()
                if frame is None or frame.kind == protocol.CLOSE:
                    break
                if frame.kind == protocol.START:
                    self.run_stop.clear()  # here: an END right behind it must not be lost
                    self.inbox.put(frame)
                elif frame.kind == protocol.END:
                    self.run_stop.set()
        except BlockingIOError:
            _say(f"the launcher sent nothing for {self.silence:g} s: stopping the workers.")
        except (OSError, EOFError):  # EOFError: the launcher died in the middle of a frame
            pass
        finally:
            # Whatever ended the reader, the agent must stop waiting for runs: nothing else
            # would ever wake `serve`, and the agent would outlive its launcher.
            self.gone.set()
            self.run_stop.set()
            self.inbox.put(None)

    def _heartbeat(self, interval: float) -> None:
        while not self.gone.wait(interval):
            try:
                self.launcher.send({"t": protocol.HEARTBEAT})
            except OSError:
                self.gone.set()
                self.run_stop.set()

    def serve(self) -> None:
        """Runs every run the launcher starts, until it closes, goes away or goes silent."""
        while (frame := self.inbox.get()) is not None:
            if self.spawner is None:
                continue  # the launcher fails the run on our hello's error, and closes
            start = protocol.Start.from_header(frame.header)
            self.workers = []
            self.grace = start.grace
            try:
                self.spawn(start, bytes(frame.body))
                self.supervise()
            finally:
                self.stop_workers()
            self._forget_workers()
            if not self.gone.is_set():
                with contextlib.suppress(OSError):
                    self.launcher.send(protocol.Idle(master_port=self.store_port.renew()).header())

    def _forget_workers(self) -> None:
        """Waits (briefly) until the run's workers' output and results were forwarded."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        for worker in self.workers:
            for thread in [worker.relay, *worker.readers]:
                if thread is not None:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.log is not None:
                worker.log.close()
        self.workers = []

    def spawn(self, start: protocol.Start, func_payload: bytes) -> None:
        """Forks one worker per local rank and hands each the pickled function."""
        assert self.spawner is not None  # noqa: S101 - serve() runs no start without one
        n = start.workers
        store_listener = self._store_listener(start)
        for local_rank in range(n):
            spec = WorkerSpec(
                hostname=self.hostname,
                local_rank=local_rank,
                rank=start.rank_offset + local_rank,
                world_size=start.world_size,
                local_world_size=n,
                node_rank=start.node_rank,
                master_addr=start.master_addr,
                master_port=start.master_port,
                backend=start.backend,
                timeout=start.timeout,
                sys_path=tuple(start.sys_path),
                cwd=start.cwd,
                env=tuple(sorted(start.env.items())),
                log_level=start.log_level,
            )
            pairs: list[tuple[socket.socket, socket.socket]] = []
            fds: list[int] = []
            try:
                for _ in range(4):  # control, stdout, stderr, streams
                    pairs.append(socket.socketpair())
                fds = [theirs.fileno() for _, theirs in pairs]
                if local_rank == 0 and store_listener is not None:
                    fds.append(store_listener.fileno())  # rank 0 serves the store on it
                process = self.spawner.spawn(spec, fds)
            except BaseException:
                for mine, _ in pairs:
                    mine.close()
                raise
            finally:
                for _, theirs in pairs:
                    theirs.close()
                if local_rank == 0 and store_listener is not None:
                    store_listener.close()  # the worker holds it now (or the spawn failed)
            worker = WorkerLink(local_rank, process, Connection(pairs[0][0]), pairs[3][0])
            worker.outputs = [mine for mine, _ in pairs[1:3]]
            if start.log_dir is not None:
                worker.log = WorkerLog(start.log_dir, self.hostname, local_rank, start.log_level)
            worker.forward = start.forward_ranks is None or local_rank in start.forward_ranks
            self.relay.start(worker)
            self.workers.append(worker)
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.conn.send({"t": protocol.FUNC}, func_payload)
        with contextlib.suppress(OSError):
            pids = [w.process.pid for w in self.workers]
            self.launcher.send({"t": protocol.STARTED, "pids": pids})

    def _store_listener(self, start: protocol.Start) -> socket.socket | None:
        """The listening socket of the run's store, if rank 0 runs here on our port.

        With no process group of slurmrun's (``backend=None``, a torchrun-style script), the
        function binds ``MASTER_PORT`` itself: the port is released for it instead.
        """
        if start.rank_offset != 0 or start.workers == 0 or not self.store_port.held():
            return None
        if start.master_port != self.store_port.port:
            return None
        if start.backend is None:
            self.store_port.release()
            return None
        return self.store_port.take()

    def _judge(self, worker: WorkerLink) -> bool:
        """Called once a worker exited; reports it if it died without a result. True if it did."""
        worker.judged = True
        # The result and the last output may still be in flight on the sockets: let them land.
        for thread in [worker.relay, *worker.readers]:
            if thread is not None:
                thread.join(timeout=DRAIN_TIMEOUT)
        if worker.delivered:
            return False
        what, sig = _exit_description(worker.process.exitcode)
        died = protocol.Died(
            local_rank=worker.local_rank,
            exitcode=worker.process.exitcode,
            signal=sig,
            what=what,
            stderr_tail="\n".join(worker.last_lines),
        )
        self._say_terminating()  # first: the launcher then knows why the worker died
        with contextlib.suppress(OSError):
            self.launcher.send(died.header())
        return True

    def supervise(self) -> None:
        """Waits until every worker exited (or one died), then until the launcher says END.

        The launcher answers every report with END or CLOSE, and a launcher that is gone or
        silent ends the wait too (`_read_launcher`).
        """
        failed = False
        while not self.run_stop.is_set() and not failed:
            live = [w for w in self.workers if not w.judged]
            if not live:
                # Every result and every line of output has been forwarded.
                with contextlib.suppress(OSError):
                    self.launcher.send({"t": protocol.DONE})
                break
            exited = wait_any([w.process for w in live], _POLL)
            for worker in live:
                if worker.process in exited and self._judge(worker):
                    failed = True
        self.stop_workers()
        self.run_stop.wait()

    def forward_signal(self, signum: int) -> None:
        """Passes a signal from SLURM (e.g. ``--signal=USR1@60``) on to every live worker."""
        for worker in self.workers:
            if worker.process.is_alive() and worker.process.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(worker.process.pid, signum)

    def on_slurm_sigterm(self) -> None:
        """SLURM ends this step: every worker got the same SIGTERM, and SLURM's SIGKILL follows.

        The workers may use that time (to checkpoint): `stop_workers` then waits for them, and
        the launcher is told (by `announce_slurm_ending`'s thread: a signal handler must not
        take locks the main thread may hold), so that it waits for this agent as long.
        """
        self.slurm_ending.set()

    def announce_slurm_ending(self) -> None:
        """Runs in a thread of its own: tells the launcher once SLURM is ending the step."""
        while not self.slurm_ending.wait(1.0):
            if self.gone.is_set():
                return
        self._say_terminating()

    def _say_terminating(self) -> None:
        """Tells the launcher (once) that SLURM is ending this step, if it is."""
        with self._ending_lock:
            if self._ending_said or not self.slurm_ending.is_set():
                return
            self._ending_said = True
            _say(
                "SLURM is ending this step (SIGTERM, which the workers got too): waiting up to "
                f"{protocol.SLURM_TERM_WAIT:g} s for them to exit, or for SLURM to kill them."
            )
            with contextlib.suppress(OSError):
                self.launcher.send({"t": protocol.TERMINATING})

    def stop_workers(self) -> None:
        """SIGTERM every live worker, then SIGKILL those still alive after the grace period.

        When SLURM is ending the step, the workers got its SIGTERM already: a second one could
        cut a checkpoint short (a Python handler runs again), so they are only waited for, up
        to `protocol.SLURM_TERM_WAIT`; also when SLURM's SIGTERM comes during the grace period
        (the launcher's END can arrive first, when SLURM signals it too).
        """
        alive = [w.process for w in self.workers if w.process.is_alive()]
        ending = self.slurm_ending.is_set()
        if not ending:
            for process in alive:
                with contextlib.suppress(OSError):
                    process.terminate()
        start = time.monotonic()
        for process in alive:
            while process.is_alive():
                ending = ending or self.slurm_ending.is_set()
                grace = max(self.grace, protocol.SLURM_TERM_WAIT) if ending else self.grace
                left = start + grace - time.monotonic()
                if left <= 0:
                    break
                process.join(timeout=min(left, _POLL))
        for process in alive:
            if process.is_alive():
                with contextlib.suppress(OSError):
                    process.kill()
                process.join(timeout=5.0)
        for worker in self.workers:
            worker.conn.close()
            worker.streams.close()


def _hostname(environ: Mapping[str, str]) -> str:
    return (
        environ.get(protocol.HOSTNAME_VAR) or environ.get("SLURMD_NODENAME") or socket.gethostname()
    )


def _say(message: str) -> None:
    """A line for the agent's own log (srun's output file, or the local agent's log)."""
    print(f"slurmrun agent on {_hostname(os.environ)}: {message}", file=sys.stderr, flush=True)


def _expect_heartbeats(sock: socket.socket, silence: float) -> None:
    """Makes every receive on `sock` fail (BlockingIOError) after `silence` s without data.

    The launcher sends heartbeats; when its host vanishes (no FIN, no RST), nothing else would
    ever end a read, and the workers would keep their GPUs. Sends that stay unacknowledged
    that long fail too, so no thread waits on a launcher that is gone.
    """
    seconds, fraction = divmod(silence, 1.0)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(fraction * 1e6))
    )
    bound_unacknowledged_sends(sock, silence)


class Backoff:
    """When an agent tries to reach its launcher again, for at most `budget` seconds.

    After each failed try (refused, reset, timed out) it waits a random time between half and
    all of a delay that doubles from `BACKOFF_FIRST` to `BACKOFF_CAP`: agents that met a full
    backlog together do not come back together.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.tries = 0  # tries that failed so far
        self._deadline = time.monotonic() + budget
        self._delay = BACKOFF_FIRST

    def failed(self, error: BaseException) -> float:
        """Counts a failed try; returns how long to wait before the next one.

        Raises:
            ConnectionError: `error`, once the budget is spent (the message says how many
                tries over how long).
        """
        self.tries += 1
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(
                f"{self.tries} tries over {self.budget:g} s failed, the last with "
                f"{type(error).__name__}: {error}"
            ) from error
        wait = min(left, random.uniform(self._delay / 2, self._delay))  # noqa: S311 - jitter
        self._delay = min(BACKOFF_CAP, self._delay * 2)
        return wait


def connect_with_backoff(
    connect_once: Callable[[], socket.socket], budget: float
) -> tuple[socket.socket, int]:
    """Calls `connect_once` until it succeeds, for at most `budget` seconds (see `Backoff`).

    A handshake that timed out or broke off (`HandshakeBrokeOff`: a launcher crowded by
    strangers drops pending handshakes) is retried; a wrong proof (`AuthenticationError`) is
    not: a wrong secret stays wrong. (A launcher closes on a wrong proof of ours without a
    word, so an agent with a wrong secret tries until its budget is spent.)

    Returns:
        The connected socket and the number of tries it took.

    Raises:
        ConnectionError: the last failure, once `budget` is spent (the message says how many
            tries over how long).
        AuthenticationError: the launcher rejected our proof, or failed its own.
    """
    backoff = Backoff(budget)
    while True:
        try:
            return connect_once(), backoff.tries + 1
        except HandshakeBrokeOff as e:  # HandshakeTimeout too: crowded, or cut short
            time.sleep(backoff.failed(e))
        except AuthenticationError:
            raise
        except (OSError, EOFError) as e:
            time.sleep(backoff.failed(e))


def main(secret: bytes, spawner: Spawner | str) -> int:
    """Runs the agent; returns its exit code.

    Args:
        secret: the launch secret, already removed from the environment.
        spawner: the started worker spawner, or why workers cannot be started here (a broken
            env file), for the launcher.
    """
    try:
        return _run(secret, spawner)
    finally:
        if isinstance(spawner, Spawner):
            spawner.close()


def _run(secret: bytes, spawner: Spawner | str) -> int:
    problem = spawner if isinstance(spawner, str) else None
    addr = os.environ[protocol.LAUNCHER_ADDR_VAR]
    port = int(os.environ[protocol.PORT_VAR])
    heartbeat = float(os.environ.get(HEARTBEAT_VAR, "1.0"))
    silence = heartbeat * HEARTBEATS_PER_TIMEOUT
    hostname = _hostname(os.environ)

    retry = float(os.environ.get(CONNECT_RETRY_VAR, CONNECT_RETRY))

    def connect_once() -> socket.socket:
        sock = socket.create_connection((addr, port), timeout=HANDSHAKE_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, secret, HANDSHAKE_TIMEOUT)
        except BaseException:
            sock.close()
            raise
        return sock

    def connect() -> socket.socket:
        # A large result's own connection: a short try, as the agent can relay it instead.
        return connect_with_backoff(connect_once, min(retry, STREAM_CONNECT_RETRY))[0]

    try:
        sock = connect_with_backoff(connect_once, retry)[0]
    except ConnectionError as e:
        _say(f"cannot reach the launcher at {addr}:{port}: {e}")
        return 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    _expect_heartbeats(sock, silence)
    launcher = Connection(sock)
    # The store listens where the other nodes reach this one: our side of the launcher's route.
    store_port = StorePort(sock.getsockname()[0])
    hello = protocol.Hello(
        hostname=hostname,
        node_rank=int(os.environ.get(protocol.NODE_RANK_VAR, "-1")),
        addr=sock.getsockname()[0],
        auto_workers=allocation.agent_auto_workers(os.environ, hostname) if problem is None else 0,
        master_port=store_port.port,
        pid=os.getpid(),
        slurm_job=os.environ.get("SLURM_JOB_ID", ""),
        slurm_step=os.environ.get("SLURM_STEP_ID", ""),
        error=problem,
    )
    launcher.send(hello.header())
    agent = Agent(
        launcher=launcher,
        hostname=hostname,
        spawner=spawner if isinstance(spawner, Spawner) else None,
        connect=connect,
        store_port=store_port,
        silence=silence,
    )
    if "SLURM_STEP_ID" not in os.environ:
        # Inside a SLURM step, slurmstepd signals every process of the step itself (workers
        # included); forwarding there would deliver each signal twice.
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, lambda s, _: agent.forward_signal(s))
    else:
        signal.signal(signal.SIGTERM, lambda *_: agent.on_slurm_sigterm())
        threading.Thread(target=agent.announce_slurm_ending, daemon=True).start()
    threading.Thread(target=agent._read_launcher, daemon=True).start()
    threading.Thread(target=agent._heartbeat, args=(heartbeat,), daemon=True).start()
    try:
        agent.serve()
    finally:
        agent.gone.set()
        agent.run_stop.set()
        agent.stop_workers()
        launcher.close()
    return 0
